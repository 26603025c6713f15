"""A victim tenant's small requests while another tenant attacks the same worker, in one process.

    python -m benchmarks.tenant_abuse [--model models/llava-tiny] [--victim-requests 12]

The invocation service of one engine, called as the front calls it (``X-Resident-Tenant`` set). The
victim (tenant "victim") sends small requests one after another: a 32x32 image and a short question,
4 new tokens. Each attack runs beside it, from tenant "attacker":

- ``parts``: requests of 200,000 one-character content parts (refused 400 over
  RESIDENT_MAX_CONTENT_PARTS; parsed off the event loop);
- ``big images``: 4 at a time, each a 4096x4096 PNG (the decode slots: the attacker holds at most
  its share);
- ``sessions``: opening sessions until refused (429 at its share of RESIDENT_MAX_SESSIONS_PER_TENANT),
  then the victim must still open one.

Reported per phase: the victim's median and worst latency, and what the attacker's requests got.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import image_data_url
from launch.torchserve import REPO
from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from session.serving.protocol import SESSION_HEADER, TENANT_HEADER


def png_url(size: int, seed: int) -> str:
    from PIL import Image

    image = Image.effect_noise((size, size), 40 + seed).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def victim_body(image: str, i: int) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": f"What is in picture {i}?"}]}],
            "max_tokens": 4}


async def victim(service: ChatService, image: str, requests: int, stop: asyncio.Event | None = None) -> list[float]:
    """Seconds per victim request, sent one after another (until ``stop`` once ``requests`` are done)."""
    seconds, i = [], 0
    while i < requests or (stop is not None and not stop.is_set()):
        started = time.perf_counter()
        response = await service.invoke({TENANT_HEADER: "victim"}, json.dumps(victim_body(image, i)))
        assert response.status == 200, response.body
        seconds.append(time.perf_counter() - started)
        i += 1
    return seconds


async def attack_parts(service: ChatService) -> Counter:
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 200_000}]})
    statuses = Counter()
    for _ in range(4):
        statuses[(await service.invoke({TENANT_HEADER: "attacker"}, body)).status] += 1
    return statuses


async def attack_images(service: ChatService, big: str) -> Counter:
    async def one(i: int) -> int:
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}},
                                                          {"type": "text", "text": "describe"}]}], "max_tokens": 1}
        return (await service.invoke({TENANT_HEADER: "attacker"}, json.dumps(body))).status
    return Counter(await asyncio.gather(*(one(i) for i in range(4))))


async def attack_sessions(service: ChatService) -> Counter:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    statuses = Counter()
    while statuses[429] == 0 and sum(statuses.values()) < 2000:
        statuses[(await service.invoke({TENANT_HEADER: "attacker", SESSION_HEADER: "NEW_SESSION"}, body)).status] += 1
    victim_open = await service.invoke({TENANT_HEADER: "victim", SESSION_HEADER: "NEW_SESSION"}, body)
    statuses["victim's NEW_SESSION"] = victim_open.status
    return statuses


async def phase(service: ChatService, image: str, requests: int, attack) -> tuple[list[float], Counter]:
    stop = asyncio.Event()

    async def attacker():
        try:
            return await attack
        finally:
            stop.set()
    seconds, statuses = await asyncio.gather(victim(service, image, requests, stop), attacker())
    return seconds, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "llava-tiny")
    parser.add_argument("--victim-requests", type=int, default=12)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model_path=str(args.model), speculative="off", max_sessions_per_tenant=64)).start()
    small, big = png_url(32, 1), image_data_url(2, size=4096)  # the big one: a few KB of PNG, 50 MB decoded
    try:
        service = ChatService(engine, args.model.name)
        asyncio.run(victim(service, small, 2))  # warm-up
        rows = [("alone", asyncio.run(victim(service, small, args.victim_requests)), Counter())]
        for name, make in (("parts", lambda: attack_parts(service)), ("big images", lambda: attack_images(service, big)),
                           ("sessions", lambda: attack_sessions(service))):
            async def run(make=make):
                return await phase(service, small, args.victim_requests, make())
            seconds, statuses = asyncio.run(run())
            rows.append((name, seconds, statuses))
    finally:
        engine.stop()
    print(f"victim: a 32x32 image + a question, 4 new tokens, one after another ({args.model.name})")
    print("| attack | victim median s | victim worst s | attacker's answers |")
    print("|---|---|---|---|")
    for name, seconds, statuses in rows:
        got = ", ".join(f"{k}: {v}" for k, v in statuses.items()) or "-"
        print(f"| {name} | {statistics.median(seconds):.3f} | {max(seconds):.3f} | {got} |")


if __name__ == "__main__":
    main()
