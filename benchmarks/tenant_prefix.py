"""The shared-prefix gain within one tenant and across tenants, in one process, one run.

    python -m benchmarks.tenant_prefix [--model models/smollm2-135m-instruct] [--requests 8]

Each request is a long shared system prompt (a product catalogue, ~1,100 tokens) and its own short
question, sent one after another, 1 new token each (so the time is the prompt's). Three cases on one
engine: every request from one tenant (after the first, the prompt's blocks are found in the prefix
cache), every request from its own tenant (the front's ``X-Resident-Tenant``; nothing is shared, as
isolation asks), and one tenant with a ``cache_salt`` per request (the same). Reported: the median
time to answer, the cached prompt tokens, and the ratio to the isolated case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from launch.torchserve import REPO
from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from session.serving.protocol import TENANT_HEADER

CATALOGUE = "You answer questions about this catalogue.\n" + "\n".join(
    f"Item {i}: a {colour} {thing}, size {size}, price {10 + i * 3} euros." for i, (colour, thing, size) in enumerate(
        (c, t, s) for c in ("red", "green", "blue", "black") for t in ("shirt", "scarf", "boot", "hat", "coat")
        for s in ("S", "M", "L")))


def body(i: int, salt: str | None) -> dict:
    request = {"messages": [{"role": "system", "content": CATALOGUE},
                            {"role": "user", "content": f"Question {i}: what does item {i} cost?"}], "max_tokens": 1}
    if salt is not None:
        request["cache_salt"] = salt
    return request


def run_case(service: ChatService, requests: int, tenant_of, salt_of) -> tuple[float, float]:
    """(median seconds, mean cached tokens) over ``requests`` sent one after another."""
    seconds, cached = [], []
    for i in range(requests):
        headers = {TENANT_HEADER: tenant_of(i)}
        started = time.perf_counter()
        response = asyncio.run(service.invoke(headers, json.dumps(body(i, salt_of(i)))))
        seconds.append(time.perf_counter() - started)
        assert response.status == 200, response.body
        cached.append(response.body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return statistics.median(seconds[1:]), statistics.mean(cached[1:])  # the first of each case publishes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model_path=str(args.model), speculative="off")).start()
    try:
        service = ChatService(engine, args.model.name)
        run_case(service, 2, lambda i: "warm-up", lambda i: None)
        cases = {"one tenant": run_case(service, args.requests, lambda i: "acme", lambda i: None),
                 "a tenant each": run_case(service, args.requests, lambda i: f"tenant-{i}", lambda i: None),
                 "one tenant, a cache_salt each": run_case(service, args.requests, lambda i: "globex",
                                                           lambda i: f"user-{i}")}
    finally:
        engine.stop()
    isolated = cases["a tenant each"][0]
    print(f"{args.requests} requests each, a ~1,100-token shared system prompt, 1 new token ({args.model.name})")
    print("| case | median seconds | cached prompt tokens | vs isolated |")
    print("|---|---|---|---|")
    for name, (median_s, cached) in cases.items():
        print(f"| {name} | {median_s:.3f} | {cached:.0f} | {isolated / median_s:.2f}x faster |")


if __name__ == "__main__":
    main()
