"""Requests and answers shared by the vision-language family tests (LLaVA-NeXT, Qwen-VL): messages with
image parts, a generation request carrying the images' pixels, bytes and digests, the answer's events."""

from __future__ import annotations

import hashlib

import pytest

from session.config import EngineConfig
from session.engine import Engine, GenerationRequest
from session.engine.events import EventStream, Finished, Started
from session.types import ImagePart, Message, SamplingParams, TextPart
from tests.conftest import png_bytes

MAX_TOKENS = 10  # new tokens per answer in these tests


def started_engine(path: str, **config) -> Engine:
    return Engine(EngineConfig(model_path=path, speculative="off", max_device_adapters=0, **config)).start()


def user(text: str, images: int = 0) -> Message:
    return Message("user", tuple(ImagePart("data:,") for _ in range(images)) + (TextPart(text),))


def request(engine, messages, pil_images, max_tokens: int = MAX_TOKENS, **kwargs) -> GenerationRequest:
    """A turn with these PIL images, preprocessed as the API does, their PNG bytes journaled."""
    raw = [png_bytes(image) for image in pil_images]
    return GenerationRequest(messages=tuple(messages), sampling=SamplingParams(max_tokens=max_tokens),
                             stream=EventStream(), images=engine.preprocess_images(pil_images),
                             image_digests=tuple(hashlib.sha256(r).hexdigest() for r in raw),
                             image_bytes=tuple(raw), **kwargs)


def answer(events) -> tuple[Started, Finished]:
    started = next(e for e in events if isinstance(e, Started))
    if not isinstance(events[-1], Finished):
        pytest.fail(f"the request did not finish: {events[-1]}")
    return started, events[-1]
