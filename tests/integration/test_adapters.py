"""LoRA adapters in the engine: PEFT-exact, mixed batches, session binding, tiers, admin (docs/DESIGN.md, "Invariants")."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from session.config import EngineConfig
from session.engine import AdapterRequest, Engine, GenerationRequest
from session.engine.events import AdminResult, EventStream, Failed, Finished
from session.errors import (
    AdapterInUse,
    AdapterMismatch,
    AdapterNotFound,
    BadRequest,
    ConfigError,
    Forbidden,
    InvalidAdapter,
)
from session.serving.api import ChatService
from session.types import SamplingParams
from tests.conftest import make_image
from tests.integration.test_engine import QUESTIONS, finished, run, turn, user

ADAPTERS = ["tone", "domain", "customer", "terse"]


def make_engine(tiny_model_path, adapters_dir, **overrides) -> Engine:
    config = EngineConfig(model_path=str(tiny_model_path), adapters_dir=str(adapters_dir), **overrides)
    return Engine(config).start()


@pytest.fixture(scope="module")
def engine(tiny_model_path, served_dir):
    eng = make_engine(tiny_model_path, served_dir)
    yield eng
    eng.stop()


def ask(engine, adapter, prompt_ids, max_tokens=12):
    request = GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=max_tokens), stream=EventStream(),
                                token_ids=list(prompt_ids), adapter=adapter)
    return run(engine, request)


def admin(engine, action, **kwargs):
    events = run(engine, AdapterRequest(action=action, stream=EventStream(), **kwargs))
    return events[-1]


def poison_weights(path: Path) -> str:
    """One value of the adapter's first lora_A made NaN; returns that weight's name."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    key = min(k for k in tensors if "lora_A" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    return key


PROMPT = [1, 57, 55, 859, 30, 225, 59, 76, 294, 328, 553]


def test_one_adapter_matches_peft(engine, tiny_model_path, adapters_dir):
    """Our grouped LoRA application gives PEFT's own greedy tokens."""
    import torch
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    base = LlavaForConditionalGeneration.from_pretrained(tiny_model_path)
    for name in ("domain", "terse"):  # all-linear, and rsLoRA scaling
        model = PeftModel.from_pretrained(base, adapters_dir / name).eval()
        ids = torch.tensor([PROMPT])
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                  min_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
        base = model.unload()
        assert list(finished(ask(engine, name, PROMPT)).token_ids) == expected


