"""ThreadTuner on a simulated machine: it settles on the faster thread count, per batch bucket, follows
a change of load within its refresh window, is not fooled by the slow first step after a switch, ends
a re-measure at a far slower step, and starts a new batch size from its neighbour's verdict. And the
ComputeThread an engine loads and loops on."""

from __future__ import annotations

import threading

import pytest

from session.model.threads import ComputeThread, ThreadTuner, bucket_of

QUIET = {1: 0.0161, 2: 0.0150}  # seconds per step, measured on 2 cores (one session)
BUSY = {1: 0.0160, 2: 0.0363}  # one core kept busy by another process


def serve(tuner: ThreadTuner, steps: int, cost, batch=lambda step: 1, start: int = 0) -> list[int]:
    """Run ``steps`` decode steps; returns the thread count each ran with."""
    used = []
    for step in range(start, start + steps):
        rows = batch(step)
        threads = tuner.choose(rows)
        tuner.observe(rows, cost(threads, rows, step))
        used.append(threads)
    return used


def clocked(costs: dict[int, float], clock: dict[str, float]):
    """A step cost by thread count that also moves the simulated ``clock`` on by that cost."""
    def step(threads, rows, index):
        clock["now"] += costs[threads]
        return costs[threads]
    return step


def test_buckets():
    assert [bucket_of(b) for b in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31)] == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16]


