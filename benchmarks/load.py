"""Load: N sessions x M turns at concurrency C against a real server, with a small KV budget.

Each session opens with an image and asks M-1 follow-ups; C sessions run at a time (aiohttp,
one connection per session in flight). With ``--start-server`` a TorchServe instance is
started with RESIDENT_DEVICE_BUDGET_BYTES small enough that sessions must be demoted and
restored. Prints throughput, p50/p99 latency per turn kind, errors (and 503s), and the
server's own counters (demotions, restores) read from its Prometheus metrics; writes JSON.

Run: python -m benchmarks.load --start-server [--sessions 24] [--turns 4] [--concurrency 8]

``--mixed``: the mixed workload of benchmarks/mixed_load.py instead (64 clients for 2 minutes:
sessions and stateless, max_tokens 1..128, disconnects, closes while busy), reporting completed,
failed, cancelled and lost requests, p50/p99, and the server's invariant violations.
Run: python -m benchmarks.load --start-server --mixed [--clients 64] [--duration 120]

``--abuse``: the workload of benchmarks/abuse_load.py instead (security issue #28): one victim streams
answers of its session alone (baseline), then while attackers send 6 requests (3 at a time) of one
6,000,000-character message each, which the server must refuse with a 4xx. Reports the victim's chunks
per second and gaps between chunks (longest, p99) alone, in the attack phase and while attacks were in
flight, and each attacker's status, error type and time to answer; whether the longest gap in the
attack phase stayed under 0.5 s is printed, not enforced. The started server runs
with the default limits (RESIDENT_MAX_PROMPT_CHARS, the 6 MiB request size): they are what is measured.
Exits 1 if an attacker got a 5xx or no answer, or the victim's stream failed.
Run: python -m benchmarks.load --start-server --abuse [--attacks 6] [--attack-concurrency 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.common import REPO, format_table, free_port, image_data_url, percentile, write_json
from launch.torchserve import DEFAULT_MODEL, ensure_demo_models, start_torchserve

SESSION = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_ID = "X-Amzn-SageMaker-New-Session-Id"
MAX_RETRIES = 40
FOLLOWUPS = ["What colour dominates?", "Is there any text in it?", "What might it be used for?",
             "Describe the layout.", "Anything unusual?", "Summarise in one line."]


async def converse(http: aiohttp.ClientSession, url: str, index: int, turns: int, max_tokens: int,
                   samples: list, errors: list) -> None:
    session_id = "NEW_SESSION"
    for step in range(turns):
        content = [{"type": "text", "text": "What is in this picture?" if step == 0 else FOLLOWUPS[(step - 1) % 6]}]
        if step == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_data_url(index, size=64)}})
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        start = time.perf_counter()
        for attempt in range(MAX_RETRIES + 1):
            async with http.post(url, json=body, headers={SESSION: session_id}) as response:
                payload = await response.json(content_type=None)
                # overload: back off as told, like a well-behaved client; the last 503 is a give-up, below
                if response.status == 503 and attempt < MAX_RETRIES:
                    errors.append({"status": 503, "turn": step, "retry_after": response.headers.get("Retry-After")})
                    await asyncio.sleep(min(float(response.headers.get("Retry-After", "1")), 1.0) / 4)
                    continue
                break
        elapsed = time.perf_counter() - start  # includes any back-off: what the user waited
        if response.status != 200:  # a 503 here is a give-up after MAX_RETRIES: a failure, not a back-off
            errors.append({"status": response.status, "turn": step, "body": payload, "gave_up": True})
            return
        if step == 0:
            session_id = response.headers[NEW_SESSION_ID].split(";")[0]
        cached = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
        samples.append({"kind": "first" if step == 0 else "followup", "s": elapsed, "cached": cached})
    async with http.post(url, json={"requestType": "CLOSE"}, headers={SESSION: session_id}) as response:
        await response.read()


async def run_load(url: str, sessions: int, turns: int, concurrency: int, max_tokens: int) -> dict:
    samples: list = []
    errors: list = []
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=300)

    async def one(index: int) -> None:
        async with gate:
            await converse(http, url, index, turns, max_tokens, samples, errors)

    async with aiohttp.ClientSession(timeout=timeout) as http:
        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(sessions)))
        wall = time.perf_counter() - start
    return {"samples": samples, "errors": errors, "wall_s": wall}


def failures(errors: list[dict]) -> list[dict]:
    """The errors a client saw as failures: all but the 503s it backed off from and then got through."""
    return [e for e in errors if e["status"] != 503 or e.get("gave_up")]


def settled_counters(metrics_url: str, *args: str, timeout_s: float = 10) -> dict[str, float]:
    """``server_counters`` once two reads half a second apart agree: TorchServe fills its metrics from
    the worker's log asynchronously, so a read right after the last answer can miss the last events."""
    last, deadline = server_counters(metrics_url, *args), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = server_counters(metrics_url, *args)
        if now == last:
            break
        last = now
    return last