def test_mixed_batch_equals_each_adapter_alone_and_differs_from_base(engine):
    alone = {name: finished(ask(engine, name, PROMPT, 16)).token_ids for name in ADAPTERS + [None]}
    assert len(set(alone.values())) == 5  # every adapter changes the answer, and none is the base
    results: dict = {}
    engine.max_batch_seen = 0

    def go(name, index):
        results[index] = (name, finished(ask(engine, name, PROMPT, 16)).token_ids)

    names = ADAPTERS + [None] + ADAPTERS  # 9 concurrent rows, mixed
    threads = [threading.Thread(target=go, args=(name, i)) for i, name in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 9
    assert engine.max_batch_seen >= 3  # they shared decode steps
    for name, tokens in results.values():
        assert tokens == alone[name]


def test_a_second_engine_on_the_same_runner_serves_every_adapter_as_the_first(tiny_model_path, adapters_dir):
    """An engine started on a runner an earlier engine enabled LoRA on (benchmarks/adapters.py's pool run)
    installs its own bank: nested in the first bank's linears, the first bank's last mix (here a mixed
    batch's row mask) was added to every later forward, and a one-row prefill failed on its shape."""
    first = make_engine(tiny_model_path, adapters_dir)
    try:
        alone = {name: finished(ask(first, name, PROMPT, 8)).token_ids for name in ADAPTERS + [None]}
        threads = [threading.Thread(target=ask, args=(first, name, PROMPT, 8)) for name in ADAPTERS + ADAPTERS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert first.max_batch_seen >= 3  # the bank's last forward held a mix of several rows
    finally:
        first.stop()
    config = EngineConfig(model_path=str(tiny_model_path), adapters_dir=str(adapters_dir))
    second = Engine(config, runner=first.parts.runner).start()
    try:
        assert {name: finished(ask(second, name, PROMPT, 8)).token_ids for name in [None] + ADAPTERS} == alone
    finally:
        second.stop()


def test_an_adapter_with_the_base_models_name_stops_the_start(engine):
    """A folder in RESIDENT_ADAPTERS_DIR named as the model is served (here TorchServe's name): requests
    naming it get the base model, so it could never be chosen; the worker refuses to start."""
    with pytest.raises(ConfigError) as refused:
        ChatService(engine, "tone")
    assert str(refused.value) == ("adapter 'tone' has the base model's name, so no request could choose it: "
                                  "rename its folder in RESIDENT_ADAPTERS_DIR")
    assert ChatService(engine, "llava").model_name == "llava"


def test_session_is_bound_to_its_adapter(engine):
    request = GenerationRequest(messages=user(QUESTIONS[0]), sampling=SamplingParams(max_tokens=8),
                                stream=EventStream(), session_id="bound-1", open_session=True, adapter="tone")
    finished(run(engine, request))
    other = GenerationRequest(messages=user(QUESTIONS[1]), sampling=SamplingParams(max_tokens=8),
                              stream=EventStream(), session_id="bound-1", adapter="domain")
    refused = run(engine, other)[-1]
    assert isinstance(refused, Failed) and isinstance(refused.error, AdapterMismatch)
    assert refused.error.status == 400 and "opened with adapter 'tone'" in refused.error.message
    assert refused.error.message == ("session bound-1 was opened with adapter 'tone'; its cache cannot serve "
                                     "adapter 'domain': open a new session for it")
    base = GenerationRequest(messages=user(QUESTIONS[1]), sampling=SamplingParams(max_tokens=8),
                             stream=EventStream(), session_id="bound-1", base_model=True)
    refused = run(engine, base)[-1]  # the base model named (it used to answer with the session's adapter)
    assert isinstance(refused, Failed) and isinstance(refused.error, AdapterMismatch)
    assert refused.error.message == ("session bound-1 was opened with adapter 'tone'; its cache cannot serve "
                                     "the base model: open a new session for it")
    same = turn(engine, "bound-1", QUESTIONS[1])  # no adapter named: the session's own
    assert isinstance(same[-1], Finished) and same[0].cached_tokens > 0 and same[0].adapter == "tone"
    assert engine.parts.store.get("bound-1").adapter == "tone"


def test_unknown_adapter_is_404(engine):
    failed = ask(engine, "nope", PROMPT)[-1]
    assert isinstance(failed, Failed) and isinstance(failed.error, AdapterNotFound)
    assert failed.error.status == 404 and "'nope'" in failed.error.message


def test_session_survives_its_adapter_leaving_the_device(tiny_model_path, adapters_dir):
    reference_engine = make_engine(tiny_model_path, adapters_dir)
    try:
        expected = []
        for step, question in enumerate(QUESTIONS[:3]):
            request = GenerationRequest(messages=user(question), sampling=SamplingParams(max_tokens=10),
                                        stream=EventStream(), session_id="s", open_session=step == 0,
                                        adapter="customer")
            expected.append(finished(run(reference_engine, request)).token_ids)
    finally:
        reference_engine.stop()
    engine = make_engine(tiny_model_path, adapters_dir, max_device_adapters=1, max_host_adapters=1)
    try:
        got = []
        for step, question in enumerate(QUESTIONS[:3]):
            request = GenerationRequest(messages=user(question), sampling=SamplingParams(max_tokens=10),
                                        stream=EventStream(), session_id="s", open_session=step == 0,
                                        adapter="customer")
            got.append(finished(run(engine, request)).token_ids)
            finished(ask(engine, ADAPTERS[step % 2], PROMPT, 4))  # another adapter takes the only slot
            assert engine.parts.adapters.get("customer").tier in ("host", "disk")
        assert got == expected
        assert engine.parts.adapters.num_device_evictions >= 3 and engine.parts.adapters.num_loads_from_disk >= 2
    finally:
        engine.stop()


def test_register_use_unregister_then_404(engine, served_dir):
    shutil.copytree(served_dir / "tone", served_dir / "staged" / "fresh")
    result = admin(engine, "register", name="fresh", src=str(served_dir / "staged" / "fresh"))
    assert result == AdminResult({"registered": "fresh", "src": str(served_dir / "staged" / "fresh")})
    used = finished(ask(engine, "fresh", PROMPT))
    assert used.token_ids == finished(ask(engine, "tone", PROMPT)).token_ids  # same weights, same answer
    listed = {a["name"]: a for a in admin(engine, "list").body["adapters"]}
    assert listed["fresh"]["tier"] == "device" and set(ADAPTERS) <= set(listed)
    assert admin(engine, "unregister", name="fresh") == AdminResult({"unregistered": "fresh", "dry_run": False})
    gone = ask(engine, "fresh", PROMPT)[-1]
    assert isinstance(gone, Failed) and isinstance(gone.error, AdapterNotFound)


def test_bad_adapters_are_refused_and_registry_unchanged(engine, served_dir):
    before = admin(engine, "list").body
    staged = served_dir / "staged"
    empty = staged / "empty"
    empty.mkdir()
    wrong_rank = staged / "wrong-rank"
    shutil.copytree(served_dir / "tone", wrong_rank)
    config = json.loads((wrong_rank / "adapter_config.json").read_text())
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    too_big = staged / "too-big"
    shutil.copytree(served_dir / "tone", too_big)
    (too_big / "adapter_config.json").write_text(json.dumps({**config, "r": 100}))
    not_an_object = staged / "not-an-object"
    shutil.copytree(served_dir / "tone", not_an_object)
    (not_an_object / "adapter_config.json").write_text("[]")
    nan_weights = staged / "nan-weights"
    shutil.copytree(served_dir / "tone", nan_weights)
    poison_weights(nan_weights / "adapter_model.safetensors")
    cases = [(empty, "not a PEFT adapter directory"), (wrong_rank, "do not fit the base"),
             (too_big, "supported ranks are 1..64"), (not_an_object, "must hold a JSON object, not an array"),
             (nan_weights, "has NaN or infinite values")]
    for path, reason in cases:
        failed = admin(engine, "register", name=path.name, src=str(path))
        assert isinstance(failed, Failed) and isinstance(failed.error, InvalidAdapter)
        assert failed.error.status == 400 and reason in failed.error.message
    assert admin(engine, "list").body == before


def test_registration_reads_only_inside_the_adapters_dir(engine, served_dir, tmp_path):
    """src must resolve inside RESIDENT_ADAPTERS_DIR: no other path, no way out by '..' or a symlink,
    and a path outside is refused before anything tells whether it exists."""
    before = admin(engine, "list").body
    outside = tmp_path / "outside"
    shutil.copytree(served_dir / "tone", outside)
    (served_dir / "staged" / "link").symlink_to(outside, target_is_directory=True)
    escapes = [str(outside), "/etc", "/nonexistent/adapter", str(served_dir / "staged" / ".." / ".." / "outside"),
               str(served_dir / "staged" / "link"), "staged/link", "../served-elsewhere"]
    for src in escapes:
        refused = admin(engine, "register", name="escape", src=src)
        assert isinstance(refused, Failed) and isinstance(refused.error, Forbidden), src
        assert refused.error.status == 403 and "not inside RESIDENT_ADAPTERS_DIR" in refused.error.message
    missing = admin(engine, "register", name="missing", src="staged/missing")
    assert isinstance(missing, Failed) and isinstance(missing.error, InvalidAdapter)
    assert "does not exist in RESIDENT_ADAPTERS_DIR" in missing.error.message
    for name, src in [("no-src", None), ("bad-src", 3), ("tone2\n", "tone"), ("x" * 129, "tone"), ("../up", "tone")]:
        refused = admin(engine, "register", name=name, src=src)
        assert isinstance(refused, Failed) and isinstance(refused.error, BadRequest), (name, src)
    assert admin(engine, "list").body == before
    shutil.copytree(served_dir / "tone", served_dir / "staged" / "relative")
    registered = admin(engine, "register", name="relative", src="staged/relative")  # relative to the dir
    assert registered == AdminResult({"registered": "relative", "src": str(served_dir / "staged" / "relative")})
    assert finished(ask(engine, "relative", PROMPT)).token_ids == finished(ask(engine, "tone", PROMPT)).token_ids
    admin(engine, "unregister", name="relative")


def test_without_an_adapters_dir_nothing_registers_at_run_time(tiny_model_path, served_dir):
    engine = Engine(EngineConfig(model_path=str(tiny_model_path))).start()
    try:
        refused = admin(engine, "register", name="tone", src=str(served_dir / "tone"))
        assert isinstance(refused, Failed) and isinstance(refused.error, Forbidden)
        assert refused.error.status == 403 and "RESIDENT_ADAPTERS_DIR" in refused.error.message
        assert admin(engine, "list").body == {"adapters": []}
    finally:
        engine.stop()


def test_journaled_adapters_are_checked_again_on_restart(tiny_model_path, adapters_dir, tmp_path):
    """An adapter registered before a restart comes back only while its directory is still inside
    the adapters dir."""
    first, other = tmp_path / "first", tmp_path / "other"
    shutil.copytree(adapters_dir, first)
    other.mkdir()
    shutil.copytree(adapters_dir / "tone", first / "staged" / "kept")

    def started(directory: Path) -> Engine:
        return make_engine(tiny_model_path, directory, journal_dir=str(tmp_path / "journal"))

    engine = started(first)
    try:
        assert admin(engine, "register", name="kept", src=str(first / "staged" / "kept")).body["registered"] == "kept"
    finally:
        engine.stop()
    for directory, kept in [(first, True), (other, False)]:
        engine = started(directory)
        try:
            assert ("kept" in engine.parts.adapters) == kept
        finally:
            engine.stop()


def test_unregister_in_use_is_refused(engine):
    request = GenerationRequest(messages=user(QUESTIONS[0]), sampling=SamplingParams(max_tokens=4),
                                stream=EventStream(), session_id="holder", open_session=True, adapter="terse")
    finished(run(engine, request))
    refused = admin(engine, "unregister", name="terse")
    assert isinstance(refused, Failed) and isinstance(refused.error, AdapterInUse)
    assert refused.error.status == 409 and "1 live session" in refused.error.message
    assert "terse" in engine.parts.adapters


def test_image_session_with_adapter(engine):
    images = engine.preprocess_images([make_image(9)])
    request = GenerationRequest(messages=user(QUESTIONS[0], image=True), sampling=SamplingParams(max_tokens=8),
                                stream=EventStream(), session_id="img-ad", open_session=True,
                                images=images, adapter="domain")
    with_adapter = finished(run(engine, request)).token_ids
    base = finished(turn(engine, None, QUESTIONS[0], images=images, max_tokens=8)).token_ids
    assert with_adapter != base