def test_settles_on_the_faster_count_and_sets_it():
    calls = []
    tuner = ThreadTuner((1, 2), refresh_steps=64, max_refresh_steps=512, set_threads=calls.append)
    used = serve(tuner, 3000, lambda threads, rows, step: QUIET[threads])
    # re-measuring 1 thread costs 5 steps per refresh, ever rarer: after 64, 128, 256, then every 512
    assert 0 < used[1000:].count(1) <= 5 * 4
    assert used.count(1) <= 5 + 5 * (1 + 2 + 4 + 8 + 3000 // 512)
    assert calls[0] == 2 and calls[-1] == 2 and tuner.threads == 2  # starts with all cores
    assert tuner.figures()[1] == {1: QUIET[1], 2: QUIET[2]}


def test_follows_a_change_of_load():
    tuner = ThreadTuner((1, 2), refresh_steps=64, max_refresh_steps=512, set_threads=lambda n: None)
    serve(tuner, 2000, lambda threads, rows, step: QUIET[threads])
    assert tuner.threads == 2
    # A neighbour arrives: two threads slow down, the running figure shows it within a few steps.
    used = serve(tuner, 2000, lambda threads, rows, step: BUSY[threads], start=2000)
    switched = used.index(1)
    assert switched <= 10
    assert used[switched:].count(2) <= 5 * (1 + 2 + 4 + 8 + 2000 // 512)
    # It leaves: two threads are only re-measured, so it is noticed within the longest interval.
    used = serve(tuner, 2000, lambda threads, rows, step: QUIET[threads], start=4000)
    assert used.index(2) <= 512 + 1
    assert used[512 + 10:].count(2) >= 0.97 * len(used[512 + 10:])


def test_a_count_left_long_ago_is_re_measured_within_seconds_not_only_steps():
    """A slowdown of two threads no load reader shows (here a tuner without one; a CPU quota before the
    reader re-read it) pushes two threads' interval to its longest; once it lifts, a server with sparse
    traffic must not wait that many steps: a figure older than max_refresh_s is re-measured at once."""
    clock = {"now": 0.0}
    quota = {1: 0.028, 2: 0.090}
    tuner = ThreadTuner((1, 2), first_probe_after=8, refresh_steps=64, max_refresh_steps=2048, max_refresh_s=5.0,
                        set_threads=lambda n: None, clock=lambda: clock["now"])
    used = serve(tuner, 3000, clocked(quota, clock))
    # under the quota, two threads are re-measured once per 5 s of steps at most (and by the step interval)
    switches_to_two = sum(1 for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1)
    assert switches_to_two <= 1 + 3000 * quota[1] / 5.0 + 6
    assert tuner.threads == 1
    clock["now"] += 60.0  # the quota lifts; a minute without a request
    used = serve(tuner, 20, clocked(QUIET, clock), start=3000)
    assert used[0] == 2 and used[-10:] == [2] * 10  # the first step re-measures two threads, and keeps them


def test_a_count_below_the_best_is_re_measured_by_steps_alone():
    """On a quiet machine one thread is only re-measured after its step interval (doubling from 8 to
    512 here), not every max_refresh_s: seconds matter only for cores coming back."""
    clock = {"now": 0.0}
    tuner = ThreadTuner((1, 2), refresh_steps=64, max_refresh_steps=512, max_refresh_s=0.5,
                        set_threads=lambda n: None, clock=lambda: clock["now"])
    used = serve(tuner, 3000, clocked(QUIET, clock))  # 45 s of steps: 90 probes had seconds counted for one thread
    probes = sum(1 for i in range(1, len(used)) if used[i] == 1 and used[i - 1] == 2)
    assert 1 <= probes <= 10  # after 8, 16, 32, 64, 128, 256 steps, then every 512: 10 in 3000 steps


def test_the_first_step_after_a_switch_is_not_counted():
    """Resizing the OpenMP pool makes one step slow (about 1.1x measured on 2 cores; 3x here); counted,
    it would make the faster count look slow."""
    last = {"threads": None}

    def cost(threads, rows, step):
        first = last["threads"] != threads
        last["threads"] = threads
        return QUIET[threads] * (3 if first else 1)

    tuner = ThreadTuner((1, 2), refresh_steps=64, set_threads=lambda n: None)
    used = serve(tuner, 600, cost)
    assert used[100:].count(2) >= 0.9 * 500  # 5 of every ~69 steps re-measure one thread
    assert tuner.figures()[1] == {1: QUIET[1], 2: QUIET[2]}


def test_each_batch_bucket_keeps_its_own_choice():
    """One thread wins at batch 1, two at batch 16 (a compute-bound step): each bucket gets its own."""
    costs = {1: {1: 0.010, 2: 0.012}, 16: {1: 0.060, 2: 0.040}}
    tuner = ThreadTuner((1, 2), refresh_steps=256, set_threads=lambda n: None)
    used = serve(tuner, 2000, lambda threads, rows, step: costs[rows][threads],
                 batch=lambda step: 1 if (step // 7) % 2 else 16)
    by_batch = {1: [], 16: []}
    for step, threads in enumerate(used[200:], start=200):
        by_batch[1 if (step // 7) % 2 else 16].append(threads)
    assert by_batch[1].count(1) >= 0.95 * len(by_batch[1])
    assert by_batch[16].count(2) >= 0.95 * len(by_batch[16])


def test_a_single_candidate_never_switches():
    calls = []
    tuner = ThreadTuner((1,), set_threads=calls.append)
    assert set(serve(tuner, 50, lambda threads, rows, step: 0.01)) == {1}
    assert calls == [1] and tuner.num_switches == 0


def test_a_collapsed_count_costs_one_step_per_probe():
    """Two threads beside a busy neighbour: each barrier waits for a time slice (a 15 ms step took 0.3
    to 1 s). The step after the switch to it is believed, not discarded: each probe is one step."""
    costs = {1: 0.016, 2: 0.300}
    tuner = ThreadTuner((1, 2), first_probe_after=8, refresh_steps=64, max_refresh_steps=1024,
                        set_threads=lambda n: None)
    used = serve(tuner, 2000, lambda threads, rows, step: costs[threads])
    assert used[:8] == [2] * 8 and used[8] == 1  # all cores first, until the first measure of one thread
    used = used[8:]
    probes = sum(1 for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1)
    assert used.count(2) == probes  # the step after the switch collapsed: counted, and the probe ends
    assert probes <= 1 + 6  # first probe after 8 steps, then intervals 128, 256, 512, 1024, 1024


def test_a_new_batch_size_starts_from_its_neighbours_verdict():
    """Batch 1 found two threads far slower; batches 2, 4, 8, 16 (a ramp as requests join) run one
    thread from their first step instead of each re-trying two."""
    costs = {1: 0.016, 2: 0.070}
    tuner = ThreadTuner((1, 2), first_probe_after=8, refresh_steps=256, set_threads=lambda n: None)
    serve(tuner, 100, lambda threads, rows, step: costs[threads])
    ramp = serve(tuner, 5 * 20, lambda threads, rows, step: costs[threads] * rows,
                 batch=lambda step: (2, 4, 8, 16, 16)[(step - 100) // 20], start=100)
    assert ramp == [1] * 100


def test_compute_thread_runs_everything_on_one_other_thread_in_order():
    compute = ComputeThread("test-compute")
    seen = []
    first = compute.call(threading.get_ident)
    futures = [compute.post(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)]
    assert compute.call(lambda: compute.call(threading.get_ident)) == first  # a nested call runs inline
    for future in futures:
        assert future.result(timeout=5) is None
    assert first != threading.get_ident()
    assert seen == [(i, first) for i in range(5)]
    compute.close(timeout=5)
    assert not compute._thread.is_alive()


def test_compute_thread_hands_exceptions_to_the_caller_and_keeps_serving():
    compute = ComputeThread("test-compute")

    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        compute.call(fail)
    assert compute.call(lambda: 6 * 7) == 42
    compute.close(timeout=5)


def test_engine_loads_and_decodes_on_its_loop_thread(monkeypatch, tiny_model_path):
    """One OpenMP team: the model is loaded (assemble) on the thread that later runs the loop."""
    import session.engine.loop as engine_module
    from session.config import EngineConfig
    from session.engine import Engine, GenerationRequest
    from session.engine.events import EventStream, Finished
    from session.types import SamplingParams

    threads = {}
    assemble = engine_module.assemble

    def recording_assemble(*args):
        threads["load"] = threading.get_ident()
        return assemble(*args)

    monkeypatch.setattr(engine_module, "assemble", recording_assemble)
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), max_device_adapters=0)).start()
    try:
        decode = engine.parts.runner.decode

        def recording_decode(*args, **kwargs):
            threads["decode"] = threading.get_ident()
            return decode(*args, **kwargs)

        engine.parts.runner.decode = recording_decode
        stream = EventStream()
        engine.submit(GenerationRequest(messages=(), sampling=SamplingParams(max_tokens=3), stream=stream,
                                        token_ids=[1, 5, 6, 7]))
        while not isinstance(event := stream.get(timeout=60), Finished):
            assert not hasattr(event, "error"), event
        assert len(event.token_ids) == 3
        tuner = engine.parts.executor.thread_tuner
        assert tuner is not None  # RESIDENT_THREADS=0 on CPU: measured
        assert engine.fresh_stats().events["thread_switches"] == tuner.num_switches
    finally:
        engine.stop()
    assert threads["decode"] == threads["load"] != threading.get_ident()


def test_images_are_preprocessed_without_an_openmp_team_of_the_callers(monkeypatch, tiny_model_path):
    """A parallel operator on a thread that stays (the handler's executor threads) would give it an
    OpenMP team beside the engine's, slowing every later decode step: the engine runs preprocessing on
    the caller's thread alone, and gives the thread its own count back."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    import session.engine.preparation as engine_module
    from session.config import EngineConfig
    from session.engine import Engine

    seen = {}

    def parallel_preprocess(vision, images):  # as a processor that runs torch's parallel operators would
        seen["threads"] = torch.get_num_threads()
        seen["sum"] = float(torch.ones(1 << 24).sum())
        return "images"

    monkeypatch.setattr(engine_module, "preprocess_images", parallel_preprocess)
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), max_device_adapters=0)).start()
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(torch.set_num_threads, 2).result()  # the caller's own count, before any operator
        before = len(os.listdir("/proc/self/task"))
        assert pool.submit(engine.preprocess_images, ["an image"]).result() == "images"
        assert seen == {"threads": 1, "sum": float(1 << 24)}
        assert len(os.listdir("/proc/self/task")) == before  # no team's worker started
        assert pool.submit(torch.get_num_threads).result() == 2
    finally:
        pool.shutdown()
        engine.stop()


def test_a_prefill_runs_on_the_best_count_even_while_decode_steps_re_measure_another():
    calls = []
    tuner = ThreadTuner((1, 2), refresh_steps=64, max_refresh_steps=512, set_threads=calls.append)
    serve(tuner, 8, lambda threads, rows, step: QUIET[threads])  # 2 threads measured at batch 1
    assert tuner.choose(1) == 1  # its first re-measure of 1 thread
    tuner.observe(1, QUIET[1])
    assert tuner.choose_for_prefill() == 2 and calls[-1] == 2  # the prompt is fed on the best count
    assert tuner.choose(1) == 1  # the re-measure goes on, its first step after the switch not counted
    tuner.observe(1, 3 * QUIET[1])  # slow (the pool resized), not collapsed: not counted
    assert tuner.figures()[1][1] is None
    fresh = ThreadTuner((1, 2), set_threads=calls.append)
    assert fresh.choose_for_prefill() == 2  # nothing measured yet: all cores


def test_a_collapse_of_the_count_in_use_is_left_after_one_step_and_re_measured_soon():
    collapsed = {1: 0.016, 2: 0.500}  # a neighbour took one of the two cores
    tuner = ThreadTuner((1, 2), refresh_steps=64, max_refresh_steps=512, set_threads=lambda n: None)
    serve(tuner, 2000, lambda threads, rows, step: QUIET[threads])
    assert tuner.threads == 2 and tuner.figures()[1][1] == QUIET[1]
    used = serve(tuner, 400, lambda threads, rows, step: collapsed[threads], start=2000)
    assert used[:2] == [2, 1]  # one collapsed step, not the running figure's catching up
    # re-measured after 8 steps, then 16, 32, ...: one step each (the collapse ends the probe)
    assert used.count(2) == 1 + 5  # the collapsed step, then probes after 8, 16, 32, 64, 128 steps
    used = serve(tuner, 600, lambda threads, rows, step: QUIET[threads], start=2400)
    assert used.index(2) <= 256 + 1  # the neighbour left: found at the next probe
    assert used[-100:] == [2] * 100


def test_only_a_step_past_the_collapse_ratio_is_believed_at_once():
    costs = {1: 0.030, 2: 0.015}  # two threads twice as fast; the collapse ratio is 4x one thread's 0.030

    def once(factor):
        tuner = ThreadTuner((1, 2), refresh_steps=64, set_threads=lambda n: None)
        serve(tuner, 200, lambda threads, rows, step: costs[threads])
        assert tuner.threads == 2
        return serve(tuner, 3, lambda threads, rows, step: costs[threads] * (factor if step == 200 else 1),
                     start=200)

    assert once(7) == [2, 2, 2]  # 0.105 s: a stall of the process moves the running figure a little
    assert once(10) == [2, 1, 1]  # 0.150 s: a collapse; one thread until it is re-measured


def test_cores_taken_elsewhere_cap_the_count_before_any_step_collapses():
    """The load reader sees a neighbour before a step does: no step (or prompt) runs on its core."""
    free = {"cores": 2.0}
    tuner = ThreadTuner((1, 2), refresh_steps=64, set_threads=lambda n: None, free_cores=lambda: free["cores"])
    serve(tuner, 300, lambda threads, rows, step: QUIET[threads])
    assert tuner.threads == 2
    free["cores"] = 1.2  # the front and the clients: 0.8 of a core elsewhere, over taken_at
    assert tuner.choose_for_prefill() == 1
    used = serve(tuner, 500, lambda threads, rows, step: {1: 0.016, 2: 0.5}[threads], start=300)
    assert used == [1] * 500  # not one probe of two threads while the core is taken
    free["cores"] = 1.4  # 0.6 elsewhere: under taken_at, both counts are the tuner's to measure
    used = serve(tuner, 100, lambda threads, rows, step: QUIET[threads], start=800)
    assert used[0] == 2 and used[-50:].count(2) >= 45  # its quiet figure, never collapsed, is the best again