def server_counters(metrics_url: str, metric: str = "SessionEvents", label: str = "Event") -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10).read().decode()
    out = {}
    for match in re.finditer(rf'^{metric}\{{.*{label}="(\w+)".*\}} (\S+)$', text, re.M):
        out[match.group(1)] = out.get(match.group(1), 0.0) + float(match.group(2))
    return out


def server_env(args, run_dir: Path) -> dict[str, str]:
    """The started server's settings: a small KV budget for load and mixed; the defaults for abuse,
    whose limits (and engine without invariant checks) are what it measures."""
    env = {"RESIDENT_JOURNAL_DIR": str(run_dir / "journal")}
    if args.abuse:
        return env
    return {**env, "RESIDENT_DEVICE_BUDGET_BYTES": str(args.budget_bytes),
            "RESIDENT_HOST_BUDGET_BYTES": str(args.host_budget_bytes), "RESIDENT_KV_BLOCK_TOKENS": "64",
            "RESIDENT_CHECK_INVARIANTS": "true", "RESIDENT_MAX_QUEUE": "512"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server's /predictions/<model> or /invocations URL")
    parser.add_argument("--metrics-url", help="its metrics address (to read demotions/restores)")
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--model-path", default=str(DEFAULT_MODEL))
    parser.add_argument("--budget-bytes", type=int, default=0,
                        help="device KV budget for the started server; default: room for the running sessions "
                             "plus two idle ones of the tiny model (2 blocks of 64 tokens x 512 B each)")
    parser.add_argument("--host-budget-bytes", type=int, default=4 * 64 * 1024)
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--mixed", action="store_true", help="the mixed workload (benchmarks/mixed_load.py)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--timeout", type=float, default=180.0, help="a request without an answer by then is lost")
    parser.add_argument("--abuse", action="store_true", help="huge prompts vs a stream (benchmarks/abuse_load.py)")
    parser.add_argument("--attacks", type=int, default=6, help="abuse: requests with a huge prompt")
    parser.add_argument("--attack-concurrency", type=int, default=3)
    parser.add_argument("--prompt-chars", type=int, default=6_000_000, help="abuse: characters in each huge prompt")
    parser.add_argument("--victim-max-tokens", type=int, default=256, help="abuse: max_tokens of each streamed turn")
    parser.add_argument("--victim-s", type=float, default=5.0, help="abuse: the victim streams at least this long")
    parser.add_argument("--victim-image", action="store_true", help="abuse: the victim opens with an image")
    args = parser.parse_args(argv)
    # Room for every request in flight (mixed: 6 blocks of 64 tokens each, image and answer included) but
    # not for the idle sessions, which are demoted and restored.
    args.budget_bytes = args.budget_bytes or (args.clients * 6 if args.mixed else (args.concurrency + 2) * 2) * 64 * 512
    server = None
    url, metrics_url = args.url, args.metrics_url
    if url is None:
        if not args.start_server:
            raise SystemExit("give --url of a running server or --start-server")
        if Path(args.model_path).resolve() == DEFAULT_MODEL.resolve():
            ensure_demo_models()
        port = free_port()
        run_dir = REPO / "build" / f"load-{port}"
        run_dir.mkdir(parents=True, exist_ok=True)
        server = start_torchserve(port, run_dir=run_dir, model_path=args.model_path,
                                  stdout=open(run_dir / "torchserve.log", "w"), extra_env=server_env(args, run_dir))
        url, metrics_url = f"{server.url}/predictions/llava", server.metrics_url
    try:
        if server is not None:
            server.wait_ready(600)
        if args.mixed:
            return report_mixed(args, url, metrics_url)
        if args.abuse:
            return report_abuse(args, url)
        before = server_counters(metrics_url) if metrics_url else {}
        result = asyncio.run(run_load(url, args.sessions, args.turns, args.concurrency, args.max_tokens))
        after = settled_counters(metrics_url) if metrics_url else {}
    finally:
        if server is not None:
            server.stop()
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    samples, errors = result["samples"], result["errors"]
    rows = []
    summary: dict = {}
    for kind in ("first", "followup"):
        times = [s["s"] for s in samples if s["kind"] == kind]
        summary[kind] = {"n": len(times), "p50_s": percentile(times, 50), "p99_s": percentile(times, 99)}
        rows.append([kind, len(times), summary[kind]["p50_s"], summary[kind]["p99_s"]])
    print(format_table(["turn", "n", "p50 s", "p99 s"], rows))
    completed = len(samples)
    print(f"\nsessions {args.sessions} x turns {args.turns} at concurrency {args.concurrency}, KV budget "
          f"{args.budget_bytes} B: {completed} requests in {result['wall_s']:.1f} s = "
          f"{completed / result['wall_s']:.2f} req/s; errors {len(failures(errors))}; "
          f"503s retried {sum(e['status'] == 503 and not e.get('gave_up') for e in errors)}")
    print("server counters during the run: " + ", ".join(f"{k} {int(v)}" for k, v in sorted(counters.items())))
    write_json(args.out / "load.json", {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "summary": summary, "requests": completed, "wall_s": result["wall_s"],
        "throughput_rps": completed / result["wall_s"], "errors": errors, "server_counters": counters,
        "samples": samples,
    })
    return 1 if failures(errors) else 0


def report_mixed(args, url: str, metrics_url: str | None) -> int:
    from benchmarks.mixed_load import run_mixed

    result = asyncio.run(run_mixed(url, args.clients, args.duration, args.timeout))
    server = settled_counters(metrics_url, "RequestOutcomes", "Kind") if metrics_url else {}
    outcomes = result["outcomes"]
    rows = [[kind, count] for kind, count in sorted(outcomes.items())]
    rows.append(["server: invariant violations", int(server.get("invariant_violations", 0))])
    rows.append(["server: cancelled / failed", f"{int(server.get('cancelled', 0))} / {int(server.get('failed', 0))}"])
    print(format_table(["outcome", "count"], rows))
    print(f"\n{args.clients} clients for {args.duration:.0f} s: {sum(outcomes.values())} requests in "
          f"{result['wall_s']:.1f} s; completed p50 {result['p50_s']:.3f} s, p99 {result['p99_s']:.3f} s")
    write_json(args.out / "load_mixed.json", {**result, "server": server, "clients": args.clients,
                                              "duration_s": args.duration})
    return 1 if outcomes.get("lost", 0) or server.get("invariant_violations", 0) else 0


def report_abuse(args, url: str) -> int:
    from benchmarks.abuse_load import AIM_GAP_S, run_abuse

    result = asyncio.run(run_abuse(url, num_attacks=args.attacks, concurrency=args.attack_concurrency,
                                   prompt_chars=args.prompt_chars, max_tokens=args.victim_max_tokens,
                                   victim_s=args.victim_s, with_image=args.victim_image, timeout_s=args.timeout))
    baseline, attack = result["baseline"]["victim"], result["attack"]["victim"]
    rows = [_gap_row("baseline", baseline, baseline), _gap_row("attack", attack, attack)]
    if "window" in attack:
        window = attack["window"]
        rows.append(_gap_row(f"  while attacked ({window['start_s']:.2f}-{window['end_s']:.2f} s)", window, {}))
    print(format_table(["victim", "turns", "chunks", "chunks/s", "longest gap s", "at s", "p99 gap s", "p50 gap s",
                        "longest first chunk s", "failed"], rows))
    attacks = result["attack"]["attacks"]
    print()
    print(format_table(["attacker answer", "error type", "n", "p50 answer s", "max answer s"],
                       [[a["status"], a["error_type"], a["n"], a["p50_answer_s"], a["max_answer_s"]] for a in attacks]))
    for a in attacks:
        print(f"  {a['status']} {a['error_type']}: {a['message']}")
    longest, settings = attack["longest_gap_s"], result["settings"]
    print(f"\n{args.attacks} prompts of {settings['prompt_chars']} characters ({settings['body_bytes']} B bodies), "
          f"{args.attack_concurrency} at a time; victim max_tokens {args.victim_max_tokens}. Aim (longest gap in the "
          f"attack phase < {AIM_GAP_S} s): {'met' if longest < AIM_GAP_S else 'NOT met'} ({longest:.3f} s)")
    write_json(args.out / "load_abuse.json", result)
    num_failed_turns = baseline["num_failed"] + attack["num_failed"]
    num_failed_attacks = result["attack"]["num_failed_attacks"]
    if num_failed_turns or num_failed_attacks:
        print(f"FAILED: {num_failed_turns} victim turns failed, {num_failed_attacks} attackers got a 5xx or no answer")
    return 1 if num_failed_turns or num_failed_attacks else 0


def _gap_row(label: str, gaps: dict, phase: dict) -> list:
    """A table row from victim_summary's numbers; ``phase`` adds its per-turn columns (blank without)."""
    return [label, phase.get("num_turns", ""), gaps["num_chunks"], gaps["chunks_per_s"], gaps["longest_gap_s"],
            gaps["longest_gap_at_s"], gaps["p99_gap_s"], gaps["p50_gap_s"], phase.get("longest_first_chunk_s", ""),
            phase.get("num_failed", "")]


if __name__ == "__main__":
    sys.exit(main())
