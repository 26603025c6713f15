"""Builds the engine's parts from the config, once, at start-up (docs/ENGINE.md lists them).

Who calls this: ``Engine.__init__``. Everything that depends on the checkpoint or the device is
decided here: the step implementation (dynamic or static shapes), the tokenizer and image
processor, the device budget, adapters, the speculative decoder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from session.checkpoints import Checkpoint, require
from session.config import EngineConfig
from session.engine import admin
from session.engine.executor import Executor
from session.engine.outputs import OutputProcessor
from session.engine.prompt import ChatFormatter
from session.engine.scheduler import Scheduler
from session.errors import BadRequest, ConfigError
from session.families.vision import NO_IMAGES, ImagePreprocessor, Images
from session.model.attention import describe_backend
from session.model.backend import ModelBackend, Stepper
from session.model.blocks import blocks_for
from session.model.kv_cache import PagedKVCache, PoolAccounts
from session.model.runner import ModelRunner, select_device
from session.state.embeddings import EmbeddingCache
from session.state.journal import Journal
from session.state.memory import MemoryManager
from session.state.sessions import Sessions
from session.state.store import SessionStore

if TYPE_CHECKING:
    from transformers import BaseImageProcessor, PreTrainedTokenizerBase

    from session.model.kv_cache import KVCache
    from session.model.lora import AdapterRegistry
    from session.speculative.decoder import SpeculativeDecoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parts:
    """The engine's parts, built once by ``assemble``; the engine and its stats read them."""

    runner: ModelBackend
    stepper: Stepper  # the runner, or its fixed-shape twin (session/model/static_shapes.py)
    max_context: int
    tokenizer: PreTrainedTokenizerBase
    image_processor: BaseImageProcessor | None
    vision: ImagePreprocessor | None  # PIL images -> Images (pixels, sizes, token counts); None: text-only
    formatter: ChatFormatter
    store: SessionStore
    embeddings: EmbeddingCache
    memory: MemoryManager
    journal: Journal | None
    adapters: AdapterRegistry | None
    speculator: SpeculativeDecoder | None
    sessions: Sessions
    scheduler: Scheduler
    executor: Executor
    outputs: OutputProcessor


def assemble(config: EngineConfig, runner: ModelRunner | None = None, clock=None) -> Parts:
    import time

    runner = runner or ModelRunner.from_config(config)
    select_device(runner.device)  # a runner built elsewhere (a benchmark's) was made on another thread
    thread_tuner = _thread_tuner(config, runner)
    info = runner.info
    max_context = min(config.max_context_tokens or info.max_positions, info.max_positions)
    tokenizer, image_processor = _load_processing(require(config.model_path), runner)
    vision = ImagePreprocessor.for_runner(runner, image_processor, config.max_image_pixels) if image_processor is not None else None
    if vision is not None:  # what one image may cost the KV budget (anyres, dynamic resolution: up to this)
        logger.info("images: up to %d tokens each", vision.max_tokens_per_image)
    formatter = ChatFormatter(
        tokenizer, image_token=getattr(tokenizer, "image_token", None) if info.image_token_id else None,
        image_token_id=info.image_token_id, eos_token_ids=info.eos_token_ids)
    store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, clock=clock or time.time,
                         max_per_tenant=config.max_sessions_per_tenant)
    embeddings = EmbeddingCache(max_bytes=config.max_embedding_bytes)
    journal = Journal(config.journal_dir, config.journal_max_bytes, config.journal_session_max_bytes,
                      config.journal_tenant_max_bytes) if config.journal_dir else None
    adapters = admin.build_adapter_registry(config, runner, journal)
    speculator = _speculator(config, runner, tokenizer)
    if adapters is not None and runner.device.type != "cpu":
        adapters.bank.allocate()  # its bytes now (2.9 GB on a 7B at 9 slots x rank 64), not at the first adapter
    budget = device_budget(config, runner)  # what is free once every model and the LoRA bank have loaded
    blocks = None
    if not config.static_kv:
        paged = [runner] + ([speculator.draft] if speculator and speculator.draft else [])
        budget = plan_memory(config, paged, budget, max_context)  # less what the steps themselves take
        _configure_paged_kv(config, paged, budget, max_context, speculating=speculator is not None)
        for each in paged:  # CUDA graphs: all at start-up, after the pools are reserved (none mid-serving)
            each.capture_decode_graphs(config.kv_block_tokens, max_context)
        blocks = PoolAccounts([each.kv_pool(config.kv_block_tokens) for each in paged])
        logger.info("attention: %s decode; the KV pool read by %s", runner.decode_attention,
                    describe_backend(runner.kv_pool(config.kv_block_tokens), runner.decode_attention))
    memory = MemoryManager(device_budget_bytes=budget, host_budget_bytes=config.host_budget_bytes, store=store,
                           blocks=blocks)
    share_block_tokens = config.kv_block_tokens if blocks is not None and config.prefix_cache_bytes else 0
    if speculator is not None:
        speculator.share_block_tokens = share_block_tokens  # the draft's pool shares its text's blocks too

    def images_from_bytes(raw: bytes) -> Images:
        from session.families.image_decode import decode_bytes

        return preprocess_images(vision, [decode_bytes(raw, max_pixels=config.max_image_pixels)])

    caches = SessionCaches(runner, speculator, config.kv_block_tokens, max_context, config.static_kv)
    sessions = Sessions(store=store, memory=memory, embeddings=embeddings, journal=journal, runner=runner,
                        caches=caches, images_from_bytes=images_from_bytes, share_block_tokens=share_block_tokens,
                        prefix_salt=admin.prefix_salt(adapters))
    stepper = _stepper(config, runner, max_context)
    executor = Executor(runner=runner, stepper=stepper, formatter=formatter, sessions=sessions, adapters=adapters,
                        speculator=speculator, config=config, max_context=max_context, thread_tuner=thread_tuner)
    return Parts(runner=runner, stepper=stepper, max_context=max_context, tokenizer=tokenizer,
                 image_processor=image_processor, vision=vision, formatter=formatter, store=store, embeddings=embeddings,
                 memory=memory, journal=journal, adapters=adapters, speculator=speculator, sessions=sessions,
                 scheduler=Scheduler(max_batch_size=config.max_batch_size, token_budget=config.step_token_budget,
                                     kv=executor, max_passed_over=config.max_passed_over), executor=executor,
                 outputs=OutputProcessor(tokenizer, info.eos_token_ids, sessions))


