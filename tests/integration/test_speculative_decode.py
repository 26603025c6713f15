"""Speculative decoding on the committed trained pair (float32, CPU): token-for-token equal to plain
greedy decoding, with a draft model and with prompt lookup, across turns of one session whose caches
continue, and on a LLaVA session (llava-spec) with the text-only draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import spec_drivers
from model_store.train_pair import PAIR_DIR, eval_prompts
from session.errors import ConfigError
from session.model.kv_cache import KVCache
from session.model.runner import ModelRunner
from session.speculative.controller import SpeculationController
from session.speculative.decoder import SpeculativeDecoder, check_compatible
from tests.conftest import make_image

NUM_NEW = 64
FOLLOW_UPS = ["\nUSER: And what does it return? ASSISTANT:", "\nUSER: Show the same for a list. ASSISTANT:"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Decode steps of these few-MB models are latency-bound: a second thread brings nothing, and on a
    busy machine each parallel region can wait for a descheduled thread (measured 3-7x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def load(path: Path) -> ModelRunner:
    return ModelRunner(str(path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def target() -> ModelRunner:
    return load(PAIR_DIR / "target")


@pytest.fixture(scope="module")
def draft() -> ModelRunner:
    return load(PAIR_DIR / "draft")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PAIR_DIR / "target")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [[tokenizer.bos_token_id] + ids for ids in eval_prompts(tokenizer, 10, 32)]


@pytest.fixture(scope="session")
def spec_llava_path() -> Path:
    from model_store.build_spec_llava import build_spec_llava

    return build_spec_llava()


def new_kv(runner: ModelRunner) -> KVCache:
    return runner.new_kv_cache(block_tokens=64, max_tokens=1024)


def prefill(runner: ModelRunner, kv: KVCache, token_ids: list[int], image_embeds=()) -> list[int]:
    """The engine's turn prefill: feed what the cache lacks; returns token_ids + the first new token."""
    logits = runner.prefill(kv, runner.embed(token_ids[kv.length:], list(image_embeds)))
    return token_ids + [int(logits.argmax())]


def plain(runner: ModelRunner, kv: KVCache, token_ids: list[int], num_new: int) -> list[int]:
    """The reference: one decode step per token, as the engine decodes today."""
    ids = list(token_ids)
    while len(ids) - len(token_ids) < num_new:
        ids.append(int(runner.decode([kv], [ids[-1]])[0].argmax()))
    return ids


def plain_answer(runner: ModelRunner, prompt: list[int], num_new: int) -> list[int]:
    kv = new_kv(runner)
    return plain(runner, kv, prefill(runner, kv, prompt), num_new)


def speculative(decoder, target_kv, draft_kv, token_ids, num_new, k=4, adaptive=False) -> list[int]:
    ids = list(token_ids)
    if adaptive:
        spec_drivers.decode_greedy(decoder, ids, target_kv, draft_kv, num_new, SpeculationController(k_max=8, k=k))
        return ids
    goal = len(ids) + num_new
    while len(ids) < goal:
        ids += spec_drivers.step(decoder, ids, target_kv, draft_kv, k, max_new=goal - len(ids)).token_ids
    return ids


def test_draft_model_greedy_equals_plain_on_many_prompts(target, draft, prompts):
    decoder = SpeculativeDecoder(target, draft)
    for prompt in prompts:
        ids = prefill(target, target_kv := new_kv(target), prompt)
        assert speculative(decoder, target_kv, new_kv(draft), ids, NUM_NEW) == plain_answer(target, prompt, NUM_NEW)
    # the pair is worth measuring: the draft agrees with the target most of the time
    assert decoder.num_accepted / decoder.num_proposed > 0.5


def test_prompt_lookup_greedy_equals_plain(target, prompts):
    decoder = SpeculativeDecoder(target, None)
    for prompt in prompts[:5]:
        ids = prefill(target, target_kv := new_kv(target), prompt)
        assert speculative(decoder, target_kv, None, ids, NUM_NEW, k=6) == plain_answer(target, prompt, NUM_NEW)
    assert decoder.num_accepted > 0


def test_adaptive_k_greedy_equals_plain(target, draft, prompts):
    """The controller mixes plain steps and speculative steps of varying k: output is unchanged."""
    decoder = SpeculativeDecoder(target, draft)
    for prompt in prompts[5:]:
        ids = prefill(target, target_kv := new_kv(target), prompt)
        got = speculative(decoder, target_kv, new_kv(draft), ids, NUM_NEW, adaptive=True)
        assert got == plain_answer(target, prompt, NUM_NEW)


def conversation(target, tokenizer, prompt, decode_turn, sync=lambda ids: None) -> list[int]:
    """Three turns in one session; each follow-up prefills only its new tokens into the same cache."""
    kv = new_kv(target)
    ids = prefill(target, kv, prompt)
    for index in range(3):
        if index:
            ids = prefill(target, kv, ids + tokenizer(FOLLOW_UPS[index - 1], add_special_tokens=False).input_ids)
            sync(ids)
        ids = decode_turn(kv, ids)
    return ids


