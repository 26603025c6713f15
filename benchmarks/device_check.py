"""The device check: what the engine does on this machine's accelerator, in one run and one table.

On a CUDA machine it builds, directly on the GPU and with random weights (nothing downloaded, no
weights on disk: only each model's config.json, which ``ModelRunner`` reads), a LLaVA-1.5-7B-shaped
model (Llama-2-7B language model, CLIP ViT-L/14-336 tower) and a 2-layer slice of Llama-3-8B
(grouped-query attention, 8 KV heads), in bfloat16, and runs the project's own pieces on them
(``ModelRunner`` and its decode paths, the KV block pool, CUDA graphs, the memory manager, the LoRA
registry) to report:

- equivalence: the logits of graph replay, eager batched and per-row decode (and the prefill) against
  transformers' own forward recomputed from scratch, at batch 1, 3 and 16, with rows whose lengths
  cross a block boundary during the steps compared (teacher-forced: every path is fed the same
  tokens): the largest relative error and the greedy (argmax) agreement;
- host syncs: CUDA's sync debug mode counts each host synchronization of a decode step (per path)
  and of each part of a turn (image encoding, embedding, a prefill, a verify);
- attention kernels: the kernels torch.profiler saw in a decode step, a prefill and a verify;
- timings (CUDA events): decode at batch 1 and 16, a 600-token first turn with the vision tower, a
  20-token follow-up and a 5-token verify, each beside its floor (the bytes it must read at the
  GPU's memory bandwidth, or its FLOPs at the peak rate where that is larger) and beside transformers
  (``generate`` for decode and for a whole turn, which recomputes the context; a forward over its
  own cache for the verify);
- memory: after loading, after the engine's KV reserve, after capturing every CUDA-graph bucket,
  across a demote to host and restore of a 4k-token session, and across one adapter load, with the
  engine's start-up functions and defaults (session/engine/assembly.py).

``--tiny`` runs the same stages on tiny shapes (seconds, on any device): the CPU smoke that
scripts/device_check.sh runs where there is no CUDA device (graph replay and host syncs are "n/a"
there). Each stage is guarded: one that raises gives a FAIL row with its error, and the others still
run; the exit status is 1 when any row FAILed. docs/DEVICE_CHECK.md explains every row.

Run: python -m benchmarks.device_check [--tiny] [--device auto] [--stages equivalence syncs kernels timings memory]
Out: the table on stdout; benchmarks/results/device_check/device_check.json (``--tiny``: device_check_tiny.json).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import REPO, format_table, median, write_json
from session.model.buckets import power_buckets
from session.model.runner import ModelRunner, resolve_device

OUT = REPO / "benchmarks" / "results" / "device_check"
STAGES = ("equivalence", "packed", "syncs", "kernels", "timings", "memory")


# ---------------------------------------------------------------- shapes

# LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf's config.json): a Llama-2-7B language model, a CLIP ViT-L/14 tower at 336 px
LLAVA_7B_TEXT = dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                     bos_token_id=1, eos_token_id=2, pad_token_id=32001, tie_word_embeddings=False)
CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
# Llama-3-8B's layers (GQA: 32 query heads over 8 KV heads, its 128k vocabulary), two of its 32
LLAMA3_8B_SLICE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)
TINY_TEXT = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                 tie_word_embeddings=False)
TINY_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=56,
                   patch_size=14, projection_dim=64)
TINY_GQA = TINY_TEXT | dict(num_key_value_heads=2)


@dataclass(frozen=True)
class Shapes:
    """One run's models and workload: the GPU's real shapes, or ``--tiny``'s. Token counts are prompts'."""

    llava_name: str
    llava_text: dict  # LlamaConfig fields of LLaVA's language model
    llava_vision: dict  # CLIPVisionConfig fields of its tower
    image_token_id: int
    slice_name: str
    slice_text: dict  # LlamaConfig fields of the GQA model
    block_tokens: int  # KV block size (the engine's default on the GPU)
    first_turn_tokens: int  # the first turn's prompt: bos, the image's tokens, text
    followup_tokens: int
    verify_tokens: int
    session_tokens: int  # the session demoted to host and restored
    adapter_rank: int
    pool_blocks: int  # KV blocks reserved for the stages before the memory stage (so no pool grows in them)
    device_budget_bytes: int  # the memory stage's KV budget on CPU (CUDA: the engine's default, 0.9 of free)
    batches: tuple[int, ...] = (1, 3, 16)  # equivalence
    timed_batches: tuple[int, ...] = (1, 16)  # decode timings
    decode_steps: int = 6  # decode steps compared per row
    repeats: int = 10  # timed runs per measurement (the median is reported), after 2 warm-up runs


GPU_SHAPES = Shapes("llava-1.5-7b", LLAVA_7B_TEXT, CLIP_L_336, 32000, "llama-3-8b-slice", LLAMA3_8B_SLICE,
                    block_tokens=256, first_turn_tokens=600, followup_tokens=20, verify_tokens=5,
                    session_tokens=4000, adapter_rank=16, pool_blocks=160, device_budget_bytes=0)
TINY_SHAPES = Shapes("llava-tiny", TINY_TEXT, TINY_VISION, 2000, "llama-tiny-gqa", TINY_GQA, block_tokens=16,
                     first_turn_tokens=40, followup_tokens=20, verify_tokens=5, session_tokens=400, adapter_rank=4,
                     pool_blocks=160, device_budget_bytes=4 << 20, repeats=3)

# (max relative error of the logits, least greedy agreement) against transformers, by the models' dtype.
# Two float32 implementations agree to the last few bits. Two bfloat16 ones differ by their rounding, and
# random weights leave near-ties among 32k-128k logits that rounding can flip; a wrong path (a stale graph,
# a lost KV block, a shifted position) gives errors near 1 and agreement near 0, so loose limits still
# catch it. The rows print the measured numbers: judge them, not only the verdict.
TOLERANCE = {torch.bfloat16: (1e-1, 0.75), torch.float16: (1e-1, 0.75), torch.float32: (1e-4, 0.99)}


# ---------------------------------------------------------------- the device

# (device-name pattern, memory bandwidth in bytes/s, dense bfloat16 FLOP/s or None), from the vendors'
# data sheets; most specific first. Any other GPU's floor uses a measured device-to-device copy.
KNOWN_GPUS = [
    (r"\bH200\b", 4.8e12, 989e12),
    (r"\bH100 PCIe\b", 2.0e12, 756e12),
    (r"\bH100 NVL\b", 3.9e12, 835e12),
    (r"\bH100\b", 3.35e12, 989e12),
    (r"\bB200\b", 8.0e12, 2.25e15),
    (r"\bA100-SXM4-80GB\b", 2.039e12, 312e12),
    (r"\bA100 80GB PCIe\b", 1.935e12, 312e12),
    (r"\bA100\b", 1.555e12, 312e12),
    (r"\bL40S\b", 0.864e12, 362e12),
    (r"\bL4\b", 0.3e12, 121e12),
    (r"\bA10G\b", 0.6e12, None),
]


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    bandwidth: float  # bytes/s the floors use: the data sheet's, else the measured copy's
    source: str  # "data sheet" or "measured"
    measured: float  # bytes/s of a device-to-device copy measured here
    peak_flops: float | None  # dense bfloat16 FLOP/s, where known


def known_gpu(name: str) -> tuple[float, float | None] | None:
    """(memory bandwidth, dense bfloat16 FLOP/s or None) of the GPU named ``name``, or None if unknown."""
    return next(((bandwidth, flops) for pattern, bandwidth, flops in KNOWN_GPUS if re.search(pattern, name)), None)


def device_facts(device: torch.device, clock: Clock) -> DeviceFacts:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    measured = copy_bandwidth(device, clock, (1 << 30) if device.type == "cuda" else (64 << 20))
    known = known_gpu(name) if device.type == "cuda" else None
    if known is None:
        return DeviceFacts(name, measured, "measured", measured, None)
    return DeviceFacts(name, known[0], "data sheet", measured, known[1])


def copy_bandwidth(device: torch.device, clock: Clock, nbytes: int) -> float:
    """The best bytes/s of 10 copies of an ``nbytes`` buffer on ``device`` (a copy reads and writes each byte)."""
    source = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    return 2 * nbytes / min(clock.time(lambda: target.copy_(source)) for _ in range(10))


class Clock:
    """Seconds a piece of work takes on ``device``: CUDA events there (from the first launch to the end of
    the last kernel, launch gaps included), perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def time(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            torch.cuda.synchronize()  # nothing queued before counts
        start = self.stamp()
        fn()
        return self.between(start, self.stamp())

    def median(self, fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
        """The median of ``repeats`` timed runs of ``fn`` after 2 untimed ones; ``setup`` (untimed) before each."""
        times = []
        for index in range(repeats + 2):
            if setup is not None:
                setup()
            seconds = self.time(fn)
            if index >= 2:
                times.append(seconds)
        return median(times)


# ---------------------------------------------------------------- the report


@dataclass
class Report:
    """The table's rows and the JSON's results. A stage that raises becomes a FAIL row (``stage``)."""

    rows: list[list[str]] = field(default_factory=list)  # [check, result, numbers]
    results: dict[str, dict] = field(default_factory=dict)  # check -> its numbers, as JSON
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds it took

    def add(self, check: str, result: str, numbers: str, **data) -> None:
        self.rows.append([check, result, numbers])
        self.results[check] = {"result": result, "numbers": numbers, **data}

    @contextlib.contextmanager
    def stage(self, name: str):
        """Run the block as stage ``name``: an exception is reported as its FAIL row (the traceback to
        stderr) and the run goes on; device memory is given back either way."""
        began = time.perf_counter()
        try:
            yield
        except Exception as exc:  # every failure is a row, and the next stage still runs
            traceback.print_exc()
            self.add(name, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:240])
        finally:
            self.seconds[name] = time.perf_counter() - began
            free_memory()

    @property
    def failed(self) -> bool:
        return any(row[1] == "FAIL" for row in self.rows)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def require(value, what: str):
    """``value``, or (None or False) a stage failure that says what it needed that did not happen."""
    if value is None or value is False:
        raise RuntimeError(f"not run: {what}")
    return value


# ---------------------------------------------------------------- models


@dataclass
class Context:
    device: torch.device
    dtype: torch.dtype
    shapes: Shapes
    clock: Clock
    facts: DeviceFacts
    workdir: Path  # config.json of each model, the adapter

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def llava_config(shapes: Shapes):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    return LlavaConfig(vision_config=CLIPVisionConfig(**shapes.llava_vision), text_config=LlamaConfig(**shapes.llava_text),
                       image_token_id=shapes.image_token_id, vision_feature_layer=-2,
                       vision_feature_select_strategy="default", projector_hidden_act="gelu")


def slice_config(shapes: Shapes):
    from transformers import LlamaConfig

    return LlamaConfig(**shapes.slice_text)


def build_model(config, device: torch.device, dtype: torch.dtype, seed: int):
    """transformers' own random initialisation, made on ``device`` in ``dtype`` (a 7B model is 14 GB:
    never through host memory or the disk)."""
    import transformers

    cls = transformers.LlavaForConditionalGeneration if config.model_type == "llava" else transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype)
    text = config.text_config if config.model_type == "llava" else config
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id if text.pad_token_id is not None else text.eos_token_id
    return model.eval().requires_grad_(False)


