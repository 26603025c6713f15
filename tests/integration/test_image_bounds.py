"""Issue #39: a 397-byte request cost the worker 631 MB. A 30000x1 PNG passes the pixel cap, but the demo
LLaVA's CLIP processor resizes the shortest edge to 56, making a 56 x 1,680,000 image. It is refused
(413, naming the bound) before the processor runs, with the process's memory unchanged."""

from __future__ import annotations

import asyncio
import io
import json
import threading

import psutil
import pytest
from PIL import Image

from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ChatService
from tests.conftest import data_url, image_url

MAX_GROWTH = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def service(tiny_model_path):
    engine = Engine(EngineConfig(model_path=str(tiny_model_path), max_new_tokens=2, default_max_tokens=2)).start()
    yield ChatService(engine, "llava")
    engine.stop()


def ask(service: ChatService, url: str):
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}).encode()
    response = asyncio.run(service.invoke({"Content-Type": "application/json"}, body))
    return response.status, response.body


class PeakRss:
    """The process's largest resident set while the block runs, sampled every millisecond."""

    def __enter__(self):
        self.process = psutil.Process()
        self.baseline = self.peak = self.process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


def sliver_png(width: int = 30000) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, 1), (200, 30, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_30000x1_image_is_refused_before_the_processor_with_memory_unchanged(service):
    status, body = ask(service, image_url(1))  # a normal image passes (and warms every lazy allocation)
    assert status == 200, body
    raw = sliver_png()
    assert len(raw) < 1000
    with PeakRss() as rss:
        status, body = ask(service, data_url(raw))
    assert status == 413, body
    assert body["error"]["type"] == "payload_too_large"
    assert body["error"]["message"] == ("image is 30000x1 pixels; this model's image processor would resize it to "
                                        f"94080000 pixels, over the limit of {4096 * 4096} pixels (its aspect ratio "
                                        "is too extreme)")
    assert rss.growth < MAX_GROWTH, f"RSS grew {rss.growth / 2**20:.1f} MiB while refusing"
    status, body = ask(service, image_url(2, size=(300, 3)))  # thin but within the bound: answered
    assert status == 200, body