@pytest.mark.parametrize("use_draft", [True, False])
def test_multi_turn_session_caches_continue_and_output_equals_plain(target, draft, tokenizer, prompts, use_draft):
    decoder = SpeculativeDecoder(target, draft if use_draft else None)
    draft_kv = decoder.new_draft_kv(block_tokens=64, max_tokens=1024)
    synced: list[tuple[int, int]] = []  # (draft cache length before, tokens prefilled) per follow-up

    def sync(ids):
        before = draft_kv.length if draft_kv is not None else 0
        synced.append((before, decoder.sync_draft(ids, draft_kv)))

    expected = conversation(target, tokenizer, prompts[0], lambda kv, ids: plain(target, kv, ids, 32))
    got = conversation(target, tokenizer, prompts[0],
                       lambda kv, ids: speculative(decoder, kv, draft_kv, ids, 32), sync)
    assert got == expected
    if use_draft:  # the draft continued from its cache: each follow-up prefilled only the new tail
        for index, (before, num_synced) in enumerate(synced):
            new_text = len(tokenizer(FOLLOW_UPS[index], add_special_tokens=False).input_ids)
            # the follow-up + the turn's first token, plus the 0-2 answer tokens the draft had not fed
            # (its own accepted last proposal; a last step with one token left proposes nothing)
            assert before > len(prompts[0]) and new_text + 1 <= num_synced <= new_text + 3


def llava_prompt(processor, question: str) -> list[int]:
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True)
    return processor(text=text, images=make_image(3), return_tensors="pt").input_ids[0].tolist()


def test_llava_session_with_text_only_draft_equals_plain(spec_llava_path, draft, tokenizer):
    from transformers import AutoProcessor

    llava = load(spec_llava_path)
    processor = AutoProcessor.from_pretrained(spec_llava_path)
    check_compatible(processor.tokenizer, tokenizer)
    pixels = processor.image_processor(images=[make_image(3)], return_tensors="pt").pixel_values
    image_embeds = llava.encode_images(pixels)
    prompt = llava_prompt(processor, "def parse(self, text):\n    \"\"\"Return the parsed")
    assert prompt.count(llava.info.image_token_id) == llava.info.num_image_tokens == 64
    follow_up = tokenizer(FOLLOW_UPS[0], add_special_tokens=False).input_ids

    def session(decode_turn) -> list[int]:
        kv = new_kv(llava)
        ids = decode_turn(kv, prefill(llava, kv, prompt, image_embeds))
        return decode_turn(kv, prefill(llava, kv, ids + follow_up))

    expected = session(lambda kv, ids: plain(llava, kv, ids, 48))
    for proposer in (draft, None):
        decoder = SpeculativeDecoder(llava, proposer)
        draft_kv = decoder.new_draft_kv(block_tokens=64, max_tokens=1024)
        assert session(lambda kv, ids, decoder=decoder, draft_kv=draft_kv: speculative(decoder, kv, draft_kv, ids, 48)) == expected
        if proposer is not None:  # the draft saw the text only: 64 placeholders fewer than the target
            assert draft_kv.length <= len(expected) - 64 - 1
            assert decoder.num_accepted > 0


def test_session_with_a_lora_adapter_equals_plain(draft, prompts, tmp_path):
    """The adapter applies to the target's verify pass; the base-model draft still gives exact output."""
    from model_store.build_adapters import ALL_LINEAR, build_adapter
    from session.model.lora import load_adapter

    path = build_adapter(PAIR_DIR / "target", tmp_path, "domain", 8, 16, ALL_LINEAR, False, seed=5)
    adapted = load(PAIR_DIR / "target")
    bank, shapes = adapted.enable_lora(num_slots=2, max_rank=8)
    bank.load(1, load_adapter("domain", path, shapes, max_rank=8))
    decoder = SpeculativeDecoder(adapted, draft)
    for prompt in prompts[:3]:
        kv = new_kv(adapted)
        first = int(adapted.prefill(kv, adapted.embed(prompt, []), adapter_slot=1).argmax())
        expected = prompt + [first]
        while len(expected) < len(prompt) + 1 + NUM_NEW:
            expected.append(int(adapted.decode([kv], [expected[-1]], [1])[0].argmax()))
        kv = new_kv(adapted)
        ids = prompt + [int(adapted.prefill(kv, adapted.embed(prompt, []), adapter_slot=1).argmax())]
        draft_kv, goal = new_kv(draft), len(expected)
        while len(ids) < goal:
            ids += spec_drivers.step(decoder, ids, kv, draft_kv, 4, max_new=goal - len(ids), adapter_slot=1).token_ids
        assert ids == expected
        assert expected[len(prompt):] != plain_answer(adapted, prompt, NUM_NEW)[len(prompt):]  # it does adapt


def test_a_draft_with_another_vocabulary_is_refused(tokenizer):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(PAIR_DIR / "draft")
    check_compatible(tokenizer, other)  # the committed pair shares one tokenizer
    other.add_tokens(["<extra_token>"])
    with pytest.raises(ConfigError, match=r"vocabulary differs from the target's \(2049 vs 2048 tokens"):
        check_compatible(tokenizer, other)
