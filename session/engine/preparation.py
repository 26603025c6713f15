"""What a caller does on its own thread before it submits: render and tokenize a turn, preprocess
its images, compile its grammar, and the checks that need only the model's parts.

Who calls this: the TorchServe handler, the API layer, tests and benchmarks, from any thread,
through ``Engine`` (session/engine/loop.py), which is a ``Preparation``. Nothing here touches the
loop thread's state (sessions, the scheduler, the inbox): it reads the parts ``assemble`` built.
"""

from __future__ import annotations

import threading

from session.config import EngineConfig
from session.engine.assembly import Parts, preprocess_images
from session.engine.prompt import PromptPiece, RenderedTurn
from session.errors import AdapterNotFound, BadRequest
from session.families.vision import Images
from session.model.grammar import Grammar, GrammarCompiler
from session.model.threads import one_thread_here
from session.types import Constraint, new_session_id


class Preparation:
    def __init__(self, config: EngineConfig, parts: Parts):
        self.config = config
        self.parts = parts  # typed (engine.parts.store, ...): tests and benchmarks read them
        self._grammars: GrammarCompiler | None = None  # built on first use (compile_grammar)
        self._grammar_lock = threading.Lock()

    def knows_adapter(self, name: str) -> bool:
        """Whether ``name`` is a registered adapter (a request's "model" may name one). Any thread."""
        registry = self.parts.adapters
        if registry is None:
            return False
        try:
            registry.get(name)
        except AdapterNotFound:
            return False
        return True

    def render_turn(self, messages, images: Images, first_turn: bool, tools: list[dict] | None = None) -> RenderedTurn:
        """A turn's prompt, rendered and tokenized on the caller's thread (``RenderedTurn``); ``tools``
        go to the chat template of an opening (``ChatFormatter.render_turn``)."""
        return self.parts.formatter.render_turn(messages, images.num_tokens, first_turn, tools)

    def render_prompt(self, prompt: str | tuple[int, ...]) -> RenderedTurn:
        """A /v1/completions prompt as an opening: text tokenized as it is (BOS added, no chat template),
        or token ids checked against the vocabulary. Runs on the caller's thread."""
        if isinstance(prompt, str):
            ids = self.parts.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = list(prompt)
            vocab_size = self.parts.runner.info.vocab_size
            if max(ids) >= vocab_size:
                raise BadRequest(f"prompt token id {max(ids)} is not in the vocabulary (ids are below {vocab_size})")
        image_id = self.parts.runner.info.image_token_id
        if image_id is not None and image_id in ids:
            raise BadRequest("a completions prompt carries no images: it must not hold the image token")
        return RenderedTurn(opening=PromptPiece(token_ids=ids, num_images=0))

    def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (special tokens kept: a prompt echoed as it was given). Any thread."""
        text = self.parts.tokenizer.decode(token_ids)
        assert isinstance(text, str)  # a list of ids decodes to one string (a batch would give a list)
        return text

    def image_size_check(self):
        """The model's check of an image's (height, width), run on its header before the pixels are
        decoded (``ImagePreprocessor.check_size``); None for a text-only model."""
        vision = self.parts.vision
        return None if vision is None else vision.check_size

    def preprocess_images(self, images: list) -> Images:
        """PIL images -> Images (pixels, original sizes, token counts). Runs in the caller's thread
        (CPU work, no model), on that thread alone: a parallel operator here would give the caller an
        OpenMP team beside the engine's, which slows every decode step after it (``one_thread_here``)."""
        with one_thread_here():
            return preprocess_images(self.parts.vision, images)

    def new_session_id(self) -> str:
        return new_session_id(self.config.session_id_tag)

    def compile_grammar(self, constraint: Constraint) -> Grammar:
        """A request's constraint compiled (or found cached) on the caller's thread, never the loop's:
        ``GenerationRequest.grammar``. The compiler (a scan of the vocabulary) is built on first use."""
        return self._grammar_compiler().compile(constraint)

    def special_token_ids(self, texts: tuple[str, ...]) -> dict[str, int]:
        """Which of ``texts`` are single special tokens of the vocabulary, by id (tool-call markers
        in a grammar). Any thread; builds the grammar compiler on first use."""
        return self._grammar_compiler().special_token_ids(texts, self.parts.tokenizer)

    @property
    def chat_template(self) -> str | None:
        return self.parts.tokenizer.chat_template

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammars is None:
                info = self.parts.runner.info
                self._grammars = GrammarCompiler(self.parts.tokenizer, info.vocab_size, info.eos_token_ids,
                                                 max_cached=self.config.max_cached_grammars)
            return self._grammars

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (log-probabilities name tokens by it). Any thread."""
        return [self.decode([token_id]) for token_id in token_ids]