@dataclass(frozen=True)
class SessionCaches:
    """``Sessions``' CacheMaker: caches sized for this engine, from the runner and the speculator."""

    runner: ModelBackend
    speculator: SpeculativeDecoder | None
    block_tokens: int
    max_context: int
    static: bool

    def new_kv(self) -> KVCache:
        return self.runner.new_kv_cache(block_tokens=self.block_tokens, max_tokens=self.max_context,
                                        static=self.static)

    def new_draft_kv(self) -> KVCache | None:
        if self.speculator is None:
            return None
        return self.speculator.new_draft_kv(block_tokens=self.block_tokens, max_tokens=self.max_context)

    def draft_text_tokens(self, token_ids: list[int]) -> int:
        image_id = self.runner.info.image_token_id
        return len(token_ids) - (token_ids.count(image_id) if image_id is not None else 0)


def preprocess_images(vision: ImagePreprocessor | None, images: list) -> Images:
    """PIL images -> Images (CPU work, no model)."""
    if not images:
        return NO_IMAGES
    if vision is None:
        raise BadRequest("this model is text-only; remove the image_url parts")
    return vision.preprocess(images)


def _thread_tuner(config: EngineConfig, runner: ModelRunner):
    """RESIDENT_THREADS=N: N intra-op threads. 0 (auto): on CPU the count is measured while serving
    (session/model/threads.py: two threads win on a quiet machine, one when a core is busy elsewhere), but
    fixed at 1 for compiled graphs (dynamo guards on it); on CUDA torch's default."""
    if config.threads > 0 or (config.compile and runner.device.type == "cpu"):
        # torch.compile guards on the thread count: every change would recompile each graph
        torch.set_num_threads(config.threads or 1)
        return None
    if runner.device.type != "cpu":
        return None
    from session.model.cpu_load import BusyElsewhere
    from session.model.threads import ThreadTuner, cpu_candidates

    load = BusyElsewhere.for_this_process()
    return ThreadTuner(cpu_candidates(config.max_threads), free_cores=None if load is None else load.free_cores)


def _stepper(config: EngineConfig, runner: ModelRunner, max_context: int):
    if not config.static_kv:
        return runner
    if runner.mrope:
        raise ConfigError("RESIDENT_STATIC_KV does not implement M-RoPE (Qwen2-VL / Qwen2.5-VL) yet: leave it off")
    if any(w is not None for w in getattr(runner, "windows", ())):
        raise ConfigError("RESIDENT_STATIC_KV does not implement sliding-window attention yet; this model has "
                          "sliding-window layers: leave RESIDENT_STATIC_KV off")
    from session.model.buckets import power_buckets
    from session.model.static_shapes import StaticShapeRunner

    stepper = StaticShapeRunner(runner, max_context, batch_buckets=power_buckets(config.max_batch_size),
                                compile=config.compile, compile_backend=config.compile_backend,
                                max_prompt_tokens=config.step_token_budget)
    if config.compile:  # every bucket now, largest first: serving never compiles
        logger.info("compiled %d fixed-shape graphs (%s) at start-up", stepper.compile_all(), config.compile_backend)
    return stepper


