"""Builds the engine's parts from the config, once, at start-up (docs/ENGINE.md lists them).

Who calls this: ``Engine.__init__``. Everything that depends on the checkpoint or the device is
decided here: the step implementation (dynamic or static shapes), the tokenizer and image
processor, the device budget, adapters, the speculative decoder.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from session import admin
from session.config import EngineConfig
from session.embeddings import EmbeddingCache
from session.errors import BadRequest, ConfigError
from session.executor import Executor
from session.journal import Journal
from session.memory import MemoryManager
from session.model_runner import ModelRunner
from session.outputs import OutputProcessor
from session.prompt import ChatFormatter
from session.scheduler import Scheduler
from session.sessions import Sessions
from session.store import SessionStore

logger = logging.getLogger(__name__)


@dataclass
class Parts:
    runner: ModelRunner
    stepper: object  # the runner, or its fixed-shape twin (session/static_shapes.py)
    max_context: int
    tokenizer: object
    image_processor: object | None
    formatter: ChatFormatter
    store: SessionStore
    embeddings: EmbeddingCache
    memory: MemoryManager
    journal: Journal | None
    adapters: object | None  # AdapterRegistry
    speculator: object | None  # SpeculativeDecoder
    sessions: Sessions
    scheduler: Scheduler
    executor: Executor
    outputs: OutputProcessor


def assemble(config: EngineConfig, runner: ModelRunner | None = None, clock=None) -> Parts:
    import time

    runner = runner or ModelRunner.from_config(config)
    # One intra-op thread on CPU unless told otherwise: measured on 2-core machines shared with the
    # frontend and clients, OpenMP threads that wait for a busy core made decoding up to 8x slower.
    if config.threads > 0 or runner.device.type == "cpu":
        torch.set_num_threads(config.threads or 1)
    info = runner.info
    max_context = min(config.max_context_tokens or info.max_positions, info.max_positions)
    tokenizer, image_processor = _load_processing(config.model_path, runner.is_multimodal)
    formatter = ChatFormatter(
        tokenizer, image_token=getattr(tokenizer, "image_token", None) if info.image_token_id else None,
        image_token_id=info.image_token_id, num_image_tokens=info.num_image_tokens, eos_token_ids=info.eos_token_ids)
    store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, clock=clock or time.time)
    embeddings = EmbeddingCache()
    budget = device_budget(config, runner)
    memory = MemoryManager(device_budget_bytes=budget, host_budget_bytes=config.host_budget_bytes, store=store)
    journal = Journal(config.journal_dir, config.journal_max_bytes) if config.journal_dir else None
    adapters = admin.build_adapter_registry(config, runner, journal)
    speculator = _speculator(config, runner, tokenizer)
    if not config.static_kv:
        _configure_paged_kv(config, [runner] + ([speculator.draft] if speculator and speculator.draft else []),
                            budget, max_context)

    def new_kv():
        return runner.new_kv_cache(block_tokens=config.kv_block_tokens, max_tokens=max_context,
                                   static=config.static_kv)

    def new_draft_kv():
        if speculator is None:
            return None
        return speculator.new_draft_kv(block_tokens=config.kv_block_tokens, max_tokens=max_context)

    def draft_text_tokens(token_ids: list[int]) -> int:
        """Tokens the (text-only) draft holds for a transcript: the image placeholders are left out."""
        return len(token_ids) - info.count_images(token_ids) * info.num_image_tokens

    def pixels_from_bytes(raw: bytes) -> torch.Tensor:
        from session.images import decode_bytes

        return preprocess_images(image_processor, [decode_bytes(raw, max_pixels=config.max_image_pixels)])[0]

    sessions = Sessions(store=store, memory=memory, embeddings=embeddings, journal=journal, runner=runner,
                        pixels_from_bytes=pixels_from_bytes, new_kv=new_kv, new_draft_kv=new_draft_kv,
                        draft_text_tokens=draft_text_tokens)
    stepper = _stepper(config, runner, max_context)
    executor = Executor(runner=runner, stepper=stepper, formatter=formatter, sessions=sessions, adapters=adapters,
                        speculator=speculator, config=config, max_context=max_context, pixel_digests=pixel_digests)
    return Parts(runner=runner, stepper=stepper, max_context=max_context, tokenizer=tokenizer,
                 image_processor=image_processor, formatter=formatter, store=store, embeddings=embeddings,
                 memory=memory, journal=journal, adapters=adapters, speculator=speculator, sessions=sessions,
                 scheduler=Scheduler(max_batch_size=config.max_batch_size), executor=executor,
                 outputs=OutputProcessor(tokenizer, info.eos_token_ids))


def preprocess_images(image_processor, images: list) -> torch.Tensor | None:
    """PIL images -> pixel_values [N, 3, H, W] (CPU work, no model)."""
    if not images:
        return None
    if image_processor is None:
        raise BadRequest("this model is text-only; remove the image_url parts")
    return image_processor(images=images, return_tensors="pt")["pixel_values"]


def pixel_digests(pixel_values: torch.Tensor | None) -> list[str]:
    """Content keys for images given only as pixels (tests, benchmarks): hash the pixel bytes."""
    if pixel_values is None:
        return []
    return ["px-" + hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest() for p in pixel_values.cpu()]


def _stepper(config: EngineConfig, runner: ModelRunner, max_context: int):
    if not config.static_kv:
        return runner
    if any(w is not None for w in getattr(runner, "windows", ())):
        raise ConfigError("RESIDENT_STATIC_KV does not implement sliding-window attention yet; this model has "
                          "sliding-window layers: leave RESIDENT_STATIC_KV off")
    from session.static_shapes import DEFAULT_BATCH_BUCKETS, StaticShapeRunner

    size = config.max_batch_size
    buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < size) + (size,)
    return StaticShapeRunner(runner, max_context, batch_buckets=buckets, compile=config.compile,
                             compile_backend=config.compile_backend)


def _configure_paged_kv(config: EngineConfig, runners: list[ModelRunner], budget: int, max_context: int) -> None:
    """Decode attention per RESIDENT_ATTENTION, and the KV block pools reserved from the device budget
    (target and draft in proportion to their bytes per token; no more than max_sessions full contexts),
    so that a pool does not grow, and never copies itself, while sessions stay within the budget."""
    from session.decode_graphs import power_buckets

    for runner in runners:
        runner.configure_decode(config.attention, power_buckets(config.max_batch_size))
    if budget <= 0:
        return
    pools = [runner.kv_pool(config.kv_block_tokens) for runner in runners]
    token_nbytes = sum(pool.token_nbytes for pool in pools)
    most_blocks = config.max_sessions * -(-max_context // config.kv_block_tokens)
    for pool in pools:
        share = budget * pool.token_nbytes // token_nbytes
        pool.reserve(1 + min(share // pool.block_nbytes, most_blocks))  # + the padding block


def _speculator(config: EngineConfig, runner: ModelRunner, tokenizer):
    """A SpeculativeDecoder per RESIDENT_SPECULATIVE, or None. A draft with another vocabulary is
    refused here, at start-up (ConfigError)."""
    mode = config.speculative if config.speculative != "auto" else ("draft" if config.draft_model_path else "off")
    if mode == "off":
        return None
    from session.speculative import SpeculativeDecoder, check_compatible

    draft = None
    if mode == "draft":
        draft = ModelRunner(config.draft_model_path, device=config.device, dtype=config.dtype)
        from transformers import AutoTokenizer

        check_compatible(tokenizer, AutoTokenizer.from_pretrained(config.draft_model_path))
    logger.info("speculative decoding: %s, up to %d tokens per step", mode, config.num_speculative_tokens)
    return SpeculativeDecoder(runner, draft)


DEFAULT_CUDA_BUDGET_FRACTION = 0.9  # of the memory free after loading, when no budget is configured


def device_budget(config: EngineConfig, runner) -> int:
    """The device bytes sessions' KV may hold. On CUDA never unlimited: a full GPU must demote
    sessions, not fail with an out-of-memory error (0.9 of what is free after loading, by default)."""
    fraction = config.device_budget_fraction
    if fraction <= 0 and (config.device_budget_bytes or runner.device.type != "cuda"):
        return config.device_budget_bytes
    if runner.device.type != "cuda":
        raise ConfigError("RESIDENT_DEVICE_BUDGET_FRACTION needs a CUDA device; on CPU set "
                          "RESIDENT_DEVICE_BUDGET_BYTES")
    free, _ = torch.cuda.mem_get_info(runner.device)
    return int(free * (fraction if fraction > 0 else DEFAULT_CUDA_BUDGET_FRACTION))


def _load_processing(model_path: str, multimodal: bool):
    """The tokenizer and (for LLaVA) the image processor shipped with the checkpoint."""
    from transformers import AutoProcessor, AutoTokenizer

    if multimodal:
        processor = AutoProcessor.from_pretrained(model_path)
        return processor.tokenizer, processor.image_processor
    return AutoTokenizer.from_pretrained(model_path), None
