"""Qwen2-VL and Qwen2.5-VL at the ModelRunner level (M-RoPE positions given to prefill, rope deltas to decode), token-exact against transformers'
own ``generate`` in float32: turn 1 with an image at three sizes and aspect ratios, a stateless
multi-turn conversation with two images, and a 3-turn session (a second image in turn 2, a text-only
turn 3) where each turn prefills only its new tokens after the cached ones, at positions carried by
the session's rope delta, and equals ``generate`` over the whole transcript's ids and images.

Also: the processor loaded without torchvision gives the pixels and grids the PIL image processor
gives, the chat formatter plus per-image counts gives the processor's ids, and the counts respect
min_pixels / max_pixels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_store.build_qwen_vl import FAMILIES, MAX_PIXELS, MIN_PIXELS, ensure
from session.engine.prompt import ChatFormatter
from session.families.mrope import rope_delta, segment_positions
from session.families.qwen_vl import QwenVLGeometry, image_grid, image_token_count, load_processor
from session.model.runner import ModelRunner
from session.types import ImagePart, Message, TextPart
from tests.conftest import image_url, make_image

# (width, height) as PIL takes them -> <|image_pad|> tokens: 28 px per merged token on each side.
SIZES = {(56, 56): 4, (140, 84): 15, (56, 140): 10}
MAX_NEW = 12
QUESTIONS = ["What is in the picture?", "And in this one?", "Which of the two is brighter?"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def demo(request):
    from transformers import AutoModelForImageTextToText

    path = str(ensure([request.param])[request.param])
    runner = ModelRunner(path, device="cpu", dtype="float32")
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, runner, reference, load_processor(path)


def user(*parts) -> Message:
    return Message("user", tuple(ImagePart(image_url(0)) if p is None else TextPart(p) for p in parts))


def render(processor, messages: list[Message], generation_prompt: bool = True) -> str:
    return processor.apply_chat_template([{"role": m.role, "content": m.template_content()} for m in messages],
                                         add_generation_prompt=generation_prompt, tokenize=False)


def generate(reference, image_token_id: int, ids: list[int], images: list[dict]) -> list[int]:
    """transformers' greedy generate over ``ids`` with every image of the transcript, in order."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images:
        kwargs = {"pixel_values": torch.cat([i["pixel_values"] for i in images]),
                  "image_grid_thw": torch.cat([i["image_grid_thw"] for i in images])}
    with torch.no_grad():
        out = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 mm_token_type_ids=(input_ids == image_token_id).int(), max_new_tokens=MAX_NEW,
                                 **kwargs)
    return out[0, len(ids):].tolist()


def encode(runner: ModelRunner, inputs) -> list[torch.Tensor]:
    """The processor's images (patches of all images concatenated, a grid per image) through the runner,
    one image's patches and grid each, as the engine passes them."""
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    pixels = torch.split(inputs["pixel_values"], [t * h * w for t, h, w in grids])
    return runner.encode_images(list(pixels), None, grids)


