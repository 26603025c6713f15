"""What draining a backend costs: time to move each session, and its first follow-up after the move.

Starts ``python -m launch cluster`` with two backends (its own process, as in production), opens
``--sessions`` sessions with one image each and grows each by ``--turns`` follow-ups, then:
  1. one follow-up per session, KV resident (the baseline);
  2. ``POST /backends/0/drain``: every session on backend 0 is exported (transcript + image bytes),
     imported on backend 1; the front's report times each move;
  3. one follow-up per session: on a moved session the target recomputes the KV (one prefill of the
     whole transcript, the image through the vision tower again), on the others it is resident;
  4. one more follow-up per session: resident everywhere again.
The KV itself is not copied between backends (the engine exports transcripts, not tensors); the
difference between (3) and (1) on moved sessions is what a KV copy could save at most.

Run:  python -m benchmarks.migration                    (the demo model; --model-path for another)
      python -m benchmarks.migration --bench-model      (LLaVA-shaped: 336 px, 576 image tokens)
Writes <out>/migration.json (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

from benchmarks.common import format_table, free_port, image_data_url, mean, percentile, write_json
from launch.torchserve import DEFAULT_MODEL, REPO, ensure_demo_models
from session.serving.protocol import ADMIN_TOKEN_HEADER, NEW_SESSION_HEADER, SESSION_HEADER

QUESTIONS = ["What is in the top left corner?", "And the bottom right?", "Which colour is most common?",
             "Describe it in one word.", "Is there any red?", "What else?"]


class RequestFailed(RuntimeError):
    pass


@contextlib.contextmanager
def cluster(model_path: Path, run_dir: Path) -> Iterator[tuple[str, str]]:
    """(front URL, admin token) of ``python -m launch cluster`` with 2 backends; stopped by PID on exit."""
    port = free_port(1)
    env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1", "BACKENDS": "2", "MODEL": str(model_path),
           "RESIDENT_BACKEND_PORT": str(free_port(20)), "RESIDENT_FRONT_HEALTH_INTERVAL_S": "0.5"}
    env.pop("SAGEMAKER_BIND_TO_PORT", None)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "cluster.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "launch", "cluster"], cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, process)
            yield url, (REPO / "build" / f"cluster-{port}" / "admin-token").read_text().strip()
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RequestFailed(f"the cluster exited with {process.returncode}")
        with contextlib.suppress(requests.ConnectionError):
            ping = requests.get(url + "/ping", timeout=2)
            if ping.status_code == 200 and ping.json()["healthy_backends"] == 2:
                return
        time.sleep(0.5)
    raise RequestFailed(f"the cluster at {url} was not healthy within {timeout_s:g} s")


def ask(url: str, session: str, content, max_tokens: int) -> tuple[requests.Response, float]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    response = requests.post(url + "/invocations", json=body, headers={SESSION_HEADER: session}, timeout=300)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RequestFailed(f"{response.status_code} {response.text}")
    return response, seconds


def open_sessions(url: str, num: int, turns: int, max_tokens: int) -> list[str]:
    session_ids = []
    for i in range(num):
        content = [{"type": "image_url", "image_url": {"url": image_data_url(100 + i)}},
                   {"type": "text", "text": "What is in this image?"}]
        response, _ = ask(url, "NEW_SESSION", content, max_tokens)
        session_ids.append(response.headers[NEW_SESSION_HEADER].split(";")[0])
        for t in range(turns):
            ask(url, session_ids[-1], QUESTIONS[t % len(QUESTIONS)], max_tokens)
    return session_ids


def follow_all(url: str, session_ids: list[str], question: str, max_tokens: int) -> dict[str, tuple[float, int]]:
    """session_id -> (seconds, prompt tokens) of one follow-up each."""
    timed = {}
    for session_id in session_ids:
        response, seconds = ask(url, session_id, question, max_tokens)
        timed[session_id] = (seconds, response.json()["usage"]["prompt_tokens"])
    return timed


def stats_ms(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "mean_ms": 1000 * mean(values), "p50_ms": 1000 * percentile(values, 50),
            "max_ms": 1000 * max(values)}


def measure(url: str, token: str, args: argparse.Namespace) -> dict:
    session_ids = open_sessions(url, args.sessions, args.turns, args.max_tokens)
    before = follow_all(url, session_ids, "Anything else?", args.max_tokens)
    report = requests.post(url + "/backends/0/drain", headers={ADMIN_TOKEN_HEADER: token}, timeout=600).json()
    moved = {s["session_id"] for s in report["sessions"]}
    if not moved:  # sticky routing put every session on the other backend: nothing to time
        raise SystemExit(f"no session of {len(session_ids)} was on backend 0; run with more --sessions")
    first = follow_all(url, session_ids, "Tell me once more.", args.max_tokens)
    second = follow_all(url, session_ids, "And finally?", args.max_tokens)
    kept = [sid for sid in session_ids if sid not in moved]
    rows = {
        "move (export + import), per session": stats_ms([(s["export_ms"] + s["import_ms"]) / 1000
                                                        for s in report["sessions"]]),
        "follow-up before the drain (KV resident)": stats_ms([before[s][0] for s in moved]),
        "first follow-up after the move (KV recomputed)": stats_ms([first[s][0] for s in moved]),
        "next follow-up after the move (KV resident)": stats_ms([second[s][0] for s in moved]),
        "first follow-up, sessions not moved": stats_ms([first[s][0] for s in kept]) if kept else None,
    }
    drain = {k: report[k] for k in ("moved", "failed", "remaining", "seconds", "per_session_ms")}
    return {"rows": rows, "drain": drain, "transcript_tokens": mean([first[s][1] for s in moved])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--bench-model", action="store_true", help="build and use the LLaVA-shaped bench model")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3, help="follow-ups per session before the drain")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.bench_model:
        ensure_demo_models(REPO / "build" / "models", only=["bench"])
        args.model_path = REPO / "build" / "models" / "llava-bench"
    try:
        with cluster(args.model_path, REPO / "build" / "bench-migration") as (url, token):
            result = measure(url, token, args)
    except RequestFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    table = [[name, r["n"], r["mean_ms"], r["p50_ms"], r["max_ms"]] for name, r in result["rows"].items() if r]
    print(format_table(["what (moved sessions unless said)", "n", "mean ms", "p50 ms", "max ms"], table))
    print(f"drain: {result['drain']['moved']} moved in {result['drain']['seconds']} s; transcript "
          f"{result['transcript_tokens']:.0f} tokens per moved session")
    path = write_json(args.out / "migration.json", {**result, "settings": {
        "model_path": str(args.model_path), "sessions": args.sessions, "turns": args.turns,
        "max_tokens": args.max_tokens, "loadavg_1m_at_end": os.getloadavg()[0]}})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
