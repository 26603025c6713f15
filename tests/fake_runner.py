"""A model runner with the engine's interface and no model: fast, deterministic, and able to fail.

Its KV caches are real paged ``KVCache`` objects (1 layer, 1 head, head_dim 1) that store each position's
token id as its "key", so a test can check that a session's cache holds exactly its transcript. The
next token is a hash of everything in the cache (and the adapter slot): a cache that lost or
duplicated a position, or a turn that was not rolled back, answers differently, as a real model would.
Faults: ``fail["prefill"|"decode"|"encode"] = n`` makes the next n such calls raise; ``fail["oom_prefill"]``
and ``fail["oom_decode"]`` make them run out of device memory instead (``torch.OutOfMemoryError``), and
``fail["fatal_decode"]`` hits an illegal memory access, after which every call fails the same way (a
CUDA error is sticky). ``oom_over_rows`` and ``oom_token`` make decodes run out of memory by shape.
A decode (or verify pass) counts as a decode; it raises after writing its keys and before advancing
the cache lengths, as a real pass that fails part-way would.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import torch

from session.families.registry import FAMILIES
from session.model.backend import Chunk, DecodeRows, ModelInfo, separate_passes
from session.model.kv_cache import KVCache, KVPool


class InjectedFault(RuntimeError):
    pass


ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"
DEVICE_ERROR = getattr(torch, "AcceleratorError", RuntimeError)  # what torch >= 2.8 raises for a failed CUDA call


def injected_oom(what: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected, {what})")


def next_token(context: list[int], vocab_size: int, salt: int = 0) -> int:
    """The fake model: a position-weighted hash of the whole context (and of the adapter's name)."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 + 97 * salt) % vocab_size


def greedy_answer(context: list[int], max_tokens: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                  adapter: str | None = None, image_token_id: int | None = None) -> list[int]:
    """What the engine must answer for a turn whose whole prompt (transcript + new tokens) is ``context``.
    The engine never emits the image placeholder: its one-hot logit is masked, and argmax of the
    remaining zeros is token 0."""
    context, out = list(context), []
    while len(out) < max_tokens:
        token = next_token(context, vocab_size, adapter_salt(adapter))
        token = 0 if token == image_token_id else token
        out.append(token)
        context.append(token)
        if token in eos_token_ids:
            break
    return out


def adapter_salt(name: str | None) -> int:
    return zlib.crc32(name.encode()) if name else 0


@dataclass
class FakeBank:
    slot_names: dict[int, str] = field(default_factory=dict)  # device slot -> adapter loaded there
    dtype: torch.dtype = torch.float32

    def load(self, slot: int, adapter) -> None:
        self.slot_names[slot] = adapter.name


class FakeRunner:
    """A ``ModelBackend`` (session/model/backend.py) whose next token hashes the whole cache."""

    family = FAMILIES["llava"]  # one count per image (num_image_tokens)
    is_multimodal = True
    mrope = False
    merge_size = 1
    decode_attention = "per_row"  # how it decodes, whatever configure_decode is told
    packs_steps = True  # a verify's rows join a step's chunks (its ``step`` then runs them a level at a time)

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], image_token_id: int,
                 num_image_tokens: int = 3, max_positions: int = 4096):
        self.device = torch.device("cpu")
        self.info = ModelInfo(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, hidden_size=1,
                              vocab_size=vocab_size, max_positions=max_positions, eos_token_ids=eos_token_ids,
                              image_token_id=image_token_id, num_image_tokens=num_image_tokens)
        self.fail: dict[str, int] = {"prefill": 0, "decode": 0, "encode": 0, "oom_prefill": 0, "oom_decode": 0,
                                     "fatal_decode": 0}
        self.oom_over_rows: int | None = None  # a decode of more rows than this runs out of memory
        self.oom_token: int | None = None  # a decode with a row whose cache holds it runs out of memory, alone too
        self.device_error: RuntimeError | None = None  # once set (fatal_decode), every call raises it
        self.device_lost_at: float | None = None  # time.monotonic() when device_error was set
        self.num_ooms = 0  # OOMs raised
        self.num_calls = 0  # prefill, decode and extend calls, failed ones too
        self.num_decode_rows = 0
        self.num_steps = 0  # ``step`` calls
        self.bank = FakeBank()
        self.pools: dict[int, KVPool] = {}  # block_tokens -> pool

    def _maybe_fail(self, kind: str) -> None:
        if self.device_error is not None:
            raise self.device_error
        if self.fail[kind] > 0:
            self.fail[kind] -= 1
            raise InjectedFault(f"injected {kind} fault")
        if self.fail.get(f"fatal_{kind}", 0) > 0:
            self.fail[f"fatal_{kind}"] -= 1
            self.device_error, self.device_lost_at = DEVICE_ERROR(ILLEGAL_ADDRESS), time.monotonic()
            raise self.device_error

    def _maybe_oom(self, kind: str, kvs: list[KVCache]) -> None:
        """Called once a pass has written its keys, before it advances the lengths."""
        if self.fail[f"oom_{kind}"] > 0:
            self.fail[f"oom_{kind}"] -= 1
        elif kind != "decode" or not (
                (self.oom_over_rows is not None and len(kvs) > self.oom_over_rows)
                or (self.oom_token is not None and any(self.oom_token in cache_tokens(kv) for kv in kvs))):
            return
        self.num_ooms += 1
        raise injected_oom(f"{kind} of {len(kvs)} rows")

    def new_kv_cache(self, *, block_tokens: int, max_tokens: int, static: bool = False) -> KVCache:
        return self.kv_pool(block_tokens).new_cache(max_tokens)

    def kv_pool(self, block_tokens: int) -> KVPool:
        if block_tokens not in self.pools:
            self.pools[block_tokens] = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64,
                                              device=self.device, block_tokens=block_tokens)
        return self.pools[block_tokens]

    def configure_decode(self, attention: str, batch_buckets: tuple[int, ...] = (), verify_tokens: int = 0,
                         verify_buckets: tuple[int, ...] = ()) -> None:
        pass  # the fake decodes row by row whatever the setting

    def capture_decode_graphs(self, block_tokens: int, max_tokens: int) -> int:
        return 0  # no CUDA graphs

    def enable_lora(self, num_slots: int, max_rank: int):
        return self.bank, {(0, "q_proj"): (1, 1)}

    def encode_images(self, pixels: list[torch.Tensor], sizes=None, grids=None) -> list[torch.Tensor]:
        self._maybe_fail("encode")
        return [torch.zeros(self.info.num_image_tokens, 1) for _ in pixels]

    def embed(self, token_ids: list[int], image_embeds: list[torch.Tensor]) -> torch.Tensor:
        # Image placeholders keep their id: the images' content does not steer the fake model.
        return torch.tensor(token_ids, dtype=torch.float64)[:, None]

    def step(self, chunks: list[Chunk], rows: DecodeRows | None) -> torch.Tensor:
        """A pass per part, each failing as ``prefill`` and ``decode`` do."""
        self.num_steps += 1
        return separate_passes(self, chunks, rows)

    def prefill(self, kv: KVCache, embeds: torch.Tensor, all_logits: bool = False, adapter_slot: int = 0,
                positions: torch.Tensor | None = None):
        self.num_calls += 1
        self._maybe_fail("prefill")
        start, count = kv.length, embeds.shape[0]
        kv.ensure_capacity(start + count)
        kv.write(0, start, embeds.T[:, :, None], embeds.T[:, :, None])
        self._maybe_oom("prefill", [kv])
        kv.length = start + count
        return self._logits(kv, adapter_slot)

    def decode(self, kvs: list[KVCache], token_ids: list[int], adapter_slots: list[int] | None = None,
               position_offsets: list[int] | None = None):
        self.num_calls += 1
        self._maybe_fail("decode")
        slots = adapter_slots or [0] * len(kvs)
        for kv, token in zip(kvs, token_ids):
            kv.ensure_capacity(kv.length + 1)
            value = torch.tensor([[[float(token)]]], dtype=torch.float64)
            kv.write(0, kv.length, value, value)
        self._maybe_oom("decode", kvs)
        for kv in kvs:  # lengths advance only after the whole step, as in the real runner
            kv.length += 1
        rows = [self._logits(kv, slot) for kv, slot in zip(kvs, slots)]
        self.num_decode_rows += len(kvs)
        return torch.stack(rows)

    def extend(self, kvs: list[KVCache], token_rows: list[list[int]], adapter_slots: list[int] | None = None):
        """Speculative verification: row b feeds token_rows[b]; logits [B, T, V] at every fed position
        (a shorter row's padding repeats its last logits). Fails like ``decode``."""
        self.num_calls += 1
        self._maybe_fail("decode")
        slots = adapter_slots or [0] * len(kvs)
        width = max(len(row) for row in token_rows)
        out = []
        for kv, row, slot in zip(kvs, token_rows, slots):
            start = kv.length
            kv.ensure_capacity(start + len(row))
            value = torch.tensor(row, dtype=torch.float64)[None, :, None]
            kv.write(0, start, value, value)
            logits = [self._logits(kv, slot, end=start + i + 1) for i in range(len(row))]
            out.append(torch.stack(logits + logits[-1:] * (width - len(row))))
        self._maybe_oom("decode", kvs)
        for kv, row in zip(kvs, token_rows):
            kv.length += len(row)
        self.num_decode_rows += len(kvs)
        return torch.stack(out)

    def _logits(self, kv: KVCache, adapter_slot: int, end: int | None = None) -> torch.Tensor:
        end = kv.length if end is None else end
        context = [int(x) for x in kv.keys(0, end)[0, :, 0].tolist()]
        logits = torch.zeros(self.info.vocab_size)
        name = self.bank.slot_names.get(adapter_slot) if adapter_slot else None
        logits[next_token(context, self.info.vocab_size, adapter_salt(name))] = 1.0
        return logits


def cache_tokens(kv: KVCache) -> list[int]:
    return [int(x) for x in kv.keys(0, kv.length)[0, :, 0].tolist()]