def _configure_paged_kv(config: EngineConfig, runners: list[ModelRunner], budget: int, max_context: int,
                        speculating: bool = False) -> None:
    """Decode attention per RESIDENT_ATTENTION, and the KV block pools reserved from the device budget
    (target and draft in proportion to their bytes per token; no more than max_sessions full contexts),
    so that a pool does not grow, and never copies itself, while sessions stay within the budget.
    Speculating, CUDA graphs also hold the target's verify (the most proposals and the last token a
    row) and the draft's catch-up (two tokens a row after a step that accepted every proposal), for
    the batches a speculative step can have (RESIDENT_SPECULATIVE_MAX_BATCH)."""
    from session.model.buckets import power_buckets

    verify_buckets = power_buckets(min(config.max_batch_size, config.speculative_max_batch))
    for index, runner in enumerate(runners):
        verify_tokens = 0 if not speculating else (config.num_speculative_tokens + 1 if index == 0 else 2)
        runner.configure_decode(config.attention, power_buckets(config.max_batch_size), verify_tokens, verify_buckets)
        runner.packed_steps = config.packed_steps
    pools = [runner.kv_pool(config.kv_block_tokens) for runner in runners]
    for pool in pools:  # idle shared blocks: at most prefix_cache_bytes (the budget may evict them sooner)
        pool.blocks.prefix.max_idle_blocks = config.prefix_cache_bytes // pool.block_nbytes
    if budget <= 0:
        return
    token_nbytes = sum(pool.token_nbytes for pool in pools)
    most_blocks = config.max_sessions * blocks_for(max_context, config.kv_block_tokens)
    for pool in pools:
        share = budget * pool.token_nbytes // token_nbytes
        pool.reserve(1 + min(share // pool.block_nbytes, most_blocks))  # + the padding block
        pool.blocks.fixed = True  # full: idle shared blocks are evicted, the pool never grows


def _speculator(config: EngineConfig, runner: ModelRunner, tokenizer):
    """A SpeculativeDecoder per RESIDENT_SPECULATIVE, or None. A draft with another vocabulary is
    refused here, at start-up (ConfigError)."""
    mode = config.speculative if config.speculative != "auto" else ("draft" if config.draft_model_path else "off")
    if mode == "off":
        return None
    if runner.mrope:
        raise ConfigError("speculative decoding does not implement M-RoPE (Qwen2-VL / Qwen2.5-VL) yet: "
                          "set RESIDENT_SPECULATIVE=off")
    from session.speculative.decoder import SpeculativeDecoder, check_compatible

    draft = None
    if mode == "draft":
        draft = ModelRunner(config.draft_model_path, device=config.device, dtype=config.dtype,
                            pack_weights=config.pack_weights and not config.compile, cpu_kernels=config.cpu_kernels,
                            quantization=config.quantization,  # the draft's weights as the target's
                            activations=config.activations, int4_group=config.int4_group)
        from transformers import AutoTokenizer

        check_compatible(tokenizer, AutoTokenizer.from_pretrained(draft.checkpoint.folder, **draft.checkpoint.kwargs))
    logger.info("speculative decoding: %s, up to %d tokens per step", mode, config.num_speculative_tokens)
    return SpeculativeDecoder(runner, draft)


DEFAULT_CUDA_BUDGET_FRACTION = 0.9  # of the memory free after loading, when no budget is configured


def plan_memory(config: EngineConfig, runners: list[ModelRunner], budget: int, max_context: int) -> int:
    """The KV budget once the steps' own memory is set aside: on CUDA, where the budget is a fraction of
    the free memory (not RESIDENT_DEVICE_BUDGET_BYTES), less each runner's measured peak of a worst-case
    step (``step_peak``: eager, and again for the CUDA graphs' pool, which holds as much), and, where
    attention gathers a step's blocks (SDPA, not FlashAttention), the one layer's copy of K and V a
    step can gather: up to the pool's own size over the layers. Elsewhere the budget as it is."""
    if (budget <= 0 or config.device_budget_bytes or runners[0].device.type != "cuda"):
        return budget
    from session.model.attention import choose_backend

    peaks = [step_peak(config, runner, max_context) for runner in runners]
    left = max(0, budget - 2 * sum(peaks))
    gathers = [choose_backend(r.kv_pool(config.kv_block_tokens)) == "sdpa" for r in runners]
    layers = min(r.info.num_layers for r in runners)
    planned = int(left / (1 + 1 / layers)) if any(gathers) else left
    logger.info("memory plan: %s of %s free for KV (steps measured at %s each, eager and in graphs%s)",
                _mib(planned), _mib(budget), " + ".join(_mib(peak) for peak in peaks),
                "; SDPA gathers up to 1/%d of the pool a step" % layers if any(gathers) else "")
    return planned


def step_peak(config: EngineConfig, runner: ModelRunner, max_context: int) -> int:
    """Device bytes one runner's worst step allocates beyond what is held before it, measured on CUDA
    with scratch caches in a throwaway pool (dropped after, the runner's own pool and decode path put
    back): a prefill of RESIDENT_STEP_TOKEN_BUDGET tokens (the most one step feeds) at the end of the
    window where attention gathers the session's keys (SDPA: its copies and masks grow with the
    context; FlashAttention's do not), and a decode of RESIDENT_MAX_BATCH_SIZE rows, each from its own
    peak; the larger. Called before ``_configure_paged_kv`` (no pool reserved, no graph captured)."""
    from session.model.attention import choose_backend

    device, block = runner.device, config.kv_block_tokens
    path, pool = runner.path, runner.kv_pools.pop(block, None)
    tokens = max(1, min(config.step_token_budget or max_context, max_context - 1))
    try:
        runner.configure_decode("batched")  # the eager batched step
        prefill = runner.new_kv_cache(block_tokens=block, max_tokens=max_context)
        decode = runner.new_kv_cache(block_tokens=block, max_tokens=max_context)
        assert isinstance(prefill, PagedKVCache)  # new_kv_cache without static=True
        start = max(0, max_context - 1 - tokens) if choose_backend(prefill.pool) == "sdpa" else 0
        prefill.ensure_capacity(start + tokens)  # the scratch blocks before the measurement: KV, not the step's
        decode.ensure_capacity(1)
        for done in range(0, start, tokens):  # unmeasured: up to the window's end
            runner.prefill(prefill, runner.embed([0] * min(tokens, start - done), []))
        peaks = []
        for step in (lambda: runner.prefill(prefill, runner.embed([0] * tokens, [])),
                     lambda: runner.decode([decode] * config.max_batch_size, [0] * config.max_batch_size)):
            torch.cuda.synchronize(device)
            held = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - held)
    finally:
        runner.kv_pools.pop(block, None)  # the throwaway pool and every scratch block in it
        if pool is not None:
            runner.kv_pools[block] = pool
        runner.path = path
    torch.cuda.empty_cache()
    return max(peaks)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.0f} MiB"


