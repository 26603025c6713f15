"""`MODEL=<a LLaVA-NeXT or Qwen2.5-VL checkpoint> make serve`: sessions over real TorchServe with images of
any size and aspect (anyres tiling; dynamic resolution with M-RoPE), the prompt and cache accounting
following each image's own count."""

from __future__ import annotations

import pytest
import requests

from launch.torchserve import start_torchserve
from model_store import build_llava_next, build_qwen_vl
from tests.conftest import free_port, image_url, make_image

pytestmark = pytest.mark.e2e

SESSION = "X-Amzn-SageMaker-Session-Id"


def image_message(text: str, *sizes: tuple[int, int]) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": image_url(i + 1, size)}} for i, size in enumerate(sizes)]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def checkpoint(family: str):
    if family == "qwen2_5_vl":
        return build_qwen_vl.ensure([family])[family]
    return build_llava_next.ensure(["mistral"])["mistral"]


def expected_prompt_tokens(path, conversation: list[dict], sizes) -> int:
    """What the checkpoint's own processor expands the conversation to (the same images: seeds, sizes)."""
    from transformers import AutoProcessor

    from session.families.qwen_vl import load_processor

    processor = load_processor(path) if "qwen" in path.name else AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    images = [make_image(i + 1, size) for i, size in enumerate(sizes)] or None
    return processor(text=text, images=images, return_tensors="pt")["input_ids"].shape[1]


@pytest.mark.parametrize("family", ["llava_next", "qwen2_5_vl"])
def test_a_vlm_family_serves_sessions_with_images_of_any_aspect(family, tmp_path):
    path = checkpoint(family)
    server = start_torchserve(free_port(5), run_dir=tmp_path / "run", model_path=path,
                              stdout=open(tmp_path / "torchserve.log", "w"))
    try:
        server.wait_ready(timeout_s=240)
        url = f"{server.url}/invocations"
        # A 700 x 3 sliver: LLaVA-NeXT keeps 0 feature rows of it; Qwen-VL refuses aspect ratios over 200.
        wide, tall, sliver = (400, 90), (60, 300), (700, 3) if family == "llava_next" else (700, 5)
        opened = requests.post(url, json={"messages": [image_message("Describe it.", wide)], "max_tokens": 8},
                               headers={SESSION: "NEW_SESSION"}, timeout=120)
        assert opened.status_code == 200, opened.text
        session = opened.headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
        assert opened.json()["usage"]["prompt_tokens"] == expected_prompt_tokens(path, first, [wide])

        # A follow-up with two more images of other aspects (one a 700 x 3 sliver): only the new tokens run.
        follow = requests.post(url, json={"messages": [image_message("And these?", tall, sliver)], "max_tokens": 8},
                               headers={SESSION: session}, timeout=120)
        assert follow.status_code == 200, follow.text
        usage = follow.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= opened.json()["usage"]["prompt_tokens"]
        alone = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "x"}]}]
        two_counts = expected_prompt_tokens(path, alone, [tall, sliver]) - expected_prompt_tokens(
            path, [{"role": "user", "content": [{"type": "text", "text": "x"}]}], [])
        assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] > two_counts

        text_only = requests.post(url, json={"messages": [{"role": "user", "content": "Which is larger?"}],
                                             "max_tokens": 8}, headers={SESSION: session}, timeout=120)
        assert text_only.status_code == 200, text_only.text
        assert text_only.json()["usage"]["prompt_tokens"] > usage["prompt_tokens"]

        if family == "qwen2_5_vl":
            refused = requests.post(url, json={"messages": [image_message("x", (700, 3))]}, timeout=60)
            # refused from the header before the processor runs (it would refuse it too, later, as a 400)
            assert refused.status_code == 413
            assert refused.json()["error"]["message"] == ("image is 700x3 pixels, an aspect ratio over 200:1, "
                                                          "the most this model's image processor takes")
        bad = requests.post(url, json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, timeout=60)
        assert bad.status_code == 400 and "does not decode" in bad.json()["error"]["message"]
    finally:
        server.stop()
