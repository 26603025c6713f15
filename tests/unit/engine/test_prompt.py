"""session/engine/prompt.py ChatFormatter with the real demo tokenizer (models/llava-tiny)."""

from __future__ import annotations

import json
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import pytest
import transformers

from session.engine.prompt import ChatFormatter
from session.errors import BadRequest, ConfigError
from session.types import ImagePart, Message, TextPart

REPO = Path(__file__).resolve().parents[3]
IMAGE = ImagePart("data:image/png;base64,iVBORw0KGgo=")  # never decoded here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = REPO / "models" / "llava-tiny"
    if not (path / "config.json").exists():  # `make test` builds it first; build it here otherwise
        out = tmp_path_factory.mktemp("models")
        subprocess.run([sys.executable, "-m", "model_store.build_models", "--only", "tiny", "--out", str(out)],
                       cwd=REPO, check=True)
        path = out / "llava-tiny"
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoProcessor.from_pretrained(str(model_dir)).tokenizer


@pytest.fixture(scope="module")
def num_image_tokens(model_dir) -> int:
    vision = json.loads((model_dir / "config.json").read_text())["vision_config"]
    return (vision["image_size"] // vision["patch_size"]) ** 2  # "default" strategy drops the CLS token


@pytest.fixture(scope="module")
def image_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<image>")


@pytest.fixture(scope="module")
def formatter(tokenizer, image_id, num_image_tokens) -> ChatFormatter:
    return ChatFormatter(tokenizer, image_token="<image>", image_token_id=image_id,
                         eos_token_ids=(tokenizer.eos_token_id,))


def user(*parts) -> Message:
    return Message("user", tuple(TextPart(p) if isinstance(p, str) else p for p in parts))


def assistant(text: str) -> Message:
    return Message("assistant", (TextPart(text),))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def image_runs(ids: list[int], image_id: int) -> list[int]:
    """Lengths of the maximal runs of image_id in ids, in order."""
    runs, current = [], 0
    for token in ids + [None]:
        if token == image_id:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs


def test_demo_model_facts(tokenizer, image_id, num_image_tokens):
    assert num_image_tokens == 16
    assert image_id == 4
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == 2
    assert encode(tokenizer, "</s>") == [tokenizer.eos_token_id]


def test_end_of_turn_is_eos(formatter):
    assert formatter.end_of_turn == "</s>"


def test_opening_with_image_and_text(formatter, tokenizer, image_id):
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert rendered == "USER: <image>\nWhat is this? ASSISTANT:"
    piece = formatter.opening((user(IMAGE, "What is this?"),), (16,))
    ids = piece.token_ids
    assert piece.num_images == 1
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(image_id) == 16
    assert image_runs(ids, image_id) == [16]
    without_images = [t for t in ids[1:] if t != image_id]
    assert tokenizer.decode(without_images) == rendered.replace("<image>", "")
    assert tokenizer.decode(without_images) == "USER: \nWhat is this? ASSISTANT:"
    # Exactly the tokenizer's ids for the rendering, with the one placeholder expanded in place.
    placeholder_ids = tokenizer(rendered)["input_ids"]
    at = placeholder_ids.index(image_id)
    assert ids == placeholder_ids[:at] + [image_id] * 16 + placeholder_ids[at + 1:]


def test_opening_text_only(formatter, tokenizer, image_id):
    piece = formatter.opening((user("Hello there"),))
    assert piece.num_images == 0
    assert image_id not in piece.token_ids
    assert piece.token_ids == [tokenizer.bos_token_id] + encode(tokenizer, "USER: Hello there ASSISTANT:")


def test_opening_with_two_images(formatter, image_id):
    piece = formatter.opening((user(IMAGE, IMAGE, "Compare them."),), (16, 16))
    assert piece.num_images == 2
    assert piece.token_ids.count(image_id) == 32
    assert image_runs(piece.token_ids, image_id) == [16, 16]


def test_each_image_expands_to_its_own_count(formatter, image_id):
    """Anyres models (LLaVA-NeXT): the count follows each image's size, in prompt order."""
    piece = formatter.opening((user(IMAGE, "First."), assistant("Ok."), user(IMAGE, IMAGE, "More?")), (36, 68, 5))
    assert piece.num_images == 3
    assert image_runs(piece.token_ids, image_id) == [36, 68, 5]


def test_a_count_per_image_is_required(formatter):
    with pytest.raises(BadRequest) as info:
        formatter.opening((user(IMAGE, IMAGE, "Compare them."),), (16,))
    assert info.value.message == "the messages have 2 images but 1 were given"


def test_two_images_in_two_messages(formatter, image_id):
    piece = formatter.opening((user(IMAGE, "First."), assistant("Ok."), user(IMAGE, "Second?")), (16, 16))
    assert piece.num_images == 2
    assert image_runs(piece.token_ids, image_id) == [16, 16]


def test_followup_after_eos_is_exactly_the_new_turn(formatter, tokenizer):
    piece = formatter.followup((user("And that?"),), ended_with_eos=True)
    assert piece.num_images == 0
    assert piece.token_ids == encode(tokenizer, "USER: And that? ASSISTANT:")
    assert tokenizer.bos_token_id not in piece.token_ids
    assert tokenizer.eos_token_id not in piece.token_ids


def test_followup_without_eos_first_closes_the_answer(formatter, tokenizer):
    piece = formatter.followup((user("And that?"),), ended_with_eos=False)
    eos_ids = encode(tokenizer, "</s>")
    assert piece.token_ids[: len(eos_ids)] == eos_ids == [tokenizer.eos_token_id]
    assert piece.token_ids[len(eos_ids):] == encode(tokenizer, "USER: And that? ASSISTANT:")
    assert tokenizer.bos_token_id not in piece.token_ids


def test_followup_with_an_image(formatter, tokenizer, image_id):
    piece = formatter.followup((user(IMAGE, "And this one?"),), ended_with_eos=True, image_tokens=(16,))
    assert piece.num_images == 1
    assert image_runs(piece.token_ids, image_id) == [16]
    assert tokenizer.decode([t for t in piece.token_ids if t != image_id]) == "USER: \nAnd this one? ASSISTANT:"


def test_session_transcript_equals_the_stateless_prompt(formatter, tokenizer):
    """opening + answer + EOS + followup == the opening of the whole conversation (docs/DESIGN.md, "Invariants")."""
    first, second = user(IMAGE, "What is this?"), user("And that?")
    stateful = (formatter.opening((first,), (16,)).token_ids + encode(tokenizer, " It is a cat.")
                + [tokenizer.eos_token_id] + formatter.followup((second,), ended_with_eos=True).token_ids)
    stateless = formatter.opening((first, assistant("It is a cat."), second), (16,)).token_ids
    assert stateful == stateless


@pytest.mark.parametrize("text", ["look: <image>", "<image>"])
def test_literal_image_token_in_text_without_an_image_is_refused(formatter, text):
    with pytest.raises(BadRequest) as info:
        formatter.opening((user(text),))
    assert info.value.status == 400
    assert info.value.message == ("the prompt has 1 image placeholders for 0 images; "
                                  "do not write '<image>' in text")


def test_literal_image_token_in_a_followup_is_refused(formatter):
    with pytest.raises(BadRequest) as info:
        formatter.followup((user("what about <image>?"),), ended_with_eos=True)
    assert "do not write '<image>' in text" in info.value.message


def test_literal_image_token_next_to_a_real_image_is_refused(formatter):
    with pytest.raises(BadRequest) as info:
        formatter.opening((user(IMAGE, "is <image> this?"),), (16,))
    assert info.value.message.startswith("the prompt has 2 image placeholders for 1 images")


def test_text_only_model_refuses_images(tokenizer):
    formatter = ChatFormatter(tokenizer, image_token=None, image_token_id=None,
                              eos_token_ids=(tokenizer.eos_token_id,))
    with pytest.raises(BadRequest) as info:
        formatter.opening((user(IMAGE, "hi"),))
    assert info.value.message == "this model is text-only; remove the image_url parts"


# ------------------------------------------------------------ templates that take strings, lists, or neither

# SmolLM2-135M-Instruct's template (ChatML): it concatenates message['content'] as a string, and injects
# a system prompt when the conversation has none.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Prints content as it is: a list would become its Python repr in the prompt.
PRINTS_CONTENT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
# Iterates the parts: a string has none.
ITERATES_PARTS = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
                  "</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def with_template(tokenizer, template: str):
    copy = deepcopy(tokenizer)
    copy.chat_template = template
    return copy


def text_formatter(tokenizer) -> ChatFormatter:
    return ChatFormatter(tokenizer, image_token=None, image_token_id=None, eos_token_ids=(tokenizer.eos_token_id,))


@pytest.mark.parametrize("template, form", [(SMOLLM2_TEMPLATE, "string"), (PRINTS_CONTENT, "string"),
                                            (ITERATES_PARTS, "list")])
def test_the_content_form_the_template_takes_is_detected(tokenizer, formatter, template, form):
    assert text_formatter(with_template(tokenizer, template)).content_form == form
    assert formatter.content_form == "list"  # the demo LLaVA's template takes both: lists, which carry images


def test_a_string_template_renders_what_the_model_would_be_given(tokenizer):
    smol = with_template(tokenizer, SMOLLM2_TEMPLATE)
    formatter = text_formatter(smol)
    piece = formatter.opening((user("Hi there", "and hello"),))
    expected = smol.apply_chat_template([{"role": "user", "content": "Hi there\nand hello"}],
                                        add_generation_prompt=True, tokenize=False)
    assert expected.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # injected
    assert piece.token_ids == smol(expected)["input_ids"]


def test_a_string_template_continues_a_session_as_the_stateless_prompt(tokenizer):
    """The injected system prompt is in the opening once, and the follow-up's delta does not repeat it."""
    smol = with_template(tokenizer, SMOLLM2_TEMPLATE)
    formatter = text_formatter(smol)
    first, second = user("What is this?"), user("And that?")
    followup = formatter.followup((second,), ended_with_eos=False)
    assert "system" not in smol.decode(followup.token_ids)
    stateful = (formatter.opening((first,)).token_ids + encode(smol, " It is a cat.") + followup.token_ids)
    stateless = formatter.opening((first, assistant(" It is a cat."), second)).token_ids
    assert smol.decode(stateful) == smol.decode(stateless)
    assert formatter.end_of_turn == "<|im_end|>\n"


def test_a_string_template_refuses_images_with_a_clear_400(tokenizer, image_id):
    smol = with_template(tokenizer, SMOLLM2_TEMPLATE)
    formatter = ChatFormatter(smol, image_token="<image>", image_token_id=image_id,
                              eos_token_ids=(smol.eos_token_id,))
    with pytest.raises(BadRequest) as info:
        formatter.opening((user(IMAGE, "hi"),), (16,))
    assert info.value.message == "this model's chat template takes text content only; remove the image_url parts"


def test_a_template_that_renders_neither_form_stops_start_up_with_both_reasons(tokenizer):
    broken = with_template(tokenizer, "{{ raise_exception('broken on purpose') }}")
    with pytest.raises(ConfigError) as info:
        text_formatter(broken)
    assert "renders neither list nor string message content" in info.value.args[0]
    assert info.value.args[0].count("broken on purpose") == 2
