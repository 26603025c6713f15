"""session/config.py: defaults < model-config.yaml handler section < RESIDENT_* environment."""

from __future__ import annotations

import dataclasses
import os

import pytest

from session.config import EngineConfig
from session.errors import ConfigError


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def build(model_dir, yaml=None, env=None, **kwargs) -> EngineConfig:
    section = {"model_path": model_dir, **(yaml or {})}
    return EngineConfig.from_sources(section, env or {}, **kwargs)


def config_error(model_dir, yaml=None, env=None) -> str:
    with pytest.raises(ConfigError) as info:
        build(model_dir, yaml, env)
    return str(info.value)


def test_defaults(model_dir):
    config = build(model_dir)
    assert dataclasses.asdict(config) == {
        "model_path": model_dir, "device": "auto", "dtype": "auto", "pack_weights": True, "cpu_kernels": True,
        "quantization": "auto", "int4_group": 32, "activations": "float", "kv_dtype": "auto",
        "session_ttl_s": 1200.0,
        "reaper_interval_s": 1.0, "max_sessions": 1024, "max_sessions_per_tenant": 256, "max_context_tokens": 0, "max_new_tokens": 1024,
        "default_max_tokens": 128, "max_batch_size": 256, "step_token_budget": 256, "max_passed_over": 4,
        "max_queue": 256, "kv_block_tokens": 256,
        "attention": "auto", "packed_steps": "auto", "static_kv": False, "compile": False, "compile_backend": "inductor", "max_image_bytes": 6 * 1024 * 1024, "max_image_pixels": 4096 * 4096,
        "max_images_per_request": 4, "max_prompt_chars": 1_000_000, "max_messages": 1024, "max_content_parts": 1024, "max_image_decodes": 2,
            "max_cached_grammars": 256, "max_choices": 8, "served_model_name": "",
            "device_budget_bytes": 0, "device_budget_fraction": 0.0,
        "host_budget_bytes": 2 << 30, "max_embedding_bytes": 1 << 30, "prefix_cache_bytes": 1 << 30,
        "max_session_tokens": 0, "journal_dir": "",
        "journal_max_bytes": 32 << 20, "journal_session_max_bytes": 8 << 20, "journal_tenant_max_bytes": 16 << 20,
            "heartbeat_file": "", "check_invariants": False, "session_id_tag": "", "adapters_dir": "",
        "max_device_adapters": 8, "max_host_adapters": 32, "max_lora_rank": 64, "pinned_adapters": "",
        "admin_token": "", "speculative": "auto", "draft_model_path": "", "num_speculative_tokens": 4,
        "speculative_max_batch": 16, "threads": 0, "max_threads": 0, "seed": 0,
    }


def test_yaml_section_overrides_defaults(model_dir):
    config = build(model_dir, {"session_ttl_s": 60, "max_batch_size": 4, "static_kv": True, "dtype": "float32",
                               "device": "cpu"})
    assert config.session_ttl_s == 60.0 and isinstance(config.session_ttl_s, float)
    assert config.max_batch_size == 4
    assert config.static_kv is True
    assert config.dtype == "float32"
    assert config.device == "cpu"
    assert config.max_sessions == 1024  # untouched


def test_environment_overrides_yaml(model_dir):
    config = build(model_dir, {"max_batch_size": 4, "session_ttl_s": 60},
                   {"RESIDENT_MAX_BATCH_SIZE": "8", "RESIDENT_DEVICE": "cuda:1"})
    assert config.max_batch_size == 8
    assert config.session_ttl_s == 60.0
    assert config.device == "cuda:1"


def test_environment_sets_model_path(model_dir):
    config = EngineConfig.from_sources({"model_path": "/nonexistent"}, {"RESIDENT_MODEL_PATH": model_dir})
    assert config.model_path == model_dir


def test_environment_variables_without_the_prefix_are_ignored(model_dir):
    assert build(model_dir, env={"MAX_BATCH_SIZE": "3", "resident_max_batch_size": "3"}).max_batch_size == 256


def test_os_environ_is_read_when_no_mapping_is_given(model_dir, monkeypatch):
    for name in [n for n in os.environ if n.startswith("RESIDENT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("RESIDENT_MAX_QUEUE", "7")
    assert EngineConfig.from_sources({"model_path": model_dir}).max_queue == 7


def test_env_strings_are_coerced(model_dir):
    config = build(model_dir, env={"RESIDENT_MAX_SESSIONS": " 12 ", "RESIDENT_SESSION_TTL_S": "2.5",
                                   "RESIDENT_REAPER_INTERVAL_S": "3", "RESIDENT_SEED": "-4",
                                   "RESIDENT_STATIC_KV": "true"})
    assert config.max_sessions == 12 and type(config.max_sessions) is int
    assert config.session_ttl_s == 2.5
    assert config.reaper_interval_s == 3.0 and type(config.reaper_interval_s) is float
    assert config.seed == -4
    assert config.static_kv is True


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("off", False),
])
def test_bool_env_strings(model_dir, text, expected):
    assert build(model_dir, env={"RESIDENT_STATIC_KV": text}).static_kv is expected


def test_yaml_bool_is_taken_as_is(model_dir):
    assert build(model_dir, {"static_kv": False}, {}).static_kv is False


