"""Checkpoints the engine cannot serve are refused from config.json alone, naming the feature; and
`make serve` / `make cluster` exit at once with that message instead of a worker crash loop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from transformers import AutoConfig, LlamaConfig, LlavaConfig, MistralConfig, Qwen2Config

from session.families.support import UnsupportedModel, check_checkpoint, check_supported
from tests.conftest import REPO, free_port


@pytest.mark.parametrize("config", [LlamaConfig(), MistralConfig(), MistralConfig(sliding_window=None), Qwen2Config(),
                                    Qwen2Config(use_sliding_window=True), AutoConfig.for_model("qwen3"),
                                    LlavaConfig(), LlavaConfig(text_config={"model_type": "mistral"}),
                                    AutoConfig.for_model("llava_next"),
                                    AutoConfig.for_model("llava_next", text_config={"model_type": "mistral"}),
                                    AutoConfig.for_model("qwen2_vl"), AutoConfig.for_model("qwen2_5_vl")],
                         ids=lambda c: c.model_type)
def test_supported_configs_pass(config):
    check_supported(config)


@pytest.mark.parametrize("config,feature", [
    (AutoConfig.for_model("llava_next", vision_feature_select_strategy="full"),
     "vision_feature_select_strategy 'full' is not supported for llava_next (default)"),
    (AutoConfig.for_model("llava_next", vision_config={"model_type": "siglip_vision_model"}),
     "vision tower 'siglip_vision_model'"),
    (AutoConfig.for_model("qwen2_vl", text_config={"use_sliding_window": True}), "sliding-window layers"),
    (AutoConfig.for_model("qwen2_5_vl", text_config={"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}),
     "rope_type 'yarn' is not supported with M-RoPE"),
    (AutoConfig.for_model("mllama"), "cross-attention"),
    (AutoConfig.for_model("gpt2"), "model type 'gpt2' is not supported"),
    (AutoConfig.for_model("gemma2"), "sliding-window layers and logit soft-capping"),
    (LlavaConfig(vision_config={"model_type": "siglip_vision_model"}), "vision tower 'siglip_vision_model'"),
    (LlavaConfig(vision_feature_layer=[-2, -5]), "features from several layers"),
    (LlavaConfig(text_config={"model_type": "gemma"}), "its language model type 'gemma' is not supported"),
], ids=lambda x: x if isinstance(x, str) else x.model_type)
def test_unsupported_features_are_named(config, feature):
    with pytest.raises(UnsupportedModel) as caught:
        check_supported(config)
    assert feature in str(caught.value)


def _checkpoint(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("target", ["serve", "cluster"])
def test_launchers_exit_at_once_naming_the_feature(tmp_path, target):
    model = _checkpoint(tmp_path, AutoConfig.for_model("mllama"))
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "launch", target], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "MODEL": model, "PORT": str(free_port(20)), "BACKENDS": "1"},
                          timeout=120)
    assert done.returncode == 2
    assert "model type 'mllama' is not supported yet (Llama 3.2 Vision: cross-attention" in done.stderr
    assert time.monotonic() - began < 60  # not the 900 s start-up timeout


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(Exception) as caught:
        check_checkpoint(tmp_path)
    assert "no config.json" in str(caught.value)