class Session:
    """What the engine will hold per session: the KV cache, the transcript ids, the rope delta, and
    the token sampled last (in the transcript, not yet in the cache)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv = runner.new_kv_cache(block_tokens=32, max_tokens=1024)
        self.token_ids: list[int] = []
        self.rope_delta = 0
        self.pending: list[int] = []

    def turn(self, new_ids: list[int], images: list[dict]) -> list[int]:
        """Prefill the pending token and ``new_ids`` (with these images' placeholders), then decode
        greedily to EOS or MAX_NEW tokens."""
        runner, segment = self.runner, self.pending + new_ids
        grids = [tuple(g) for i in images for g in i["image_grid_thw"].tolist()]
        embeds = [e for i in images for e in encode(runner, i)]
        positions, next_position = segment_positions(segment, runner.info.image_token_id, grids, runner.merge_size,
                                                     start=self.kv.length + self.rope_delta)
        self.rope_delta = rope_delta(next_position, self.kv.length + len(segment))
        logits = runner.prefill(self.kv, runner.embed(segment, embeds), positions=positions)
        self.token_ids += new_ids
        answer = []
        while True:
            answer.append(int(logits.argmax()))
            if answer[-1] in runner.info.eos_token_ids or len(answer) == MAX_NEW:
                break
            logits = runner.decode([self.kv], [answer[-1]], position_offsets=[self.rope_delta])[0]
        self.token_ids += answer
        self.pending = [answer[-1]]
        return answer


def test_checkpoint_has_the_hub_layout(demo):
    family, runner, reference, processor = demo
    assert reference.config.model_type == runner.model.config.model_type == family
    saved = json.loads((Path(runner.model_path) / "processor_config.json").read_text())
    assert saved["processor_class"] == {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[family]
    assert saved["image_processor"]["size"] == {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert not hasattr(processor, "video_processor")
    tokenizer = processor.tokenizer
    assert processor.image_token_id == runner.info.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [tokenizer.convert_ids_to_tokens(reference.config.vision_start_token_id),
            tokenizer.convert_ids_to_tokens(reference.config.vision_end_token_id)] == ["<|vision_start|>",
                                                                                      "<|vision_end|>"]
    assert runner.info.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert render(processor, [user(None, "Hi")]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n")
    if family == "qwen2_5_vl":  # the windowed tower: blocks 0 and 2 attend inside 2 x 2 merged-token windows
        vision = reference.config.vision_config
        assert (vision.window_size, list(vision.fullatt_block_indexes), vision.depth) == (56, [1, 3], 4)


def test_pixels_grids_and_counts_equal_the_image_processor(demo):
    """The processor's pixel_values and image_grid_thw are those of transformers' own image processor
    for the checkpoint (AutoImageProcessor: without torchvision, Qwen2VLImageProcessorPil), called
    directly; its <|image_pad|> expansion is t*h*w / merge**2 = image_token_count; min and max pixels hold."""
    from transformers import AutoImageProcessor

    _, runner, _, processor = demo
    image_processor = AutoImageProcessor.from_pretrained(runner.model_path)
    geometry = QwenVLGeometry.from_image_processor(processor.image_processor)
    assert geometry == QwenVLGeometry(14, 2, MIN_PIXELS, MAX_PIXELS)
    text = render(processor, [user(None, "Hi")])
    sizes = {**SIZES, (10, 10): 4, (12, 500): 13, (1000, 600): 60, (640, 480): 54}  # worked in docs/QWEN_VL.md
    for seed, ((width, height), count) in enumerate(sizes.items()):
        image = make_image(seed, (width, height))
        inputs = processor(images=[image], text=text, return_tensors="pt")
        direct = image_processor(images=[image], return_tensors="pt")
        assert torch.equal(inputs["pixel_values"], direct["pixel_values"])
        assert torch.equal(inputs["image_grid_thw"], direct["image_grid_thw"])
        assert inputs["image_grid_thw"][0].tolist() == list(image_grid(height, width, geometry))
        assert int((inputs["input_ids"] == processor.image_token_id).sum()) == count
        assert image_token_count(height, width, geometry) == count
        assert MIN_PIXELS // 28**2 <= count <= MAX_PIXELS // 28**2
        assert inputs["pixel_values"].shape == (count * 4, 3 * 2 * 14 * 14)  # merge**2 patches of C x tp x p x p


def test_formatter_plus_per_image_counts_gives_the_processors_ids(demo):
    """The engine's chat formatter renders one <|image_pad|> per image; expanding each to its own count
    gives exactly the ids the processor produces for the same conversation and images."""
    _, runner, _, processor = demo
    formatter = ChatFormatter(processor.tokenizer, image_token="<|image_pad|>", image_token_id=processor.image_token_id,
                              eos_token_ids=runner.info.eos_token_ids)
    messages = (user(None, QUESTIONS[0]), Message("assistant", (TextPart("a cat"),)), user(None, QUESTIONS[1]))
    images = [make_image(1, (140, 84)), make_image(2, (56, 140))]
    counts = [image_token_count(i.height, i.width, QwenVLGeometry.from_image_processor(processor.image_processor))
              for i in images]
    ids = formatter.opening(messages, tuple(counts)).token_ids
    expected = processor(images=images, text=render(processor, list(messages)), return_tensors="pt")["input_ids"]
    assert counts == [15, 10] and ids == expected[0].tolist()


@pytest.mark.parametrize("size", sorted(SIZES))
def test_turn_one_with_an_image_equals_generate(demo, size):
    _, runner, reference, processor = demo
    inputs = processor(images=[make_image(3, size)], text=render(processor, [user(None, QUESTIONS[0])]),
                       return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(runner.info.image_token_id) == SIZES[size]
    session = Session(runner)
    answer = session.turn(ids, [inputs])
    assert answer == generate(reference, runner.info.image_token_id, ids, [inputs])
    assert len(set(answer)) > len(answer) // 2  # not a degenerate repetition
    # The 3-D positions matter: the same prefill and decode at plain 1-D positions answer differently.
    flat = runner.new_kv_cache(block_tokens=32, max_tokens=1024)
    embeds = runner.embed(ids, encode(runner, inputs))
    flat_answer = [int(runner.prefill(flat, embeds, positions=torch.arange(len(ids)).expand(3, -1)).argmax())]
    while len(flat_answer) < len(answer):
        flat_answer.append(int(runner.decode([flat], [flat_answer[-1]], position_offsets=[0])[0].argmax()))
    assert flat_answer != answer


def test_stateless_multi_turn_with_two_images_equals_generate(demo):
    _, runner, reference, processor = demo
    messages = [user(None, QUESTIONS[0]), Message("assistant", (TextPart("a cat on a mat"),)),
                user(None, QUESTIONS[1])]
    inputs = processor(images=[make_image(4, (140, 84)), make_image(5, (56, 140))], text=render(processor, messages),
                       return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(runner.info.image_token_id) == 15 + 10
    assert Session(runner).turn(ids, [inputs]) == generate(reference, runner.info.image_token_id, ids, [inputs])


def test_three_turn_session_equals_generate_over_its_transcript(demo):
    """Turn 1 with an image; turn 2 adds a second image of another shape; turn 3 is text only. Each turn
    prefills only what it adds (the last answer token and the follow-up's ids) at positions that start
    at kv.length + the carried rope delta."""
    _, runner, reference, processor = demo
    eos = runner.info.eos_token_ids
    image_token_id = runner.info.image_token_id
    session, images, conversation = Session(runner), [], [user(None, QUESTIONS[0])]
    first = processor(images=[make_image(6, (140, 84))], text=render(processor, conversation), return_tensors="pt")
    turns = [(first["input_ids"][0].tolist(), [first])]
    probe = render(processor, conversation + [Message("assistant", (TextPart("\u2063"),))], generation_prompt=False)
    end_of_turn = probe.split("\u2063", 1)[1]  # "<|im_end|>\n"
    for step in range(3):
        new_ids, new_images = turns[step]
        cached_before = session.kv.length
        prompt = session.token_ids + new_ids
        images += new_images
        answer = session.turn(new_ids, new_images)
        assert session.kv.length == len(prompt) + len(answer) - 1
        assert session.kv.length - cached_before == len(new_ids) + (step > 0) + len(answer) - 1
        assert answer == generate(reference, image_token_id, prompt, images), f"turn {step + 1}"
        if step == 2:
            break
        closing = end_of_turn[len("<|im_end|>"):] if answer[-1] in eos else end_of_turn
        follow_up = [user(None, QUESTIONS[1])] if step == 0 else [user(QUESTIONS[2])]
        full = render(processor, conversation + [Message("assistant", (TextPart("\u2063"),))] + follow_up)
        text = closing + full[len(probe):]
        follow_images = [make_image(7, (56, 140))] if step == 0 else None
        inputs = processor(images=follow_images, text=text, add_special_tokens=False, return_tensors="pt")
        turns.append((inputs["input_ids"][0].tolist(), [inputs] if follow_images else []))
    assert session.token_ids.count(image_token_id) == 15 + 10
    assert session.rope_delta == (5 - 15) + (5 - 10)  # each image: its larger merged side less its token count


def test_batched_decode_keeps_each_sessions_rope_delta(demo):
    """Two sessions whose images differ in shape (rope deltas -10 and -5) decode in one batch and
    answer exactly as each does alone."""
    _, runner, _, processor = demo
    text = render(processor, [user(None, QUESTIONS[0])])
    inputs = [processor(images=[make_image(8, size)], text=text, return_tensors="pt")
              for size in ((140, 84), (56, 140))]
    alone = [Session(runner).turn(i["input_ids"][0].tolist(), [i]) for i in inputs]
    sessions = [Session(runner) for _ in inputs]
    first_tokens = []
    for session, i in zip(sessions, inputs):  # prefill each, as Session.turn does, without decoding
        ids = i["input_ids"][0].tolist()
        positions, next_position = segment_positions(ids, runner.info.image_token_id,
                                                     [tuple(g) for g in i["image_grid_thw"].tolist()],
                                                     runner.merge_size, start=0)
        session.rope_delta = rope_delta(next_position, len(ids))
        embeds = runner.embed(ids, encode(runner, i))
        first_tokens.append(int(runner.prefill(session.kv, embeds, positions=positions).argmax()))
    assert [s.rope_delta for s in sessions] == [-10, -5]
    answers = [[t] for t in first_tokens]
    for _ in range(min(map(len, alone)) - 1):
        logits = runner.decode([s.kv for s in sessions], [a[-1] for a in answers],
                               position_offsets=[s.rope_delta for s in sessions])
        for answer, row in zip(answers, logits):
            answer.append(int(row.argmax()))
    assert answers == [a[: len(answers[0])] for a in alone]


def test_an_image_encoded_alone_matches_it_encoded_in_a_batch(demo):
    """Embeddings can be cached per image: the tower attends within each image (Qwen2.5-VL: within
    each window, and whole-image blocks), so batch-mates change an image's features by rounding only."""
    _, runner, _, processor = demo
    images = [make_image(1, (140, 84)), make_image(2, (56, 140)), make_image(3, (640, 480))]
    batch = processor.image_processor(images=images, return_tensors="pt")
    together = encode(runner, batch)
    assert [tuple(f.shape) for f in together] == [(15, 64), (10, 64), (54, 64)]
    for image, features in zip(images, together):
        alone = processor.image_processor(images=[image], return_tensors="pt")
        (encoded,) = encode(runner, alone)
        torch.testing.assert_close(encoded, features, rtol=0, atol=1e-6)
