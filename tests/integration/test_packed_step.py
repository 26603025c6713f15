"""One forward pass per engine step (session/model/packed_step.py): a step's prefill chunks and decode
rows go through the model together, and each request answers as it does alone.

- On SmolLM2 (real weights, our CPU linears and attention kernel), a packed step's logits are, bit for
  bit, those of its parts run apart: the decode step, then each chunk's prefill.
- On the demo text Llama and Qwen2-VL (M-RoPE), with image prompts on the latter, an engine whose
  16-token budget makes prompts span steps beside decoding rows counts its forward passes per step:
  exactly one in every step, steps that mix chunks and rows among them; and every answer equals the
  one its request gets alone.
- A packed pass that fails is run again with its parts apart, so a fault in one request's part fails
  that request alone.
"""

from __future__ import annotations

import pytest
import torch

from session.engine.events import TERMINAL, Failed, Finished
from session.model.backend import Chunk, DecodeRows
from session.model.runner import ModelRunner
from tests.integration.test_shared_prefix import Ask, demo_engine, demo_paths


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_step_gives_each_part_the_bits_of_its_own_pass(smollm2_path, dtype):
    runner = ModelRunner(str(smollm2_path), dtype=dtype)
    prompts = [list(range(100, 140)), list(range(200, 290)), list(range(300, 320))]

    def caches():  # a decoding session, and two prompts 10 and 5 tokens in
        kvs = [runner.new_kv_cache(block_tokens=16, max_tokens=512) for _ in prompts]
        for kv, prompt, cached in zip(kvs, prompts, (40, 10, 5)):
            runner.prefill(kv, runner.embed(prompt[:cached], []))
        return kvs

    a, b, c = caches()
    before = runner.num_passes
    packed = runner.step([Chunk(b, runner.embed(prompts[1][10:], [])), Chunk(c, runner.embed(prompts[2][5:], []))],
                         DecodeRows([a], [7]))
    assert runner.num_passes - before == 1
    assert [kv.length for kv in (a, b, c)] == [41, 90, 20]
    a, b, c = caches()
    apart = torch.cat([runner.decode([a], [7]), runner.prefill(b, runner.embed(prompts[1][10:], []))[None],
                       runner.prefill(c, runner.embed(prompts[2][5:], []))[None]])
    assert torch.equal(packed, apart)


def test_a_verify_packed_with_a_chunk_gives_the_bits_of_extend_and_of_the_prefill(smollm2_path):
    """A speculative verify's rows (two sequences, 3 and 1 tokens) packed with a prompt's chunk: one pass,
    each verify position the bits ``extend`` gives it (as its own decode step would), the chunk its
    prefill's, every cache's length past what it fed."""
    runner = ModelRunner(str(smollm2_path))
    prompts = [list(range(100, 140)), list(range(200, 290)), list(range(300, 333))]
    fed = [[7, 8, 9], [5]]

    def caches():  # two decoding sessions, and a prompt 10 tokens in
        kvs = [runner.new_kv_cache(block_tokens=16, max_tokens=512) for _ in prompts]
        for kv, prompt, cached in zip(kvs, prompts, (40, 10, 33)):
            runner.prefill(kv, runner.embed(prompt[:cached], []))
        return kvs

    a, b, c = caches()
    rows = DecodeRows.verify([a, c], fed)
    before = runner.num_passes
    packed = runner.step([Chunk(b, runner.embed(prompts[1][10:], []))], rows)
    assert runner.num_passes - before == 1 and len(rows) == 4
    assert [kv.length for kv in (a, b, c)] == [43, 90, 34]
    a, b, c = caches()
    verify = runner.extend([a, c], fed)  # [2, 3, V], the second row's padding zeros
    prefill = runner.prefill(b, runner.embed(prompts[1][10:], []))
    assert torch.equal(rows.widen(packed[:4]), verify)
    assert torch.equal(packed[4], prefill)


@pytest.fixture(scope="module")
def paths(tiny_model_path):
    return demo_paths(tiny_model_path)