def device_budget(config: EngineConfig, runner) -> int:
    """The device bytes sessions' KV may hold. On CUDA and NeuronCores never unlimited: a full device
    must demote sessions, not fail with an out-of-memory error (0.9 of what is free after loading, by
    default)."""
    fraction = config.device_budget_fraction
    accelerator = runner.device.type in ("cuda", "neuron")
    if fraction <= 0 and (config.device_budget_bytes or not accelerator):
        return config.device_budget_bytes
    if not accelerator:
        raise ConfigError("RESIDENT_DEVICE_BUDGET_FRACTION needs a CUDA device or a NeuronCore; on CPU set "
                          "RESIDENT_DEVICE_BUDGET_BYTES")
    if runner.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runner.device)
    else:  # TorchNeuron answers torch.accelerator's memory functions for its device
        try:
            free, _ = torch.accelerator.get_memory_info(runner.device)
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            raise ConfigError(f"cannot read the NeuronCore's free memory ({error}): set "
                              "RESIDENT_DEVICE_BUDGET_BYTES") from None
    return int(free * (fraction if fraction > 0 else DEFAULT_CUDA_BUDGET_FRACTION))


def _load_processing(checkpoint: Checkpoint, runner):
    """The tokenizer and (for a vision-language model) the image processor shipped with the checkpoint.
    Qwen-VL's processor is built without its video processor (which needs torchvision: session/families/qwen_vl.py)."""
    from transformers import AutoProcessor, AutoTokenizer

    kind = runner.family.processor
    if kind == "qwen_vl":
        from session.families.qwen_vl import load_processor

        processor = load_processor(checkpoint.folder)
        return processor.tokenizer, processor.image_processor
    if kind == "auto":
        processor = AutoProcessor.from_pretrained(checkpoint.folder)
        return processor.tokenizer, processor.image_processor
    return AutoTokenizer.from_pretrained(checkpoint.folder, **checkpoint.kwargs), None  # a GGUF's own tokenizer
