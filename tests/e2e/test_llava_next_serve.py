"""`MODEL=<a LLaVA-NeXT checkpoint> make serve`: sessions over real TorchServe with images of any size and
aspect (anyres: a count per image), the prompt and cache accounting following each image's own count."""

from __future__ import annotations

import pytest
import requests

from launch.torchserve import start_torchserve
from model_store.build_llava_next import ensure
from tests.conftest import free_port, image_url, make_image

pytestmark = pytest.mark.e2e

SESSION = "X-Amzn-SageMaker-Session-Id"


def image_message(text: str, *sizes: tuple[int, int]) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": image_url(i + 1, size)}} for i, size in enumerate(sizes)]
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def expected_prompt_tokens(path, conversation: list[dict], sizes) -> int:
    """What LlavaNextProcessor itself expands the conversation to (the same images: same seeds, sizes)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    images = [make_image(i + 1, size) for i, size in enumerate(sizes)] or None
    return processor(text=text, images=images, return_tensors="pt")["input_ids"].shape[1]


def test_llava_next_serves_sessions_with_images_of_any_aspect(tmp_path):
    path = ensure(["mistral"])["mistral"]
    server = start_torchserve(free_port(5), run_dir=tmp_path / "run", model_path=path,
                              stdout=open(tmp_path / "torchserve.log", "w"))
    try:
        server.wait_ready(timeout_s=240)
        url = f"{server.url}/invocations"
        wide, tall, sliver = (400, 90), (60, 300), (700, 3)
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

        bad = requests.post(url, json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, timeout=60)
        assert bad.status_code == 400 and "does not decode" in bad.json()["error"]["message"]
    finally:
        server.stop()
