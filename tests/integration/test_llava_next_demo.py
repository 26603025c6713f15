"""The LLaVA-NeXT demo checkpoints are valid llava_next checkpoints (float32, transformers only).

They load with LlavaNextForConditionalGeneration / AutoProcessor; a square, a wide and a tall image
expand to different token counts, equal to session/families/anyres.py's and to the lengths of the model's own
packed image features; and HF ``generate`` runs greedily with an image and agrees with an uncached
greedy loop over ``forward``.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from session.families.anyres import AnyresGeometry, num_image_tokens
from tests.conftest import make_image

# (width, height) as PIL takes them -> image tokens for one <image>, per checkpoint.
EXPECTED_COUNTS = {
    "vicuna": {(56, 56): 36, (200, 50): 68, (50, 200): 76},
    "mistral": {(56, 56): 78, (200, 50): 112, (50, 200): 126},
}
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(EXPECTED_COUNTS))
def demo(request):
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    from model_store.build_llava_next import ensure

    path = ensure([request.param])[request.param]
    model = LlavaNextForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    return request.param, model, AutoProcessor.from_pretrained(str(path))


def prompt_inputs(processor, image: Image.Image):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(images=image, text=prompt, return_tensors="pt")


def test_checkpoint_loads_as_llava_next(demo):
    variant, model, processor = demo
    assert model.config.model_type == "llava_next"
    assert model.config.text_config.model_type == {"vicuna": "llama", "mistral": "mistral"}[variant]
    assert type(processor).__name__ == "LlavaNextProcessor"
    assert type(processor.image_processor).__name__ == "LlavaNextImageProcessorPil"  # no torchvision here
    assert processor.image_token_id == model.config.image_token_id == {"vicuna": 4, "mistral": 32000}[variant]
    assert model.model.image_newline.shape == (model.config.text_config.hidden_size,) == (64,)


def test_chat_template_places_the_image(demo):
    variant, _, processor = demo
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert processor.apply_chat_template(messages, add_generation_prompt=True) == {
        "vicuna": "USER: <image>\nHi ASSISTANT:", "mistral": "[INST] <image>\nHi [/INST]"}[variant]


def test_token_counts_differ_by_aspect_and_match_anyres_and_features(demo):
    variant, model, processor = demo
    geometry = AnyresGeometry.from_hf_config(model.config)
    for (width, height), count in EXPECTED_COUNTS[variant].items():
        inputs = prompt_inputs(processor, make_image(width, (width, height)))
        assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == count
        assert num_image_tokens(height, width, geometry) == count
        with torch.no_grad():  # get_image_features already packs: unpad + image_newline per row
            features = model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
        assert [tuple(f.shape) for f in features] == [(count, 64)]
    assert len(set(EXPECTED_COUNTS[variant].values())) == 3


def greedy_without_cache(model, inputs, steps: int) -> list[int]:
    """Argmax of a full forward over the whole sequence at every step: no KV cache, the image re-encoded."""
    input_ids, tokens = inputs["input_ids"], []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]).logits
        tokens.append(int(logits[0, -1].argmax()))
        input_ids = torch.cat([input_ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens


def test_generate_runs_greedily_with_an_image(demo):
    _, model, processor = demo
    inputs = prompt_inputs(processor, make_image(7, (200, 50)))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    assert out.shape == (1, prompt_len + NEW_TOKENS)
    assert torch.equal(out[0, :prompt_len], inputs["input_ids"][0])
    assert out[0, prompt_len:].tolist() == greedy_without_cache(model, inputs, NEW_TOKENS)


def test_image_changes_the_prediction(demo):
    """Same size, different pixels: the first-step logits differ, so the image really reaches the LM."""
    _, model, processor = demo
    logits = []
    for seed in (1, 2):
        inputs = prompt_inputs(processor, make_image(seed, (200, 50)))
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])
