"""Turning chat messages into token ids, once for an opening turn and as a delta for follow-ups.

A session's transcript is exactly the tokens the model saw and produced. A follow-up must
append only what the chat template would add after the last assistant turn, so we render a
probe conversation with and without the new messages and take the difference:

    P = render([user, assistant])                     -> "...USER: u ASSISTANT: a</s>"
    F = render([user, assistant] + new, gen_prompt)   -> P + " USER: q ASSISTANT:"
    delta = F[len(P):]

The text after the assistant content in P (``end_of_turn``, "</s>" here) is prepended when the
model did not itself end its answer with EOS (it stopped on max_tokens or a stop string); when it
did, only what the template puts after that EOS is (ChatML: the newline after <|im_end|>).

Templates differ in the content they take (``detect_content_form``): multimodal ones take a list of
parts (``[{"type": "text", "text": ...}, {"type": "image"}]``), many text ones only a string (they
concatenate ``message['content']``). The formatter finds out once, from the probe, and renders
every message in the form its template takes; what the template renders is never changed. A
system prompt a template injects when the conversation has none (SmolLM2's) is in P and F alike,
so an opening carries it and a follow-up's delta does not repeat it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

from session.errors import BadRequest, ConfigError
from session.types import ImagePart, Message, TextPart

_USER_PROBE = "\u2063probe-user\u2063"
_ASSISTANT_PROBE = "\u2063probe-assistant\u2063"
LIST_CONTENT, STRING_CONTENT = "list", "string"
TEXT_PART_SEPARATOR = "\n"  # between a message's text parts, for a template that takes a string (as vLLM joins them)


@dataclass(frozen=True)
class PromptPiece:
    token_ids: list[int]
    num_images: int  # images in token_ids (each placeholder expanded to that image's count)


@dataclass(frozen=True)
class RenderedTurn:
    """A turn's prompt rendered ahead, on the caller's thread (``ChatFormatter.render_turn``), so that a
    long prompt's templating and tokenizing never stall the engine's steps. A first turn (or a
    stateless request) has its opening; a follow-up has both continuations, because whether the
    previous answer ended with EOS is known only once the session's request in flight is done."""

    opening: PromptPiece | None = None
    after_eos: PromptPiece | None = None
    after_cut: PromptPiece | None = None

    def piece(self, first_turn: bool, ended_with_eos: bool) -> PromptPiece | None:
        """The piece this turn needs now; None when it was not rendered ahead (the engine renders it)."""
        if first_turn:
            return self.opening
        return self.after_eos if ended_with_eos else self.after_cut