class PrebuiltRunner(ModelRunner):
    """``ModelRunner`` over a model built in this process: it reads the checkpoint's config.json from
    ``path`` as for any checkpoint, and takes the weights from ``model`` instead of the disk."""

    def __init__(self, model, path: str, **kwargs):
        self.prebuilt = model
        super().__init__(path, **kwargs)

    def _load(self, hf_config):
        return self.prebuilt


def checkpoint_dir(ctx: Context, config, name: str) -> Path:
    path = ctx.workdir / name
    config.save_pretrained(path)
    return path


def runner_over(ctx: Context, model, path: Path, reserve: bool = True) -> PrebuiltRunner:
    """A runner as the engine makes one on this device (torch's operators on CPU, not our CPU kernels: the
    operators a GPU runs), with ``pool_blocks`` KV blocks reserved unless the caller reserves (memory stage)."""
    runner = PrebuiltRunner(model, str(path), device=str(ctx.device), dtype=ctx.dtype_name, cpu_kernels=False,
                            pack_weights=False)
    if reserve:
        runner.kv_pool(ctx.shapes.block_tokens).reserve(ctx.shapes.pool_blocks)
    return runner


def build_stage(report: Report, ctx: Context, label: str, config, seed: int):
    """Build one model and its runner: the runner, or None when that failed (its row says why)."""
    with report.stage(f"{label}: build"):
        began = time.perf_counter()
        model = build_model(config, ctx.device, ctx.dtype, seed)
        if ctx.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        runner = runner_over(ctx, model, checkpoint_dir(ctx, config, label))
        params = sum(p.numel() for p in model.parameters())
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        i = runner.info
        report.add(f"{label}: build", "pass",
                   f"{count(params)} parameters, {size(nbytes)} of random {ctx.dtype_name} made on "
                   f"{ctx.device} in {seconds:.1f} s; {i.num_layers} layers, {i.num_heads} heads over "
                   f"{i.num_kv_heads} KV heads", parameters=params, bytes=nbytes, seconds=seconds)
        return runner
    return None