def requests_of(engine, with_image: bool) -> list:
    """Three cold prompts of 20 to 44 tokens (an image in each where the family takes one) and two
    short ones: under a 16-token budget they span steps while the others decode."""
    ask = Ask(engine, with_image)
    out = [ask.request(ask.placeholders + [50 + i] * (20 + 12 * i), images=int(with_image)) for i in range(3)]
    return out + [ask.request([90 + i, 91, 92]) for i in range(2)]


def finals(requests) -> list:
    """Each request's final event (its stream read to the end)."""
    out = []
    for request in requests:
        while not isinstance(event := request.stream.get(timeout=60), TERMINAL):
            pass
        out.append(event)
    return out


def answers(requests) -> list[list[int]]:
    events = finals(requests)
    assert all(isinstance(event, Finished) for event in events), events
    return [event.token_ids for event in events]


def count_passes(engine) -> list[tuple[int, int, int]]:
    """From now on, per step of ``engine``: (prefill chunks, decode rows, forward passes run)."""
    runner, steps = engine.parts.runner, []
    original = engine._steps.run

    def counted(plan, ended):
        before = runner.num_passes
        original(plan, ended)
        if plan.prefill or plan.decode:
            steps.append((len(plan.prefill), len(plan.decode), runner.num_passes - before))

    engine._steps.run = counted
    return steps


@pytest.mark.parametrize("family,cpu_kernels,packed", [("llama", True, "auto"), ("qwen2_vl", True, "auto"),
                                                       ("llama", False, "auto"), ("llama", True, "off")])
def test_every_step_is_one_forward_pass_and_answers_as_alone(paths, family, cpu_kernels, packed):
    """Without our CPU kernels (torch's linears and attention) the decode rows attend as one-token chunks.
    RESIDENT_PACKED_STEPS=off: a pass per chunk and one for the rows, the same answers."""
    with_image = family != "llama"
    engine = demo_engine(paths[family], step_token_budget=16, check_invariants=True, cpu_kernels=cpu_kernels,
                         packed_steps=packed)
    try:
        alone = []
        for request in requests_of(engine, with_image):
            engine.submit(request)
            alone += answers([request])
        ran = count_passes(engine)
        burst = requests_of(engine, with_image)
        for request in burst:
            engine.submit(request)
        assert answers(burst) == alone
        apart = [chunks + (rows > 0) for chunks, rows, _ in ran]
        assert [passes for _, _, passes in ran] == ([1] * len(ran) if packed == "auto" else apart)
        assert any(chunks and rows for chunks, rows, _ in ran)  # chunks beside decode rows
        assert any(chunks > 1 for chunks, _, _ in ran)  # several prompts' chunks in one pass
        assert engine.num_invariant_violations == 0
    finally:
        engine.stop()


def test_a_failed_packed_pass_runs_its_parts_apart_and_only_the_faulty_one_fails(paths, monkeypatch):
    """Every pass that feeds one request's prompt raises, after it ran (the caches advanced): the step
    is run again a pass per part, where that prompt's pass fails again and its request fails alone,
    and every other request answers as it does alone."""
    engine = demo_engine(paths["llama"], step_token_budget=16, check_invariants=True)
    try:
        ask = Ask(engine, False)
        prompts = [[50 + i] * (20 + 12 * i) for i in range(3)] + [[77] * 30, [90, 91, 92]]
        alone = []
        for ids in prompts:
            request = ask.request(ids)
            engine.submit(request)
            alone += answers([request])
        runner = engine.parts.runner
        poison = runner.embed([77], [])[0]
        original = runner.step

        def failing_step(chunks, rows):
            out = original(chunks, rows)
            if any(torch.equal(chunk.embeds[0], poison) for chunk in chunks):
                raise RuntimeError("injected fault in a pass feeding the poisoned prompt")
            return out

        monkeypatch.setattr(runner, "step", failing_step)
        burst = [ask.request(ids) for ids in prompts]
        for request in burst:
            engine.submit(request)
        events = finals(burst)
        assert isinstance(events[3], Failed) and "injected fault" in str(events[3].error)
        assert [e.token_ids for i, e in enumerate(events) if i != 3] == [a for i, a in enumerate(alone) if i != 3]
        assert engine.fresh_stats().events["steps_run_apart"] >= 1
        assert engine.num_invariant_violations == 0
    finally:
        engine.stop()