class ChatFormatter:
    def __init__(self, tokenizer, *, image_token: str | None, image_token_id: int | None,
                 eos_token_ids: tuple[int, ...]):
        if tokenizer.chat_template is None:
            raise BadRequest("the model's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.image_token_id = image_token_id
        self.eos_token_ids = eos_token_ids
        self.content_form = detect_content_form(lambda messages: self._render(messages, generation_prompt=False))
        probe = [self._probe_message("user", _USER_PROBE), self._probe_message("assistant", _ASSISTANT_PROBE)]
        self._probe = probe
        self._probe_text = self._render(probe, generation_prompt=False)
        self.end_of_turn = self._probe_text.split(_ASSISTANT_PROBE, 1)[1]
        self._eos_texts = {tokenizer.convert_ids_to_tokens(i) for i in eos_token_ids}

    def opening(self, messages: tuple[Message, ...], image_tokens: tuple[int, ...] = (),
                tools: list[dict] | None = None) -> PromptPiece:
        """The whole prompt of a first turn (or a stateless request), with BOS. ``image_tokens``: the
        placeholder count of each image of ``messages``, in order (``session.families.vision.Images.num_tokens``).
        ``tools``: function definitions for the template's own ``tools`` variable."""
        text = self._render_request([self._template_message(m) for m in messages], tools)
        return self._tokenize(text, messages, image_tokens, add_special_tokens=True)

    def followup(self, messages: tuple[Message, ...], ended_with_eos: bool,
                 image_tokens: tuple[int, ...] = ()) -> PromptPiece:
        """Only the tokens a follow-up adds after the transcript so far."""
        full = self._render_request(self._probe + [self._template_message(m) for m in messages])
        if not full.startswith(self._probe_text):
            raise BadRequest("this model's chat template cannot continue a conversation incrementally")
        return self._tokenize(self._closing(ended_with_eos) + full[len(self._probe_text):], messages,
                              image_tokens, add_special_tokens=False)

    def render_turn(self, messages: tuple[Message, ...], image_tokens: tuple[int, ...],
                    first_turn: bool, tools: list[dict] | None = None) -> RenderedTurn:
        """Every piece a turn may need (``RenderedTurn``). Thread-safe: templating is pure and a fast
        tokenizer encodes concurrently while nothing changes its truncation or padding. ``tools`` are
        rendered into an opening only: templates put them at the conversation's start (the system
        turn), which a follow-up's transcript already holds."""
        if first_turn:
            return RenderedTurn(opening=self.opening(messages, image_tokens, tools))
        after_eos = self.followup(messages, True, image_tokens)
        same = self._closing(True) == self._closing(False)
        return RenderedTurn(after_eos=after_eos,
                            after_cut=after_eos if same else self.followup(messages, False, image_tokens))

    def _closing(self, ended_with_eos: bool) -> str:
        """What closes the previous answer's turn: the template's end of turn, less the EOS the model
        already wrote (ChatML's "<|im_end|>\n" after a model-written <|im_end|> is "\n")."""
        end_of_turn = self.end_of_turn
        if ended_with_eos:
            stripped = end_of_turn.lstrip()
            for eos_text in self._eos_texts:
                if eos_text and stripped.startswith(eos_text):
                    return stripped[len(eos_text):]
        return end_of_turn

    def _probe_message(self, role: str, text: str) -> dict:
        return _list_message(role, text) if self.content_form == LIST_CONTENT else {"role": role, "content": text}

    def _template_message(self, message: Message) -> dict:
        """A message in the form the template takes: its parts, or its text parts joined."""
        if self.content_form == LIST_CONTENT:
            return {"role": message.role, "content": message.template_content(), **message.template_extras()}
        if any(isinstance(p, ImagePart) for p in message.parts):
            raise BadRequest("this model's chat template takes text content only; remove the image_url parts")
        text = TEXT_PART_SEPARATOR.join(p.text for p in message.parts if isinstance(p, TextPart))  # all of them
        return {"role": message.role, "content": text, **message.template_extras()}

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                                  tokenize=False)

    def _render_request(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """A request's messages rendered; the template refusing them (its raise_exception: roles out of
        order, and the like) is the client's error."""
        try:
            return self._render(messages, generation_prompt=True, tools=tools)
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the model's chat template refused these messages: {exc}") from None

    def _tokenize(self, text: str, messages: tuple[Message, ...], image_tokens: tuple[int, ...],
                  add_special_tokens: bool) -> PromptPiece:
        num_images = sum(isinstance(p, ImagePart) for m in messages for p in m.parts)
        if num_images and self.image_token_id is None:
            raise BadRequest("this model is text-only; remove the image_url parts")
        if num_images != len(image_tokens):
            raise BadRequest(f"the messages have {num_images} images but {len(image_tokens)} were given")
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if self.image_token_id is not None and ids.count(self.image_token_id) != num_images:
            raise BadRequest(f"the prompt has {ids.count(self.image_token_id)} image placeholders for "
                             f"{num_images} images; do not write {self.image_token!r} in text")
        if num_images:
            counts = iter(image_tokens)
            expanded: list[int] = []
            for token in ids:
                expanded.extend([token] * next(counts) if token == self.image_token_id else [token])
            ids = expanded
        return PromptPiece(token_ids=ids, num_images=num_images)


def detect_content_form(render) -> str:
    """Which content the chat template takes, from a probe conversation ``render(messages) -> text``:
    LIST_CONTENT when it renders a list of parts as their text, else STRING_CONTENT when it renders a
    string. A string-only template either raises on a list (``'...' + message['content']``: TypeError)
    or prints the list's Python repr into the prompt; both mean strings. Lists win where both work
    (multimodal templates take both, and only lists carry images). Raises ConfigError when neither
    renders the probe's text. Who calls this: ``ChatFormatter``, once at start-up."""
    failures = []
    for form, make in ((LIST_CONTENT, _list_message), (STRING_CONTENT, lambda role, text: {"role": role,
                                                                                            "content": text})):
        try:
            text = render([make("user", _USER_PROBE), make("assistant", _ASSISTANT_PROBE)])
        except Exception as exc:  # jinja2's errors, or the TypeError of str + list inside the template
            failures.append(f"{form} content: {type(exc).__name__}: {exc}")
            continue
        if _USER_PROBE in text and _ASSISTANT_PROBE in text and "'type': 'text'" not in text:
            return form
        failures.append(f"{form} content: the probe's text is not rendered as text")
    raise ConfigError("the model's chat template renders neither list nor string message content ("
                      + "; ".join(failures) + ")")


def _list_message(role: str, text: str) -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}]}