# ---------------------------------------------------------------- workloads


def text_ids(generator: torch.Generator, count: int, runner) -> list[int]:
    """``count`` random text token ids (none of them special, none the image token)."""
    high = runner.info.image_token_id or runner.info.vocab_size
    return torch.randint(3, min(high, runner.info.vocab_size), (count,), generator=generator).tolist()


def prefilled(runner, rows: list[list[int]], block_tokens: int) -> tuple[list, list[torch.Tensor]]:
    """A cache per row with that row's ids prefilled, and each prefill's last logits [V]."""
    kvs, logits = [], []
    for ids in rows:
        kv = runner.new_kv_cache(block_tokens=block_tokens, max_tokens=runner.info.max_positions)
        logits.append(runner.prefill(kv, runner.embed(ids, [])))
        kvs.append(kv)
    return kvs, logits


def release(kvs) -> None:
    for kv in kvs:
        kv.release()


def read_tokens(logits: torch.Tensor) -> list[int]:
    """The greedy tokens of logits [..., V] read on the host, as the engine reads each step's tokens."""
    return logits.argmax(-1).view(-1).tolist()


@dataclass
class Conversation:
    """The timed turns: a first turn with an image, a text follow-up, a speculative verify."""

    pixels: torch.Tensor  # [3, S, S], as the image processor gives them (about unit variance)
    first_ids: list[int]  # bos, the image's placeholder tokens, text
    followup_ids: list[int]
    verify_ids: list[int]


def conversation(runner, shapes: Shapes, seed: int = 0) -> Conversation:
    generator = torch.Generator().manual_seed(seed)
    size = runner.hf_config.vision_config.image_size
    num_image = runner.info.num_image_tokens
    first = [runner.hf_config.text_config.bos_token_id] + [runner.info.image_token_id] * num_image
    first += text_ids(generator, shapes.first_turn_tokens - len(first), runner)
    return Conversation(pixels=torch.randn(3, size, size, generator=generator), first_ids=first,
                        followup_ids=text_ids(generator, shapes.followup_tokens, runner),
                        verify_ids=text_ids(generator, shapes.verify_tokens, runner))


def first_turn(runner, kv, turn: Conversation) -> torch.Tensor:
    """The image through the tower, the prompt's embeddings, its prefill: the first answer token's logits."""
    embeds = runner.encode_images([turn.pixels])
    return runner.prefill(kv, runner.embed(turn.first_ids, embeds))


def decode_paths(ctx: Context) -> tuple[str, ...]:
    """The decode paths this device has: graph replay (CUDA only), eager batched, per row."""
    return ("cuda_graphs", "batched", "per_row") if ctx.cuda else ("batched", "per_row")


PATH_NAMES = {"cuda_graphs": "graphs", "batched": "eager", "per_row": "per-row"}


def serve_path(runner, ctx: Context) -> str:
    """Configure the path the engine serves this device with (RESIDENT_ATTENTION=auto: graph replay on
    CUDA, per row on CPU) for the buckets of the check's largest batch, with the verify graphs of a
    speculating engine (``verify_tokens`` a row); its name."""
    path = "cuda_graphs" if ctx.cuda else "per_row"
    largest = max(ctx.shapes.batches)
    runner.configure_decode(path, power_buckets(largest), ctx.shapes.verify_tokens, power_buckets(min(largest, 16)))
    return path


# ---------------------------------------------------------------- stage: equivalence


def row_lengths(batch: int, block_tokens: int) -> list[int]:
    """Prompt lengths 1-4 tokens short of the end of a row's 1st, 2nd or 3rd block, so that the decode
    steps compared write across a block boundary, each row at its own step."""
    return [block_tokens * (1 + b % 3) - 1 - b % 4 for b in range(batch)]


@torch.inference_mode()
def reference_logits(model, rows: list[list[int]], num_positions: int) -> torch.Tensor:
    """transformers' forward over each whole row, recomputed from scratch: [B, num_positions, V], the
    logits at each row's last ``num_positions`` positions (rows one at a time: no padding)."""
    out = []
    for ids in rows:
        x = torch.tensor([ids], device=model.device)
        out.append(model(input_ids=x, logits_to_keep=num_positions).logits[0].float())
    return torch.stack(out)


def path_logits(runner, path: str, prompts: list[list[int]], forced: list[list[int]], block_tokens: int) -> torch.Tensor:
    """[B, 1 + steps, V]: each row's prefill logits, then those of each decode step on ``path``, teacher-
    forced (step k feeds forced[b][k], so that every path and the reference see the same tokens)."""
    runner.configure_decode(path, power_buckets(len(prompts)))
    kvs, first = prefilled(runner, prompts, block_tokens)
    steps = [torch.stack(first).float()]
    for k in range(len(forced[0])):
        steps.append(runner.decode(kvs, [row[k] for row in forced]).float())
    release(kvs)
    return torch.stack(steps, dim=1)