def test_adapters_mixed_in_a_packed_step_answer_as_alone(tiny_model_path, adapters_dir):
    """Prompts under four LoRA adapters and the base, chunked under a 16-token budget beside decoding
    rows: each token's adapter applies in the one pass (per-token slots), so every answer equals the
    one its request gets alone, and every step is one pass."""
    from session.config import EngineConfig
    from session.engine import Engine
    from session.engine.events import EventStream
    from session.engine.requests import GenerationRequest
    from session.types import SamplingParams

    engine = Engine(EngineConfig(model_path=str(tiny_model_path), adapters_dir=str(adapters_dir),
                                 step_token_budget=16, speculative="off", check_invariants=True)).start()
    names = ["tone", "domain", "customer", "terse", None]

    def burst():
        return [GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=8), stream=EventStream(),
                                  token_ids=[1] + [60 + i] * (10 + 7 * i), adapter=name)
                for i, name in enumerate(names)]

    try:
        alone = []
        for request in burst():
            engine.submit(request)
            alone += answers([request])
        assert len(set(map(tuple, alone))) == len(names)  # each adapter changes the answer
        ran = count_passes(engine)
        requests = burst()
        for request in requests:
            engine.submit(request)
        assert answers(requests) == alone
        assert all(count == 1 for _, _, count in ran) and any(c and r for c, r, _ in ran)
    finally:
        engine.stop()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_bursts_keep_one_pass_per_step_and_every_answer(paths, seed):
    """Random prompts (1 to 70 tokens), some continuing open sessions, arriving in random groups while
    others decode, under a random token budget (3 to 48): every step is one pass, and every answer
    equals the answer the same turn gets on an engine that serves one request at a time."""
    import random

    rng = random.Random(seed)
    budget = rng.choice([3, 5, 16, 48])
    turns = []  # (session or None, ids, max_tokens): a session's turns in order
    for _ in range(14):
        session = rng.choice([None, None, f"r{seed}-{rng.randrange(4)}"])
        turns.append((session, [rng.randrange(40, 1500) for _ in range(rng.randint(1, 70))], rng.randint(1, 9)))

    def request(ask, opened, session, ids, max_tokens):
        extra = {"session_id": session, "open_session": session not in opened} if session else {}
        opened.add(session)
        out = ask.request(ids, **extra)
        out.sampling = type(out.sampling)(max_tokens=max_tokens)
        return out

    def serve(engine, groups):
        ask, answered, opened = Ask(engine, False), [], set()
        for group in groups:  # a group is submitted together; the next waits for its answers
            requests = [request(ask, opened, *turn) for turn in group]
            for item in requests:
                engine.submit(item)
            answered += answers(requests)
        return answered

    alone_engine = demo_engine(paths["llama"], step_token_budget=4096)
    engine = demo_engine(paths["llama"], step_token_budget=budget, check_invariants=True)
    try:
        alone = serve(alone_engine, [[turn] for turn in turns])
        groups, start = [], 0
        while start < len(turns):  # one session's turns in separate groups: a turn follows the one before
            size = rng.randint(1, 5)
            group, seen = [], set()
            for turn in turns[start:start + size]:
                if turn[0] is not None and turn[0] in seen:
                    break
                seen.add(turn[0])
                group.append(turn)
            groups.append(group)
            start += len(group)
        ran = count_passes(engine)
        assert serve(engine, groups) == alone
        assert [passes for _, _, passes in ran] == [1] * len(ran)
        assert engine.num_invariant_violations == 0
    finally:
        alone_engine.stop()
        engine.stop()
