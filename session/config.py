"""One typed configuration, built once from model-config.yaml and the environment.

Precedence: defaults < the ``handler:`` section of model-config.yaml < environment
variables named ``RESIDENT_<FIELD>`` (upper case). SageMaker passes settings only as
environment variables, so every field can be set that way. Unknown keys are an error.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from session.checkpoints import locate
from session.errors import ConfigError

ENV_PREFIX = "RESIDENT_"


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = "models/llava-tiny"
    device: str = "auto"  # "auto" -> cuda if available, else cpu; or "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto" -> float32 on cpu, bfloat16 on cuda; or float32/bfloat16/float16
    pack_weights: bool = True  # CPU: the language model's linears prepacked for oneDNN (session/model/cpu/packed_linear.py)
    cpu_kernels: bool = True  # CPU: our kernels (attention, linears, the decode step), built at start-up
    # weight-only: auto (a GGUF file's own, kept packed: session/model/gguf.py; else none), none, int8
    # (per-channel), int4 (groups of int4_group inputs): session/model/quantize.py
    quantization: str = "auto"
    int4_group: int = 32  # int4's input group: 32 (llama.cpp's Q4 blocks), 64 or 128 (fewer scale bytes)
    # what our quantized linears multiply on CPU: float (float32 rows: exact products of the quantized
    # weights) or int8 (rows quantized to int8 per 32 inputs and integer dot products, as llama.cpp
    # multiplies its files: faster, less exact; session/model/cpu/csrc/linear_q8.h)
    activations: str = "float"
    kv_dtype: str = "auto"  # KV cache and attention: "auto" = dtype; or float32 (more precise, twice the KV bytes)
    session_ttl_s: float = 1200.0  # idle sessions expire after this many seconds
    reaper_interval_s: float = 1.0  # how often the engine looks for expired sessions
    max_sessions: int = 1024  # live sessions per worker; opening one more answers 503
    # One tenant's share of them (the front's X-Resident-Tenant): one more answers 429, others unaffected; 0: none
    max_sessions_per_tenant: int = 256
    max_context_tokens: int = 0  # 0 -> the model's max_position_embeddings
    max_new_tokens: int = 1024  # the largest max_tokens a request may ask for
    default_max_tokens: int = 128  # when a request does not say
    max_batch_size: int = 256  # sessions decoding together in one forward pass (more take turns)
    # Tokens one step feeds: a decode row is one, prefills take the rest in chunks (docs/ENGINE.md, "The
    # token-budget step"): smaller stalls decoding streams less behind a long prompt, larger prefills faster.
    step_token_budget: int = 256
    max_passed_over: int = 4  # steps a prompt may wait while later follow-ups prefill before it goes first
    max_queue: int = 256  # waiting requests per worker before 503
    kv_block_tokens: int = 256  # KV blocks of this many tokens (FlashAttention's paged kernel: a multiple of 256)
    attention: str = "auto"  # decode: auto (cuda_graphs on CUDA, per_row on CPU), batched, per_row, cuda_graphs
    # A step's prefill chunks and decode rows in one forward pass (session/model/packed_step.py): auto (on
    # CPU), on (also on CUDA where a paged FlashAttention kernel reads the pool: not yet checked on a GPU),
    # off (a pass per part)
    packed_steps: str = "auto"
    static_kv: bool = False  # fixed-capacity KV + bucketed shapes (session/model/static_shapes.py), as NeuronCores need
    compile: bool = False  # torch.compile the static-shape step functions (needs static_kv)
    compile_backend: str = "inductor"  # its backend: inductor, aot_eager, or neuron (NeuronCores, Neuron SDK)
    max_image_bytes: int = 6 * 1024 * 1024  # encoded image size (SageMaker's payload limit)
    max_image_pixels: int = 4096 * 4096  # decoded width*height; guards decompression bombs
    max_images_per_request: int = 4
    max_prompt_chars: int = 1_000_000  # characters of message text per request; more answers 400 in parsing
    max_messages: int = 1024  # messages per request; more answers 400 in parsing
    max_content_parts: int = 1024  # content parts of all messages together; more answers 400 in parsing
    max_image_decodes: int = 2  # images decoded at once per worker (the rest wait): bounds their memory
    max_cached_grammars: int = 256  # compiled response_format / tool grammars kept, least recently used dropped
    max_choices: int = 8  # the largest ``n`` a request may ask for
    served_model_name: str = ""  # the name clients send as "model"; "" = the checkpoint's folder name
    device_budget_bytes: int = 0  # device bytes for session KV caches; 0 = unlimited on CPU, 0.9 of free on CUDA
    device_budget_fraction: float = 0.0  # CUDA: this fraction of the memory free after loading (wins if > 0)
    host_budget_bytes: int = 2 << 30  # host-memory tier for demoted KV caches; 0 = none (demotion drops)
    # Image embeddings in host memory; past it the least recently used whose image bytes are kept or
    # journaled lose their tensor (re-encoded on their next prefill: session/state/embeddings.py). 0 = no bound.
    max_embedding_bytes: int = 1 << 30
    # Shared KV prefixes (session/model/prefix_cache.py): idle published blocks (finished stateless requests,
    # closed sessions) kept at most this many bytes, inside any device budget; 0 = no sharing at all.
    prefix_cache_bytes: int = 1 << 30
    max_session_tokens: int = 0  # per-session transcript cap; 0 = the context window
    journal_dir: str = ""  # crash-recovery journal (e.g. /dev/shm/resident-journal); "" = off
    journal_max_bytes: int = 32 << 20  # the journal's cap (Docker's /dev/shm is 64 MiB); 0 = none
    # One session's share of the journal: its entry and the images no other journaled session names.
    # A session past it serves on, not crash-recoverable (logged once, journal_write_errors); 0 = none.
    journal_session_max_bytes: int = 8 << 20
    # One tenant's share of the journal (its sessions' entries and the images only they name); past it
    # that tenant's new sessions serve on, not crash-recoverable, and no other tenant's are affected. 0: none.
    journal_tenant_max_bytes: int = 16 << 20
    heartbeat_file: str = ""  # touched by the engine loop (at least every second) for the watchdog; "" = off
    check_invariants: bool = False  # check the engine's invariant after every step (tests, load benchmark)
    session_id_tag: str = ""  # letters/digits appended to every new session id ("<uuid4>-<tag>"): routing
    adapters_dir: str = ""  # PEFT LoRA adapters, one folder each (named by the folder); registered at start-up
    max_device_adapters: int = 8  # adapters resident on the device at once (LRU); 0 disables adapters
    max_host_adapters: int = 32  # loaded adapters kept in host memory behind the device LRU
    max_lora_rank: int = 64
    pinned_adapters: str = ""  # comma-separated names kept on the device
    admin_token: str = ""  # enables adapter admin requests carrying X-Resident-Admin-Token (the front sends it)
    speculative: str = "auto"  # auto (draft if draft_model_path), draft, ngram (prompt lookup), off
    draft_model_path: str = ""  # a small causal LM with the target's tokenizer (speculative decoding)
    num_speculative_tokens: int = 4  # the most proposals per step; adapted to the observed acceptance
    speculative_max_batch: int = 16  # speculate only while at most this many requests decode (batched)
    threads: int = 0  # torch intra-op threads; 0 = auto: measured while serving on CPU (session/model/threads.py), torch's default on CUDA
    max_threads: int = 0  # auto's most threads on CPU (a backend's share of the cores); 0 = every usable core
    seed: int = 0  # default sampling seed when a request gives none

    @classmethod
    def from_sources(
        cls, yaml_section: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
        base_dir: str | None = None,
    ) -> EngineConfig:
        """Called once at start-up by the handler (and by tests) to build the config."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in (yaml_section or {}).items():
            if key not in known:
                raise ConfigError(f"unknown setting {key!r} in model-config.yaml; known: {sorted(known)}")
            values[key] = coerce(known[key].type, raw, f"model-config.yaml {key}")
        env = os.environ if environ is None else environ
        for name, f in known.items():
            env_name = ENV_PREFIX + name.upper()
            if env_name in env:
                values[name] = coerce(f.type, env[env_name], env_name)
        config = cls(**values)
        if base_dir and not Path(config.model_path).is_absolute() and not Path(config.model_path).exists():
            candidate = Path(base_dir) / config.model_path
            if candidate.exists():
                config = dataclasses.replace(config, model_path=str(candidate))
        config.validate()
        return config

    @property
    def model_name(self) -> str:
        """The name clients send as "model" and ``/v1/models`` lists: ``served_model_name``, else the
        checkpoint's folder name (a .gguf file: its name less the suffix), as vLLM names a served path."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model_path.rstrip("/"))
        return path.stem if path.suffix == ".gguf" else path.name

    def validate(self) -> None:
        if not 0.0 <= self.device_budget_fraction <= 1.0:
            raise ConfigError(f"{ENV_PREFIX}DEVICE_BUDGET_FRACTION must be in [0, 1], got {self.device_budget_fraction}")
        for name in ("session_ttl_s", "reaper_interval_s"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be a finite number, got {getattr(self, name)}")
        for name in ("max_context_tokens", "threads", "max_threads", "max_sessions_per_tenant", "device_budget_bytes", "host_budget_bytes",
                     "max_session_tokens", "max_device_adapters", "max_host_adapters", "journal_max_bytes",
                     "journal_session_max_bytes", "journal_tenant_max_bytes", "max_embedding_bytes", "prefix_cache_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be >= 0, got {getattr(self, name)}")
        positive = ["session_ttl_s", "reaper_interval_s", "max_sessions", "max_new_tokens", "default_max_tokens",
                    "max_batch_size", "step_token_budget", "max_passed_over", "max_queue", "kv_block_tokens", "max_image_bytes", "max_image_pixels",
                    "max_images_per_request", "max_prompt_chars", "max_messages", "max_content_parts", "max_image_decodes", "max_lora_rank",
                    "max_cached_grammars", "max_choices",
                    "num_speculative_tokens", "speculative_max_batch"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be > 0, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_new_tokens:
            raise ConfigError(f"{ENV_PREFIX}DEFAULT_MAX_TOKENS ({self.default_max_tokens}) must not exceed "
                              f"{ENV_PREFIX}MAX_NEW_TOKENS ({self.max_new_tokens})")
        if not re.fullmatch(r"[A-Za-z0-9]{0,32}", self.session_id_tag):
            raise ConfigError(f"{ENV_PREFIX}SESSION_ID_TAG must be at most 32 letters and digits, "
                              f"got {self.session_id_tag!r}")
        if self.speculative not in ("auto", "draft", "ngram", "off"):
            raise ConfigError(f"{ENV_PREFIX}SPECULATIVE must be auto, draft, ngram or off, got {self.speculative!r}")
        if self.speculative == "draft" and not self.draft_model_path:
            raise ConfigError(f"{ENV_PREFIX}SPECULATIVE=draft needs {ENV_PREFIX}DRAFT_MODEL_PATH")
        if self.draft_model_path and locate(self.draft_model_path) is None:
            raise ConfigError(f"no draft checkpoint at {self.draft_model_path!r} ({ENV_PREFIX}DRAFT_MODEL_PATH)")
        if self.compile and not self.static_kv:
            raise ConfigError(f"{ENV_PREFIX}COMPILE needs {ENV_PREFIX}STATIC_KV=true (compiled steps have static shapes)")
        if self.attention not in ("auto", "batched", "per_row", "cuda_graphs"):
            raise ConfigError(f"{ENV_PREFIX}ATTENTION must be auto, batched, per_row or cuda_graphs, "
                              f"got {self.attention!r}")
        if self.packed_steps not in ("auto", "on", "off"):
            raise ConfigError(f"{ENV_PREFIX}PACKED_STEPS must be auto, on or off, got {self.packed_steps!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"{ENV_PREFIX}DTYPE must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ConfigError(f"{ENV_PREFIX}QUANTIZATION must be auto, none, int8 or int4, got {self.quantization!r}")
        if self.int4_group not in (32, 64, 128):
            raise ConfigError(f"{ENV_PREFIX}INT4_GROUP must be 32, 64 or 128, got {self.int4_group!r}")
        if self.activations not in ("float", "int8"):
            raise ConfigError(f"{ENV_PREFIX}ACTIVATIONS must be float or int8, got {self.activations!r}")
        if self.kv_dtype not in ("auto", "float32"):
            raise ConfigError(f"{ENV_PREFIX}KV_DTYPE must be auto or float32, got {self.kv_dtype!r}")
        if locate(self.model_path) is None:
            raise ConfigError(f"no Hugging Face checkpoint or GGUF file at {self.model_path!r}: set "
                              f"{ENV_PREFIX}MODEL_PATH (or MODEL for make serve) to a directory with config.json "
                              "or to a .gguf file")


def coerce(kind: type | str, raw: Any, where: str) -> Any:
    """A setting's raw value (an environment string, a YAML scalar) as its field's type (``kind``: the
    dataclass field's type, or its name); a tuple is comma-separated, blanks dropped. A value that is
    not of that type raises ConfigError naming ``where``. Used by EngineConfig and the front's config."""
    if isinstance(kind, str) and kind.startswith("tuple"):
        return tuple(part.strip() for part in str(raw).split(",") if part.strip())
    kind = kind if isinstance(kind, type) else {"str": str, "int": int, "float": float, "bool": bool}[kind]
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {raw!r}")
    if kind is int and (isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer())):
        raise ConfigError(f"{where} must be int, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be {kind.__name__}, got {raw!r}") from None