def test_relative_model_path_is_resolved_against_base_dir(tmp_path, monkeypatch):
    (tmp_path / "store" / "llava").mkdir(parents=True)
    (tmp_path / "store" / "llava" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)  # "llava" does not exist relative to the working directory
    config = EngineConfig.from_sources({"model_path": "llava"}, {}, base_dir=str(tmp_path / "store"))
    assert config.model_path == str(tmp_path / "store" / "llava")


def test_unknown_yaml_key(model_dir):
    message = config_error(model_dir, {"max_batch": 4})
    assert message.startswith("unknown setting 'max_batch' in model-config.yaml; known: [")
    assert "'max_batch_size'" in message


@pytest.mark.parametrize("yaml, env, message", [
    ({}, {"RESIDENT_MAX_SESSIONS": "many"}, "RESIDENT_MAX_SESSIONS must be int, got 'many'"),
    ({}, {"RESIDENT_MAX_SESSIONS": "1.5"}, "RESIDENT_MAX_SESSIONS must be int, got '1.5'"),
    ({"max_queue": "lots"}, {}, "model-config.yaml max_queue must be int, got 'lots'"),
    ({"max_queue": None}, {}, "model-config.yaml max_queue must be int, got None"),
    ({}, {"RESIDENT_SESSION_TTL_S": "soon"}, "RESIDENT_SESSION_TTL_S must be float, got 'soon'"),
])
def test_bad_numbers(model_dir, yaml, env, message):
    assert config_error(model_dir, yaml, env) == message


@pytest.mark.parametrize("yaml, env, message", [
    ({}, {"RESIDENT_STATIC_KV": "maybe"}, "RESIDENT_STATIC_KV must be true or false, got 'maybe'"),
    ({}, {"RESIDENT_STATIC_KV": ""}, "RESIDENT_STATIC_KV must be true or false, got ''"),
    ({"static_kv": 2}, {}, "model-config.yaml static_kv must be true or false, got 2"),
])
def test_bad_bools(model_dir, yaml, env, message):
    assert config_error(model_dir, yaml, env) == message


@pytest.mark.parametrize("name", ["session_ttl_s", "reaper_interval_s", "max_sessions", "max_new_tokens",
                                  "default_max_tokens", "max_batch_size", "step_token_budget", "max_passed_over",
                                  "max_queue", "kv_block_tokens",
                                  "max_image_bytes", "max_image_pixels", "max_images_per_request"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_non_positive_values(model_dir, name, value):
    message = config_error(model_dir, env={f"RESIDENT_{name.upper()}": value})
    assert message.startswith(f"RESIDENT_{name.upper()} must be > 0, got ")


def test_default_max_tokens_over_max_new_tokens(model_dir):
    message = config_error(model_dir, {"max_new_tokens": 64}, {"RESIDENT_DEFAULT_MAX_TOKENS": "65"})
    assert message == "RESIDENT_DEFAULT_MAX_TOKENS (65) must not exceed RESIDENT_MAX_NEW_TOKENS (64)"


def test_default_max_tokens_equal_to_max_new_tokens_is_fine(model_dir):
    config = build(model_dir, {"max_new_tokens": 64, "default_max_tokens": 64})
    assert (config.default_max_tokens, config.max_new_tokens) == (64, 64)


@pytest.mark.parametrize("dtype", ["fp16", "float64", "FLOAT32", ""])
def test_bad_dtype(model_dir, dtype):
    message = config_error(model_dir, env={"RESIDENT_DTYPE": dtype})
    assert message == f"RESIDENT_DTYPE must be auto, float32, bfloat16 or float16, got {dtype!r}"


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_good_dtypes(model_dir, dtype):
    assert build(model_dir, {"dtype": dtype}).dtype == dtype


def test_model_path_without_config_json(tmp_path):
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_sources({"model_path": str(tmp_path)}, {})
    assert str(info.value).startswith(f"no Hugging Face checkpoint or GGUF file at {str(tmp_path)!r}: set "
                                    "RESIDENT_MODEL_PATH")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("value", [1.5, True])
def test_yaml_non_integer_for_an_int_setting_is_refused(model_dir, value):
    with pytest.raises(ConfigError, match="max_sessions"):
        build(model_dir, {"max_sessions": value})


def test_nan_ttl_is_refused(model_dir):
    with pytest.raises(ConfigError, match="SESSION_TTL_S"):
        build(model_dir, env={"RESIDENT_SESSION_TTL_S": "nan"})


@pytest.mark.parametrize("name", ["max_context_tokens", "threads"])
def test_negative_zero_allowed_settings_are_refused(model_dir, name):
    with pytest.raises(ConfigError, match=f"RESIDENT_{name.upper()}"):
        build(model_dir, env={f"RESIDENT_{name.upper()}": "-5"})


def test_bad_attention(model_dir):
    message = config_error(model_dir, env={"RESIDENT_ATTENTION": "paged"})
    assert message == "RESIDENT_ATTENTION must be auto, batched, per_row or cuda_graphs, got 'paged'"


def test_packed_steps_take_auto_on_or_off(model_dir):
    assert build(model_dir, env={"RESIDENT_PACKED_STEPS": "on"}).packed_steps == "on"
    message = config_error(model_dir, env={"RESIDENT_PACKED_STEPS": "cuda"})
    assert message == "RESIDENT_PACKED_STEPS must be auto, on or off, got 'cuda'"
