"""What the front adds per request: small requests through the front vs straight to TorchServe.

One TorchServe backend and the front before it (``python -m launch front``, its own process, as in
production). Sequentially, in interleaved rounds so that drift in machine load hits every path
alike, each round sends one identical small stateless request (max_tokens 1, greedy) along each path:
  - TorchServe direct, with requests (keep-alive);
  - the front, with requests (keep-alive): the same request, one more hop;
  - the front, with boto3's sagemaker-runtime client (invoke_endpoint): what users run, including
    the client's own cost (SigV4 signing, response parsing).
Each request is timed end to end on the client. The front's overhead is its p50/p99 minus direct's.

Run:  python -m benchmarks.front_overhead                          (starts TorchServe and the front)
      python -m benchmarks.front_overhead --backend-url http://127.0.0.1:8090 --front-url http://127.0.0.1:8080
Writes <out>/front_overhead.json (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import requests
from botocore.config import Config

from benchmarks.common import format_table, free_port, mean, percentile, server_url, write_json
from launch.torchserve import DEFAULT_MODEL, REPO

BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
DIRECT, FRONT, FRONT_BOTO3 = "torchserve_direct", "front_requests", "front_boto3"
LABELS = {DIRECT: "TorchServe direct (requests)", FRONT: "front (requests)",
          FRONT_BOTO3: "front (boto3 sagemaker-runtime)"}


class RequestFailed(RuntimeError):
    pass


@contextlib.contextmanager
def front_process(backend_url: str, run_dir: Path) -> Iterator[str]:
    """``python -m launch front`` before ``backend_url`` on a free port; stopped (SIGTERM) on exit."""
    port = free_port(1)
    env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1", "RESIDENT_FRONT_BACKENDS": backend_url,
           "RESIDENT_FRONT_HEALTH_INTERVAL_S": "0.5"}
    env.pop("SAGEMAKER_BIND_TO_PORT", None)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "front.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "launch", "front"], cwd=REPO, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_for_ping(url, process)
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)


def _wait_for_ping(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RequestFailed(f"the front exited with {process.returncode}")
        with contextlib.suppress(requests.ConnectionError):
            if requests.get(url + "/ping", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RequestFailed(f"the front at {url} was not healthy within {timeout_s:g} s")


def http_path(base_url: str) -> Callable[[], None]:
    http = requests.Session()

    def send() -> None:
        response = http.post(base_url + "/invocations", json=BODY, timeout=60)
        if response.status_code != 200:
            raise RequestFailed(f"{base_url}: {response.status_code} {response.text}")
    return send


def boto3_path(front_url: str) -> Callable[[], None]:
    client = boto3.client("sagemaker-runtime", endpoint_url=front_url, region_name="us-east-1",
                          aws_access_key_id="local", aws_secret_access_key="local",
                          config=Config(retries={"total_max_attempts": 1}))
    body = json.dumps(BODY)

    def send() -> None:
        client.invoke_endpoint(EndpointName="resident", Body=body, ContentType="application/json")["Body"].read()
    return send


def measure(paths: dict[str, Callable[[], None]], num_requests: int, num_warmup: int) -> dict[str, list[float]]:
    """Interleaved rounds; returns seconds per path."""
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for round_index in range(num_warmup + num_requests):
        for name, send in paths.items():
            start = time.perf_counter()
            send()
            if round_index >= num_warmup:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def summarize(seconds: dict[str, list[float]]) -> dict[str, dict]:
    return {name: {"n": len(s), "p50_ms": 1000 * percentile(s, 50), "p99_ms": 1000 * percentile(s, 99),
                   "mean_ms": 1000 * mean(s)} for name, s in seconds.items()}


def overhead(summary: dict[str, dict], path: str) -> dict[str, float]:
    return {q: summary[path][q] - summary[DIRECT][q] for q in ("p50_ms", "p99_ms", "mean_ms")}


def report(summary: dict[str, dict]) -> str:
    rows = [[LABELS[name], s["n"], s["p50_ms"], s["p99_ms"], s["mean_ms"]] for name, s in summary.items()]
    lines = [format_table(["path", "n", "p50 ms", "p99 ms", "mean ms"], rows), ""]
    for path in (FRONT, FRONT_BOTO3):
        extra = overhead(summary, path)
        lines.append(f"{LABELS[path]} minus direct: p50 {extra['p50_ms']:+.2f} ms, p99 {extra['p99_ms']:+.2f} ms")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend-url", help="a running TorchServe (with --front-url); default: start one")
    parser.add_argument("--front-url", help="a running front before --backend-url")
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL, help="model for a started TorchServe")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per path")
    parser.add_argument("--warmup", type=int, default=20, help="untimed requests per path first")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if bool(args.backend_url) != bool(args.front_url):
        parser.error("give both --backend-url and --front-url, or neither")
    if args.requests < 1 or args.warmup < 0:
        parser.error("need --requests >= 1 and --warmup >= 0")
    return args


@contextlib.contextmanager
def stack(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    if args.backend_url:
        yield args.backend_url.rstrip("/"), args.front_url.rstrip("/")
        return
    with server_url(None, start_server=True, model_path=args.model_path, log_name="torchserve.log") as backend:
        with front_process(backend, REPO / "build" / "front-overhead") as front:
            yield backend, front


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with stack(args) as (backend, front):
            paths = {DIRECT: http_path(backend), FRONT: http_path(front), FRONT_BOTO3: boto3_path(front)}
            seconds = measure(paths, args.requests, args.warmup)
    except RequestFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = summarize(seconds)
    print(report(summary))
    path = write_json(args.out / "front_overhead.json", {
        "summary": summary, "overhead_ms": {p: overhead(summary, p) for p in (FRONT, FRONT_BOTO3)},
        "settings": {"backend_url": backend, "front_url": front, "requests": args.requests, "warmup": args.warmup,
                     "body": BODY, "model_path": None if args.backend_url else str(args.model_path),
                     "loadavg_1m_at_end": os.getloadavg()[0]},
        "seconds": seconds,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
