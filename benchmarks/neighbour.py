"""A short chat's latency on a quiet machine, beside a busy neighbour, and under a CPU quota, against
any OpenAI-compatible server (ours through ``make serve`` / ``make cluster``, or vLLM's).

    python -m benchmarks.neighbour --base-url http://127.0.0.1:8080/v1 --model smollm2-135m-instruct \\
        --label resident [--quota-pids PID ...] [--requests 12] [--adapt-s 15]
    python -m benchmarks.neighbour --compare   # every label's last run, side by side

Phases, one request at a time (greedy, 32 new tokens, a distinct short question each):
- quiet: nothing else running;
- neighbour: another process keeps one core busy (``while True: pass``), started ``--adapt-s``
  seconds before the phase's requests (the time a server has to adapt), then a phase after it stops;
- quota (root only, ``--quota-pids``): the server's processes (and their threads) moved into a cgroup
  v1 ``cpu`` group limited to ``--quota`` CPUs, as ``docker run --cpus`` does; moved back after, and a
  phase after it (a quota the server cannot see, lifted: does it take its cores back?).
Reported per phase: median and worst latency, and the median's ratio to the quiet one. With
``--rounds N`` the quiet and neighbour phases alternate N times and each kind's figures are over all
its rounds' requests (a shared machine's drift then falls on both sides alike). Results go to
<--out>/neighbour-<label>.json (benchmarks/results by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import requests

from benchmarks.common import format_table, write_json

RESULTS = Path(__file__).resolve().parent / "results"
CGROUP = Path("/sys/fs/cgroup/cpu")
TOPICS = ["tea", "rivers", "owls", "clocks", "maps", "bread", "kites", "glass", "salt", "ferns", "bells", "snow",
          "wool", "ice", "moss", "ink", "sand", "honey", "bricks", "lamps"]


def chat(url: str, model: str, index: int, max_tokens: int) -> float:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Say one thing about {TOPICS[index % len(TOPICS)]}."}]}
    started = time.perf_counter()
    response = requests.post(f"{url}/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return time.perf_counter() - started


def phase(url: str, model: str, name: str, count: int, max_tokens: int, offset: int) -> dict:
    times = [chat(url, model, offset + i, max_tokens) for i in range(count)]
    print(f"{name}: median {statistics.median(times):.3f} s, worst {max(times):.3f} s", flush=True)
    return {"phase": name, "median_s": statistics.median(times), "worst_s": max(times), "times_s": times}


@contextmanager
def busy_core():
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


@contextmanager
def cpu_quota(pids: list[int], cpus: float):
    """Move ``pids`` and all their threads into a cgroup v1 cpu group limited to ``cpus``; back after."""
    group = CGROUP / f"resident-bench-{time.monotonic_ns()}"
    group.mkdir()
    period = 100_000
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
    tasks = [int(t.name) for pid in pids for t in Path(f"/proc/{pid}/task").iterdir()]
    try:
        for task in tasks:
            (group / "tasks").write_text(str(task))
        yield
    finally:
        for task in (group / "tasks").read_text().split():
            try:
                (CGROUP / "tasks").write_text(task)
            except OSError:
                pass  # the thread ended
        group.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--label", default="resident")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--adapt-s", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=1, help="quiet / busy core / after, alternated this often")
    parser.add_argument("--quota-pids", type=int, nargs="*", default=[])
    parser.add_argument("--quota", type=float, default=1.0, help="CPUs the quota phase allows")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder results go to (and --compare reads)")
    args = parser.parse_args()
    if args.compare:
        return compare(args.out)
    if not args.base_url:
        parser.error("--base-url is required (a running server's OpenAI route, e.g. http://127.0.0.1:8180/v1)")
    url, n, tokens = args.base_url.rstrip("/"), args.requests, args.max_tokens
    for i in range(3):
        chat(url, args.model, 100 + i, tokens)  # warm-up
    rounds: dict[str, list[float]] = {"quiet": [], "busy core": [], "after": []}
    for round_index in range(args.rounds):
        offset = 3 * n * round_index
        rounds["quiet"] += phase(url, args.model, "quiet", n, tokens, offset)["times_s"]
        with busy_core():
            time.sleep(args.adapt_s)
            rounds["busy core"] += phase(url, args.model, "busy core", n, tokens, offset + n)["times_s"]
        time.sleep(args.adapt_s)
        rounds["after"] += phase(url, args.model, "after", n, tokens, offset + 2 * n)["times_s"]
    phases = [{"phase": name, "median_s": statistics.median(times), "worst_s": max(times), "times_s": times}
              for name, times in rounds.items()]
    if args.quota_pids:
        with cpu_quota(args.quota_pids, args.quota):
            time.sleep(args.adapt_s)
            phases.append(phase(url, args.model, f"quota {args.quota:g} CPU", n, tokens, 3 * n * args.rounds))
        time.sleep(args.adapt_s)
        phases.append(phase(url, args.model, "after quota", n, tokens, 3 * n * args.rounds + n))
    quiet = phases[0]["median_s"]
    for row in phases:
        row["vs_quiet"] = row["median_s"] / quiet
    write_json(args.out / f"neighbour-{args.label}.json", {"label": args.label, "phases": phases,
                                                         "max_tokens": tokens, "requests": n, "rounds": args.rounds})
    print(format_table(["phase", "median s", "worst s", "vs quiet"],
                       [[p["phase"], f"{p['median_s']:.3f}", f"{p['worst_s']:.3f}", f"{p['vs_quiet']:.2f}x"]
                        for p in phases]))


def compare(results: Path) -> None:
    rows = []
    for path in sorted(results.glob("neighbour-*.json")):
        data = json.loads(path.read_text())
        rows += [[data["label"], p["phase"], f"{p['median_s']:.3f}", f"{p['worst_s']:.3f}", f"{p['vs_quiet']:.2f}x"]
                 for p in data["phases"]]
    print(format_table(["server", "phase", "median s", "worst s", "vs quiet"], rows))


if __name__ == "__main__":
    main()