def compare(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(largest relative error of a position's logits, fraction of positions with the same argmax)."""
    errors = (ours - reference).norm(dim=-1) / reference.norm(dim=-1)
    return errors.max().item(), (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()


def check_equivalence(report: Report, ctx: Context, runner, label: str) -> None:
    max_error, min_agreement = TOLERANCE[runner.dtype]
    steps = ctx.shapes.decode_steps
    for batch in ctx.shapes.batches:
        check = f"{label}: paths vs transformers, batch {batch}"
        with report.stage(check):
            require(runner, f"{label} was not built")
            generator = torch.Generator().manual_seed(batch)
            lengths = row_lengths(batch, ctx.shapes.block_tokens)
            prompts = [text_ids(generator, n, runner) for n in lengths]
            forced = [text_ids(generator, steps, runner) for _ in lengths]
            reference = reference_logits(runner.model, [p + f for p, f in zip(prompts, forced)], steps + 1)
            ours = {path: path_logits(runner, path, prompts, forced, ctx.shapes.block_tokens) for path in decode_paths(ctx)}
            found = {path: compare(logits[:, 1:], reference[:, 1:]) for path, logits in ours.items()}
            found["prefill"] = compare(ours["batched"][:, :1], reference[:, :1])
            numbers = ", ".join(f"{PATH_NAMES.get(p, p)} {e:.1e}/{100 * a:.0f}%" for p, (e, a) in found.items())
            if "cuda_graphs" in ours:
                numbers += f"; graphs vs eager {compare(ours['cuda_graphs'], ours['batched'])[0]:.1e}"
            else:
                numbers += "; graphs n/a (no CUDA)"
            ok = all(e <= max_error and a >= min_agreement for e, a in found.values())
            report.add(check, "pass" if ok else "FAIL",
                       f"rel. error/greedy agreement: {numbers} (rows {min(lengths)}-{max(lengths)} tokens, "
                       f"{steps} steps; limits {max_error:.0e}, {100 * min_agreement:.0f}%)",
                       by_path={p: {"max_rel_error": e, "agreement": a} for p, (e, a) in found.items()},
                       lengths=lengths)


# ---------------------------------------------------------------- stage: packed steps


@dataclass
class PackedSteps:
    """Two engine steps over four caches, packed (RESIDENT_PACKED_STEPS=on) or apart (off): decode rows
    of two sessions beside a follow-up's chunk and a new prompt's first chunk, then a speculative verify
    of both sessions (``verify_tokens`` and 1 tokens) beside the prompt's second chunk."""

    prompts: list[list[int]]  # the two sessions', the follow-up's session's, the new prompt
    followup: list[int]
    verify: list[list[int]]

    @classmethod
    def of(cls, runner, shapes: Shapes) -> PackedSteps:
        generator = torch.Generator().manual_seed(11)
        lengths = row_lengths(3, shapes.block_tokens)
        prompts = [text_ids(generator, n, runner) for n in lengths] + [text_ids(generator, shapes.first_turn_tokens, runner)]
        return cls(prompts, text_ids(generator, shapes.followup_tokens, runner),
                   [text_ids(generator, shapes.verify_tokens, runner), text_ids(generator, 1, runner)])

    def caches(self, runner, block_tokens: int) -> list:
        kvs, _ = prefilled(runner, self.prompts[:3], block_tokens)
        return kvs + [runner.new_kv_cache(block_tokens=block_tokens, max_tokens=runner.info.max_positions)]

    @property
    def half(self) -> int:
        """Where the new prompt's two chunks meet."""
        return len(self.prompts[3]) // 2

    def first(self, runner, kvs) -> torch.Tensor:
        from session.model.backend import Chunk, DecodeRows

        return runner.step([Chunk(kvs[2], runner.embed(self.followup, [])),
                            Chunk(kvs[3], runner.embed(self.prompts[3][:self.half], []))],
                           DecodeRows(kvs[:2], [row[0] for row in self.verify]))

    def second(self, runner, kvs) -> torch.Tensor:
        from session.model.backend import Chunk, DecodeRows

        rows = DecodeRows.verify(kvs[:2], self.verify)
        return runner.step([Chunk(kvs[3], runner.embed(self.prompts[3][self.half:], []))], rows)  # a row a position

    def run(self, runner, mode: str, block_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
        """Both steps' logits [rows + chunks, V] (a verify: a row per position) and the forward passes
        each ran."""
        runner.packed_steps = mode
        kvs = self.caches(runner, block_tokens)
        out, passes = [], []
        for step in (self.first, self.second):
            before = runner.num_passes
            out.append(step(runner, kvs).float())
            passes.append(runner.num_passes - before)
        release(kvs)
        return out, passes


def time_first_step(ctx: Context, runner, steps: PackedSteps, mode: str) -> float:
    """The median seconds of ``steps.first`` under RESIDENT_PACKED_STEPS ``mode``, on fresh caches each
    time (made untimed), its tokens read on the host."""
    runner.packed_steps = mode
    kvs: list = []

    def setup() -> None:
        release(kvs)
        kvs[:] = steps.caches(runner, ctx.shapes.block_tokens)

    seconds = ctx.clock.median(lambda: read_tokens(steps.first(runner, kvs)), ctx.shapes.repeats, setup)
    release(kvs)
    return seconds


def check_packed(report: Report, ctx: Context, runner, label: str) -> None:
    """A packed step's logits against its parts run apart, its passes counted, both timed."""
    from session.model.packed_step import packing_backend

    check = f"{label}: packed step vs apart"
    with report.stage(check):
        require(runner, f"{label} was not built")
        block = ctx.shapes.block_tokens
        backend = packing_backend("on", runner.kv_pool(block))
        steps = PackedSteps.of(runner, ctx.shapes)
        try:
            (packed, packed_passes), (apart, apart_passes) = (steps.run(runner, m, block) for m in ("on", "off"))
            found = [compare(ours, theirs) for ours, theirs in zip(packed, apart)]
            timed = {mode: time_first_step(ctx, runner, steps, mode) for mode in ("on", "off")}
        finally:  # the later stages measure what the engine serves with
            runner.packed_steps = "auto"
        max_error, min_agreement = TOLERANCE[runner.dtype]
        ok = backend is not None and packed_passes == [1, 1] and apart_passes != [1, 1] and all(
            e <= max_error and a >= min_agreement for e, a in found)
        numbers = (f"by {backend or 'no packed plan (a pass per part)'}: passes {packed_passes} vs {apart_passes}; "
                   f"rel. error/greedy agreement: rows and chunks {found[0][0]:.1e}/{100 * found[0][1]:.0f}%, "
                   f"verify and chunk {found[1][0]:.1e}/{100 * found[1][1]:.0f}%; first step {ms(timed['on'])} "
                   f"packed vs {ms(timed['off'])} apart (limits {max_error:.0e}, {100 * min_agreement:.0f}%)")
        report.add(check, "pass" if ok else "FAIL", numbers, backend=backend, passes=packed_passes,
                   apart_passes=apart_passes, errors=[e for e, _ in found], agreement=[a for _, a in found],
                   packed_s=timed["on"], apart_s=timed["off"])


# ---------------------------------------------------------------- stages: host syncs and kernels


def count_syncs(fn: Callable[[], object]) -> int:
    """Host synchronizations ``fn`` makes on CUDA: the sync debug mode warns once for each."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


ATTENTION_KERNEL = re.compile(r"attention|attn|fmha|flash|sdpa|softmax|efficient", re.IGNORECASE)


def attention_kernels(ctx: Context, fn: Callable[[], object]) -> Counter:
    """The attention kernels (on CPU: operators) torch.profiler sees while ``fn`` runs, by short name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if ctx.cuda:
            torch.cuda.synchronize()
    wanted = DeviceType.CUDA if ctx.cuda else DeviceType.CPU
    return Counter(short_name(e.name) for e in prof.events()
                   if e.device_type == wanted and ATTENTION_KERNEL.search(e.name))


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and parameters, at most 60 characters."""
    return re.split(r"[<(]", kernel, maxsplit=1)[0].strip()[:60]


def measured_turn(runner, ctx: Context, measure: Callable[[Callable[[], object]], object]) -> dict[str, object]:
    """``measure(fn)`` of each piece of a conversation, in order, on a fresh cache: the image's encoding,
    the first turn's embedding and prefill, a follow-up prefill and a verify."""
    shapes, turn = ctx.shapes, conversation(runner, ctx.shapes)
    serve_path(runner, ctx)  # the verify's extend runs on it
    kv = runner.new_kv_cache(block_tokens=shapes.block_tokens, max_tokens=runner.info.max_positions)
    out = {"encode image": measure(lambda: runner.encode_images([turn.pixels]))}
    embeds = runner.encode_images([turn.pixels])
    out["embed with image"] = measure(lambda: runner.embed(turn.first_ids, embeds))
    first = runner.embed(turn.first_ids, embeds)
    out[f"prefill {len(turn.first_ids)}"] = measure(lambda: runner.prefill(kv, first))
    out[f"follow-up {len(turn.followup_ids)}"] = measure(lambda: runner.prefill(kv, runner.embed(turn.followup_ids, [])))
    out[f"verify {len(turn.verify_ids)}"] = measure(lambda: runner.extend([kv], [turn.verify_ids]))
    kv.release()
    return out


def measured_decode(runner, ctx: Context, batch: int, measure: Callable[[Callable[[], object]], object]) -> dict:
    """``measure`` of one decode step of ``batch`` rows on each path (after a warm-up step that captures
    the graph it replays)."""
    generator = torch.Generator().manual_seed(batch)
    kvs, _ = prefilled(runner, [text_ids(generator, ctx.shapes.first_turn_tokens, runner) for _ in range(batch)],
                       ctx.shapes.block_tokens)
    out = {}
    for path in decode_paths(ctx):
        runner.configure_decode(path, power_buckets(batch))
        runner.decode(kvs, [7] * batch)
        out[f"decode {PATH_NAMES[path]}"] = measure(lambda: runner.decode(kvs, [7] * batch))
    release(kvs)
    return out


def check_syncs(report: Report, ctx: Context, runner, label: str) -> None:
    check = f"{label}: host syncs"
    with report.stage(check):
        require(runner, f"{label} was not built")
        if not ctx.cuda:
            report.add(check, "n/a", "CUDA's sync debug mode counts them: no CUDA device")
            return
        measured_turn(runner, ctx, lambda fn: fn())  # warm-up: lazy initialisation syncs once, not per step
        counts = measured_turn(runner, ctx, count_syncs)
        counts |= measured_decode(runner, ctx, max(ctx.shapes.timed_batches), count_syncs)
        report.add(check, "info", ", ".join(f"{name}: {n}" for name, n in counts.items())
                   + f" (decode at batch {max(ctx.shapes.timed_batches)})", counts=counts)


def check_kernels(report: Report, ctx: Context, runner, label: str, turn: bool = True) -> None:
    """Rows of the attention kernels seen per piece of work (the batched step's are the graph's)."""
    with report.stage(f"{label}: attention kernels"):
        require(runner, f"{label} was not built")
        from session.model.attention import describe_backend

        report.add(f"{label}: KV pool read by", "info", describe_backend(runner.kv_pool(ctx.shapes.block_tokens),
                                                                         runner.decode_attention))
        measure = lambda fn: attention_kernels(ctx, fn)  # noqa: E731
        seen = measured_decode(runner, ctx, max(ctx.shapes.timed_batches), measure)
        if turn:
            seen |= measured_turn(runner, ctx, measure)
        for name, kernels in seen.items():
            described = ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items()))
            if name == "decode graphs" and not kernels:
                described = "none seen (a replayed graph's kernels are not traced): the eager step's below"
            if not described:  # no attention in it (the embedding)
                continue
            report.add(f"{label}: attention kernels, {name}", "info", described, kernels=dict(kernels))


# ---------------------------------------------------------------- stage: timings


@dataclass(frozen=True)
class Floors:
    """Lower bounds of a piece of work on this device: the bytes it must read at the memory bandwidth
    or, where the peak rate is known and it is larger, its matrix FLOPs at that rate."""

    lm_bytes: int  # the language model's matrices a pass reads: every layer's and the head (an embedding row each)
    lm_params: int
    vision_bytes: int  # the tower's and projector's
    vision_params: int
    image_patches: int  # positions through the tower per image (its CLS included)
    token_kv_bytes: int  # one token's keys and values, every layer
    facts: DeviceFacts

    def seconds(self, *, tokens: int, context: int, rows: int = 1, image: bool = False) -> float:
        """``rows`` rows each feeding ``tokens`` tokens over ``context`` cached ones (and an image)."""
        read = self.lm_bytes + rows * context * self.token_kv_bytes + (self.vision_bytes if image else 0)
        floor = read / self.facts.bandwidth
        if self.facts.peak_flops:
            flops = 2 * rows * tokens * self.lm_params + (2 * self.image_patches * self.vision_params if image else 0)
            floor = max(floor, flops / self.facts.peak_flops)
        return floor


def matrices(*modules) -> tuple[int, int]:
    """(bytes, elements) of the modules' weight matrices (norms and biases are noise beside them)."""
    tensors = [t for m in modules if m is not None for t in (*m.parameters(), *m.buffers()) if t.dim() > 1]
    return sum(t.numel() * t.element_size() for t in tensors), sum(t.numel() for t in tensors)


def floors_of(runner, facts: DeviceFacts) -> Floors:
    lm_bytes, lm_params = matrices(*runner.layers, runner.lm_head)
    inner = runner.model.model
    vision_bytes, vision_params = matrices(getattr(inner, "vision_tower", None), getattr(inner, "multi_modal_projector", None))
    vc = getattr(runner.hf_config, "vision_config", None)
    patches = (vc.image_size // vc.patch_size) ** 2 + 1 if vc is not None else 0
    i = runner.info
    return Floors(lm_bytes, lm_params, vision_bytes, vision_params, patches,
                  2 * i.num_layers * i.num_kv_heads * i.head_dim * runner.kv_dtype.itemsize, facts)


def cache_argument(model) -> str:
    """The name transformers' forward takes its cache by: ``cache`` from 5.2x, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def generate(model, rows: list[list[int]], pixels: torch.Tensor | None, new_tokens: int, streamer=None):
    """transformers' greedy ``generate`` of exactly ``new_tokens`` for ``rows`` (and one image per row)."""
    ids = torch.tensor(rows, device=model.device)
    images = {} if pixels is None else {"pixel_values": pixels.expand(len(rows), -1, -1, -1).to(model.device, model.dtype)}
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                          pad_token_id=model.generation_config.pad_token_id, **images)


class Stamps:
    """transformers' streamer protocol: ``put`` once for the prompt, then once per new token."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.stamps: list = []

    def put(self, value) -> None:
        self.stamps.append(self.clock.stamp())

    def end(self) -> None:
        pass

    def per_token(self) -> float:
        """Seconds per token after the first (the prefill's)."""
        return self.clock.between(self.stamps[1], self.stamps[-1]) / (len(self.stamps) - 2)


def timing_row(report: Report, ctx: Context, check: str, ours: float, floor: float, theirs: float, theirs_is: str,
               path: str) -> None:
    """A timing's row: ours beside its floor and transformers. A time under 0.9x the floor on a GPU means
    the measurement is wrong (not all work was timed): FAIL. Tiny weights fit in caches: no such check."""
    result = "FAIL" if ctx.cuda and ctx.shapes is GPU_SHAPES and ours < 0.9 * floor else "info"
    report.add(check, result, f"ours {ms(ours)} ({path}); floor {ms(floor)} (ours {ours / floor:.1f}x); "
               f"transformers {theirs_is} {ms(theirs)} ({theirs / ours:.1f}x ours)",
               ours_s=ours, floor_s=floor, transformers_s=theirs)


def check_turn_timings(report: Report, ctx: Context, runner, label: str) -> None:
    shapes, clock, model = ctx.shapes, ctx.clock, runner.model
    turn = conversation(runner, shapes)
    floors = floors_of(runner, ctx.facts)
    n_first, n_follow, n_verify = len(turn.first_ids), len(turn.followup_ids), len(turn.verify_ids)
    extend_path = PATH_NAMES[serve_path(runner, ctx)]
    kv = runner.new_kv_cache(block_tokens=shapes.block_tokens, max_tokens=runner.info.max_positions)
    check = f"{label}: first turn, {n_first} tokens with an image"
    with report.stage(check):
        ours = clock.median(lambda: read_tokens(first_turn(runner, kv, turn)), shapes.repeats, setup=kv.release)
        theirs = clock.median(lambda: generate(model, [turn.first_ids], turn.pixels, 1), shapes.repeats)
        timing_row(report, ctx, check, ours, floors.seconds(tokens=n_first, context=n_first, image=True), theirs,
                   "generate 1 token", "encode, embed, prefill, read")
    check = f"{label}: follow-up, {n_follow} tokens after {n_first}"
    with report.stage(check):
        require(kv.length == n_first, "the first turn did not run")
        ours = clock.median(lambda: read_tokens(runner.prefill(kv, runner.embed(turn.followup_ids, []))),
                            shapes.repeats, setup=lambda: kv.crop(n_first))
        theirs = clock.median(lambda: generate(model, [turn.first_ids + turn.followup_ids], turn.pixels, 1), shapes.repeats)
        timing_row(report, ctx, check, ours, floors.seconds(tokens=n_follow, context=n_first + n_follow), theirs,
                   "generate 1 token (recomputes the context)", "prefill the new tokens only")
    context = n_first + n_follow
    check = f"{label}: verify, {n_verify} tokens after {context}"
    with report.stage(check):
        require(kv.length == context, "the follow-up did not run")
        ours = clock.median(lambda: read_tokens(runner.extend([kv], [turn.verify_ids])), shapes.repeats,
                            setup=lambda: kv.crop(context))
        theirs = their_verify(model, turn, clock, shapes.repeats)
        timing_row(report, ctx, check, ours, floors.seconds(tokens=n_verify, context=context + n_verify), theirs,
                   "forward over its cache", f"extend, {extend_path}")
    kv.release()


@torch.inference_mode()
def their_verify(model, turn: Conversation, clock: Clock, repeats: int) -> float:
    """transformers scoring the verify tokens in one forward over its own cache of the turns so far (a
    copy of it per run, made untimed: a forward extends the cache it is given)."""
    ids = torch.tensor([turn.first_ids + turn.followup_ids], device=model.device)
    name = cache_argument(model)
    base = model(input_ids=ids, pixel_values=turn.pixels[None].to(model.device, model.dtype), use_cache=True)
    prefix = base.past_key_values if hasattr(base, "past_key_values") else base.cache
    verify = torch.tensor([turn.verify_ids], device=model.device)
    state = {}
    return clock.median(lambda: read_tokens(model(input_ids=verify, use_cache=True, **{name: state["cache"]}).logits),
                        repeats, setup=lambda: state.update(cache=copy.deepcopy(prefix)))


def decode_step_time(runner, path: str, kvs: list, clock: Clock, repeats: int) -> float:
    """The median seconds of a decode step of ``kvs`` on ``path``, its tokens read on the host."""
    runner.configure_decode(path, power_buckets(len(kvs)))
    return clock.median(lambda: read_tokens(runner.decode(kvs, [7] * len(kvs))), repeats)


def check_decode_timings(report: Report, ctx: Context, runner, label: str) -> None:
    shapes, clock = ctx.shapes, ctx.clock
    floors = floors_of(runner, ctx.facts)
    served = serve_path(runner, ctx)
    for batch in shapes.timed_batches:
        context = shapes.first_turn_tokens
        check = f"{label}: decode, batch {batch}, {context}-token contexts"
        with report.stage(check):
            generator = torch.Generator().manual_seed(batch)
            rows = [text_ids(generator, context, runner) for _ in range(batch)]
            kvs, _ = prefilled(runner, rows, shapes.block_tokens)
            times = {path: decode_step_time(runner, path, kvs, clock, shapes.repeats)
                     for path in dict.fromkeys((served, "batched"))}
            release(kvs)
            stamps = Stamps(clock)
            generate(runner.model, rows, None, 2)  # warm-up
            generate(runner.model, rows, None, shapes.repeats + 2, streamer=stamps)
            others = "; eager " + ms(times["batched"]) if served != "batched" else ""
            timing_row(report, ctx, check, times[served], floors.seconds(tokens=1, context=context, rows=batch),
                       stamps.per_token(), "generate, per token", PATH_NAMES[served] + others)


# ---------------------------------------------------------------- stage: memory


def memory_numbers(ctx: Context, pool=None) -> tuple[str, dict]:
    """(a reading's text, its numbers): device memory (CUDA: allocated, reserved, free) and the KV pool."""
    data = {}
    if ctx.cuda:
        free, _ = torch.cuda.mem_get_info(ctx.device)
        data |= {"allocated": torch.cuda.memory_allocated(ctx.device), "reserved": torch.cuda.memory_reserved(ctx.device),
                 "free": free}
        text = f"allocated {size(data['allocated'])}, reserved {size(data['reserved'])}, free {size(free)}"
    else:
        text = "device memory n/a (CPU)"
    if pool is not None:
        data |= {"pool": 2 * pool.k.numel() * pool.k.element_size(), "pool_blocks": pool.num_blocks,
                 "held": pool.blocks.num_held * pool.block_nbytes}
        text += f"; KV pool {size(data['pool'])} ({pool.num_blocks} blocks), held {size(data['held'])}"
    return text, data


def write_adapter(path: Path, shapes: dict[tuple[int, str], tuple[int, int]], rank: int, dtype: torch.dtype) -> Path:
    """A PEFT LoRA adapter of every target linear at ``rank``, small random A and B (so it changes the logits)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(rank)
    tensors = {}
    for (layer, target), (fan_in, fan_out) in shapes.items():
        parent = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        key = f"base_model.model.model.language_model.layers.{layer}.{parent}.{target}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5).to(dtype)
        tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.01).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = sorted({target for _, target in shapes})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          "target_modules": targets}))
    return path


def timed(ctx: Context, fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of ``fn``, the device's work included."""
    if ctx.cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    result = fn()
    if ctx.cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - began, result


class MemoryCheck:
    """The engine's start-up on the LLaVA model, as ``assemble`` (session/engine/assembly.py) runs it,
    with a reading between its steps, then a session demoted and restored and an adapter loaded.
    Who calls this: ``check_memory``, each method one guarded stage, in order."""

    ADAPTER = "device-check"

    def __init__(self, ctx: Context, model, path: Path, label: str):
        self.ctx, self.model, self.path, self.label = ctx, model, path, label
        self.runner = self.config = self.registry = self.session = self.memory = self.before = None
        self.budget = self.max_context = 0

    def start(self, report: Report) -> None:
        from session.config import EngineConfig
        from session.engine.admin import build_adapter_registry
        from session.engine.assembly import _configure_paged_kv, device_budget, plan_memory
        from session.model.lora import target_shapes

        ctx = self.ctx
        runner = self.runner = runner_over(ctx, self.model, self.path, reserve=False)
        adapters = ctx.workdir / "adapters"
        write_adapter(adapters / self.ADAPTER, target_shapes(runner.layers), ctx.shapes.adapter_rank, ctx.dtype)
        config = self.config = EngineConfig(
            model_path=str(self.path), device=str(ctx.device), dtype=ctx.dtype_name, cpu_kernels=False,
            pack_weights=False, kv_block_tokens=ctx.shapes.block_tokens, adapters_dir=str(adapters),
            device_budget_bytes=0 if ctx.cuda else ctx.shapes.device_budget_bytes)
        config.validate()
        self.reading(report, "loaded")
        # assemble's order: adapters (the bank allocated on a GPU), the budget, the memory plan, the pools
        self.registry = build_adapter_registry(config, runner, None)
        if ctx.cuda and self.registry is not None:
            self.registry.bank.allocate()
        self.max_context = min(config.max_context_tokens or runner.info.max_positions, runner.info.max_positions)
        budget = self.budget = plan_memory(config, [runner], device_budget(config, runner), self.max_context)
        _configure_paged_kv(config, [runner], budget, self.max_context)
        self.reading(report, "after the KV reserve", f"budget {size(budget)}; ")

    def capture(self, report: Report) -> None:
        runner = require(self.runner, "the engine did not start")
        seconds, count = timed(self.ctx, lambda: runner.capture_decode_graphs(self.config.kv_block_tokens,
                                                                              self.max_context))
        self.reading(report, "after capturing every bucket", f"{count} graphs in {seconds:.1f} s; ")

    def demote(self, report: Report) -> None:
        from session.model.kv_cache import PoolAccounts
        from session.state.memory import MemoryManager
        from session.state.session import SessionState, Tier
        from session.state.store import SessionStore

        runner, config = require(self.runner, "the engine did not start"), self.config
        pool = runner.kv_pool(config.kv_block_tokens)
        store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, clock=time.time)
        self.memory = MemoryManager(device_budget_bytes=self.budget, host_budget_bytes=config.host_budget_bytes,
                                    store=store, blocks=PoolAccounts([pool]))
        ids = text_ids(torch.Generator().manual_seed(4), self.ctx.shapes.session_tokens, runner)
        kv = runner.new_kv_cache(block_tokens=config.kv_block_tokens, max_tokens=self.max_context)
        for start in range(0, len(ids), 1024):  # in chunks, as a long prompt is prefilled across steps
            runner.prefill(kv, runner.embed(ids[start:start + 1024], []))
        self.before = self.probe(kv)
        now = time.time()
        self.session = store.open(SessionState(session_id="device-check", kv=kv, created_at=now,
                                               expires_at=now + config.session_ttl_s, tier=Tier.DEVICE,
                                               token_ids=ids, last_used_at=now))
        self.reading(report, f"a {len(ids)}-token session resident")
        seconds, tier = timed(self.ctx, lambda: self.memory.demote(self.session))
        rate = size(self.session.host_bytes / seconds) + "/s" if seconds else ""
        self.reading(report, "demoted", f"to {tier.value} in {ms(seconds)} ({rate}); host "
                     f"{size(self.memory.host_bytes)}; ", ok=tier is Tier.HOST)

    def restore(self, report: Report) -> None:
        from session.state.memory import kv_bytes

        session = require(self.session, "no session was demoted")
        require(session.host_kv, f"the session went to {session.tier.value}, not to host")
        length = session.host_length

        def restore():
            self.memory.reserve(session, kv_bytes(session.kv, length))
            self.memory.restore_from_host(session)

        seconds, _ = timed(self.ctx, restore)
        same = torch.equal(self.probe(session.kv), self.before)
        self.reading(report, "restored from host", f"in {ms(seconds)}; next logits {'the same' if same else 'DIFFER'}; ",
                     ok=same)

    def load_adapter(self, report: Report) -> None:
        registry = require(self.registry, "adapters are off (RESIDENT_MAX_DEVICE_ADAPTERS=0)")
        session = require(self.session, "no session to decode with the adapter")
        seconds, slot = timed(self.ctx, lambda: registry.acquire(self.ADAPTER))
        changed = not torch.equal(self.probe(session.kv, slot), self.before)
        registry.release(self.ADAPTER)
        self.reading(report, f"one adapter load (rank {self.ctx.shapes.adapter_rank})",
                     f"in {ms(seconds)}, LoRA bank {size(registry.bank.nbytes)}; it "
                     f"{'changes' if changed else 'does NOT change'} the logits; ", ok=changed)

    def probe(self, kv, slot: int = 0) -> torch.Tensor:
        """The logits of one decode step from ``kv`` (adapter ``slot``), the step undone after."""
        logits = self.runner.decode([kv], [7], adapter_slots=[slot] if slot else None)
        kv.crop(kv.length - 1)
        return logits

    def reading(self, report: Report, what: str, before: str = "", ok: bool | None = None) -> None:
        pool = self.runner.kv_pools.get(self.config.kv_block_tokens) if self.config is not None else None
        text, data = memory_numbers(self.ctx, pool)
        result = "info" if ok is None else ("pass" if ok else "FAIL")
        report.add(f"{self.label}: memory {what}", result, before + text, **data)


def check_memory(report: Report, ctx: Context, model, path: Path, label: str) -> None:
    check = MemoryCheck(ctx, model, path, label)
    for step in (check.start, check.capture, check.demote, check.restore, check.load_adapter):
        with report.stage(f"{label}: memory, {step.__name__.replace('_', ' ')}"):
            require(model, f"{label} was not built")
            step(report)


# ---------------------------------------------------------------- formatting


def size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms" if seconds < 0.01 else f"{seconds * 1000:.1f} ms"


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.2f} TB/s" if bytes_per_s >= 1e12 else f"{bytes_per_s / 1e9:.1f} GB/s"


def table(rows: list[list[str]]) -> str:
    """The report's table, its numbers column padded to one width: format_table right-aligns every column
    but the first, and sentences read better from the left."""
    width = max([len("numbers"), *(len(row[-1]) for row in rows)])
    text = format_table(["check", "result", "numbers".ljust(width)], [[*row[:-1], row[-1].ljust(width)] for row in rows])
    return "\n".join(line.rstrip() for line in text.splitlines())


# ---------------------------------------------------------------- the run


def run(ctx: Context, stages: set[str]) -> Report:
    """Every stage, in an order that frees memory as it goes: the GQA slice first (then dropped), the LLaVA
    model's checks, and its memory stage last, on a fresh runner that only the model is shared with (the
    memory stage installs LoRA into the model's layers)."""
    import transformers

    report = Report()
    f = ctx.facts
    report.add("device", "info", f"{f.name}; torch {torch.__version__}, transformers {transformers.__version__}; "
               f"{ctx.dtype_name}; floors at {rate(f.bandwidth)} ({f.source}; a copy here: {rate(f.measured)})"
               + (f", {f.peak_flops / 1e12:.0f} TFLOP/s" if f.peak_flops else ""),
               bandwidth=f.bandwidth, measured_bandwidth=f.measured, peak_flops=f.peak_flops)
    shapes = ctx.shapes
    gqa = build_stage(report, ctx, shapes.slice_name, slice_config(shapes), seed=1)
    if "equivalence" in stages:
        check_equivalence(report, ctx, gqa, shapes.slice_name)
    if "packed" in stages:
        check_packed(report, ctx, gqa, shapes.slice_name)
    if "kernels" in stages:
        check_kernels(report, ctx, gqa, shapes.slice_name, turn=False)
    del gqa
    free_memory()
    llava = build_stage(report, ctx, shapes.llava_name, llava_config(shapes), seed=2)
    if "equivalence" in stages:
        check_equivalence(report, ctx, llava, shapes.llava_name)
    if "packed" in stages:
        check_packed(report, ctx, llava, shapes.llava_name)
    if "syncs" in stages:
        check_syncs(report, ctx, llava, shapes.llava_name)
    if "kernels" in stages:
        check_kernels(report, ctx, llava, shapes.llava_name)
    if "timings" in stages and llava is not None:
        check_turn_timings(report, ctx, llava, shapes.llava_name)
        check_decode_timings(report, ctx, llava, shapes.llava_name)
    model, path = (llava.model, Path(llava.model_path)) if llava is not None else (None, None)
    del llava  # its KV pool and graphs: the memory stage measures the engine's own from scratch
    free_memory()
    if "memory" in stages:
        check_memory(report, ctx, model, path, shapes.llava_name)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke; seconds on any device)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on CPU (1: tiny shapes gain nothing from more, and beside a busy core "
                             "a team of 2 runs many times slower: docs/MEASUREMENTS.md, 'Thread count')")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()  # generate's notes on random models' generation configs
    device = resolve_device(args.device)
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clock = Clock(device)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="device-check-") as workdir:
        ctx = Context(device, dtype, shapes, clock, device_facts(device, clock), Path(workdir))
        print(f"device check on {ctx.facts.name} ({device}), {'tiny shapes' if args.tiny else 'real shapes'}, "
              f"{ctx.dtype_name}; stages: {' '.join(args.stages)}", flush=True)
        report = run(ctx, set(args.stages))
    print()
    print(table(report.rows))
    total = time.perf_counter() - began
    slowest = sorted(report.seconds.items(), key=lambda kv: -kv[1])[:3]
    print(f"\n{len(report.rows)} rows, {sum(r[1] == 'FAIL' for r in report.rows)} FAIL, in {total:.0f} s "
          f"(slowest: {', '.join(f'{name} {s:.1f} s' for name, s in slowest)})")
    out = write_json(args.out / ("device_check_tiny.json" if args.tiny else "device_check.json"),
                     {"device": ctx.facts.name, "shapes": "tiny" if args.tiny else "real", "dtype": ctx.dtype_name,
                      "rows": report.rows, "results": report.results, "seconds": report.seconds, "total_s": total})
    print(f"results: {out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
