"""The device side of LoRA: slots of stacked adapter weights, and the linears that add their deltas.

``LoraBank`` holds device slots of stacked LoRA weights for every target linear of the language
model; slot 0 is the base model (no adapter). ``LoRALinear`` wraps a base linear and, for each
batch adds ``(x @ A^T) @ B^T`` (B pre-scaled by alpha / r) per row's adapter: one forward pass
serves a batch that mixes adapters, with no per-row weight copies (see ``LoraBank.set_rows``).

Who calls this: ``ModelRunner.enable_lora`` once at start-up (``target_shapes``, ``install_lora``),
the runner before each forward (``LoraBank.set_rows``, ``slot_rows``), and ``AdapterRegistry``
(session/model/lora.py) when it loads an adapter into a slot; the engine loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from session.model.lora_weights import TARGETS, AdapterWeights
from session.model.quantize import QuantizedLinear

# the base linears LoRA wraps: float ones, and weight-only quantized ones (RESIDENT_QUANTIZATION), whose
# product comes back in the float dtype the deltas are added in
BASE_LINEARS = (nn.Linear, QuantizedLinear)


class LoraBank:
    """Device slots of LoRA weights, stored transposed for ``x @ A^T @ B^T``. Slot 0 is the base model."""

    def __init__(self, shapes: dict[tuple[int, str], tuple[int, int]], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_rank = max_rank
        self.shapes, self.num_slots = shapes, num_slots
        # (layer, target) -> A^T [slots, in, r_max], B^T [slots, r_max, out]; allocated when the first
        # adapter is loaded, so a server that never uses an adapter holds no device memory for them.
        self.at: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        self.ranks = [0] * (num_slots + 1)  # slot -> its adapter's rank: only that much is computed
        self.dtype, self.device = dtype, device
        self.single: tuple[int, int] | None = None  # this forward: (slot, rank) shared by every row
        # this forward: (adapters present, row mask [B, 1, R] of 1s and 0s, its 0s as a bool [B, 1, R])
        self.mixed: tuple[tuple[tuple[int, int], ...], torch.Tensor, torch.Tensor] | None = None
        self._cat_cache: dict = {}  # ((layer, target), adapters present) -> (A^T cat, B^T cat)
        self.version = 0  # bumped by every load: a slot's weights changed
        # CPU: our kernel for decode rows' deltas (csrc/lora.h; the runner sets it where the library
        # builds), (y [N, out], x [N, in], A^T, B^T, mask [N, R] or None) -> None, y updated in place
        self.kernel: Callable[..., None] | None = None
        self.rows: torch.Tensor | None = None  # a CUDA graph's forward: each row's slot [B] (``slot_rows``)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.at.values(), *self.bt.values()))

    def allocate(self) -> None:
        """Allocate the bank's factors now (else at the first adapter load); once. On an accelerator the
        engine calls this at start-up, before it measures the memory left for KV (session/engine/assembly.py)."""
        if self.at:
            return
        slots, rank, dtype, device = self.num_slots + 1, self.max_rank, self.dtype, self.device
        self.at = {k: torch.zeros(slots, fin, rank, dtype=dtype, device=device) for k, (fin, _) in self.shapes.items()}
        self.bt = {k: torch.zeros(slots, rank, fout, dtype=dtype, device=device) for k, (_, fout) in self.shapes.items()}

    def load(self, slot: int, adapter: AdapterWeights) -> None:
        if not self.at:
            self.allocate()
        for key in self.at:
            self.at[key][slot].zero_()
            self.bt[key][slot].zero_()
        for key, (a, b) in adapter.weights.items():
            self.at[key][slot, :, : adapter.rank].copy_(a.T)
            self.bt[key][slot, : adapter.rank].copy_(b.T)
        self.ranks[slot] = adapter.rank
        self._cat_cache.clear()  # concatenations that included this slot are stale
        self.version += 1

    def set_rows(self, slots: list[int] | None) -> None:
        """Before a forward: the adapter slot of each batch row (None or all zero: the base model).

        One adapter for every row: a plain low-rank update. Several: every row is multiplied by the
        concatenated A of all adapters present, a mask keeps each row's own adapter's columns, and
        one product with the concatenated B adds the deltas (3 kernels per linear, whatever the mix;
        the concatenations are cached per mix, as a decode batch keeps its mix for many steps).
        The mask selects, it does not multiply: another adapter's columns of a row may overflow to
        Inf, and Inf * 0 is NaN (the weights themselves are finite: ``load_adapter``).
        """
        self.single = None
        self.mixed = None
        if not slots or not any(slots):
            return
        if all(s == slots[0] for s in slots):
            self.single = (slots[0], self.ranks[slots[0]])
            return
        present = tuple((slot, self.ranks[slot]) for slot in sorted(set(slots)) if slot != 0)
        offsets, start = {}, 0
        for slot, rank in present:
            offsets[slot] = (start, start + rank)
            start += rank
        mask = torch.zeros(len(slots), 1, start, dtype=self.dtype, device=self.device)  # [B, 1, R]
        for row, slot in enumerate(slots):
            if slot:
                mask[row, :, offsets[slot][0]: offsets[slot][1]] = 1
        self.mixed = (present, mask, mask == 0)

    @contextmanager
    def slot_rows(self, slots: torch.Tensor):
        """Within: each row's adapter slot is the device tensor ``slots`` [B], and every adapted linear
        adds row b's product with slot slots[b]'s factors, gathered from the bank (``LoRALinear``):
        nothing about the mix is host state, so a CUDA graph captured this way serves any mix
        (session/model/cuda_graphs.py). Slot 0 holds zeros: a base row adds 0. Needs the bank allocated."""
        if not self.at:
            raise RuntimeError("the LoRA bank is not allocated: allocate() it before capturing graphs with adapters")
        mix = self.single, self.mixed
        self.rows, self.single, self.mixed = slots, None, None
        try:
            yield
        finally:
            self.rows = None
            self.single, self.mixed = mix  # the eager step's mix, as set_rows left it

    def slot_delta(self, key: tuple[int, str], x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x [B, T, in] -> each row's LoRA delta [B, T, out] from its slot in ``rows`` [B] (``slot_rows``).
        Few rows gather their own slots' factors (a copy of one slot's per row); more read every slot's
        once, the cheaper past half as many rows as slots: each row keeps its own slot's product (a
        select, as in ``set_rows``) and the slots' deltas are summed (the others add exact zeros)."""
        at, bt = self.at[key], self.bt[key]
        if 2 * rows.shape[0] < at.shape[0]:
            return torch.bmm(torch.bmm(x, at.index_select(0, rows)), bt.index_select(0, rows))
        batch, num_new, fan_in = x.shape
        h = torch.matmul(x.reshape(1, batch * num_new, fan_in), at)  # [S, B*T, R]
        own = torch.arange(at.shape[0], device=rows.device)[:, None] == rows.repeat_interleave(num_new)[None, :]
        h = h.masked_fill_(~own[..., None], 0)
        return torch.matmul(h, bt).sum(0).view(batch, num_new, -1)

    def factors(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's A^T [in, R] and B^T [R, out] for one linear: its one adapter's (``single``),
        or the mix's side by side (``concatenated``). Only while the forward has adapter rows."""
        if self.single is not None:
            slot, rank = self.single
            return self.at[key][slot, :, :rank], self.bt[key][slot, :rank]
        if self.mixed is None:
            raise RuntimeError("LoraBank.factors: this forward has no adapter rows (set_rows)")
        return self.concatenated(key, self.mixed[0])

    @property
    def row_mask(self) -> torch.Tensor | None:
        """This forward's mix's row mask [B, 1, R] (``mixed``; our kernels select on it), or None."""
        return self.mixed[1] if self.mixed is not None else None

    def concatenated(self, key: tuple[int, str], present: tuple[tuple[int, int], ...]):
        """A^T of the adapters present side by side [in, R], and their B^T stacked [R, out] (cached)."""
        cached = self._cat_cache.get((key, present))
        if cached is None:
            if len(self._cat_cache) > 4096:
                self._cat_cache.clear()
            cached = (torch.cat([self.at[key][slot, :, :rank] for slot, rank in present], dim=1),
                      torch.cat([self.bt[key][slot, :rank] for slot, rank in present], dim=0))
            self._cat_cache[(key, present)] = cached
        return cached


class LoRALinear(nn.Module):
    """A base linear plus the LoRA deltas of the current batch's adapters (see ``LoraBank``)."""

    def __init__(self, base: nn.Linear | QuantizedLinear, bank: LoraBank, key: tuple[int, str]):
        super().__init__()
        self.base = base
        self.bank = bank
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, in] -> y: [B, T, out]; y is fresh from the base linear, so it is updated in place.
        y = self.base(x)
        bank = self.bank
        rows = bank.rows
        if rows is not None:  # each row's own slot, a device tensor (``slot_rows``)
            return y.add_(bank.slot_delta(self.key, x, rows))
        mixed = bank.mixed  # several adapters: (present, row mask [B, 1, R], its 0s); None: one or none
        if bank.single is None and mixed is None:
            return y
        a, b = bank.factors(self.key)  # [in, R], [R, out]
        if bank.kernel is not None and x.shape[-2] == 1 and not torch.compiler.is_compiling():
            # decode rows (one token each), eager: the kernel the C++ decode layer calls, so both give these
            # bits (a compiled graph, RESIDENT_COMPILE, traces ATen's products below). The row mask keeps
            # each row's own adapter's columns.
            bank.kernel(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]).contiguous(), a, b,
                        None if mixed is None else mixed[1].view(-1, mixed[1].shape[-1]))
        elif mixed is None:
            y.view(-1, y.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]) @ a, b)
        else:
            h = (x @ a).masked_fill_(mixed[2], 0)  # [B, T, R]; a select (see ``LoraBank.set_rows``)
            y.view(-1, y.shape[-1]).addmm_(h.view(-1, h.shape[-1]), b)
        return y


def install_lora(layers, bank: LoraBank) -> None:
    """Wrap every target linear of the language model's layers (at start-up). A linear an earlier bank
    wrapped (a runner a second engine starts on) moves to this bank: nested, the first bank's linear
    would still add the deltas of the mix it last held, whatever this bank's rows."""
    for index, layer in enumerate(layers):
        for parent in (layer.self_attn, layer.mlp):
            for target in TARGETS:
                base = getattr(parent, target, None)
                if isinstance(base, LoRALinear):
                    base = base.base
                if isinstance(base, BASE_LINEARS):
                    setattr(parent, target, LoRALinear(base, bank, (index, target)))


def target_shapes(layers) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, target) -> (in_features, out_features) of the base linears."""
    out = {}
    for index, layer in enumerate(layers):
        for parent in (layer.self_attn, layer.mlp):
            for target in TARGETS:
                module = getattr(parent, target, None)
                base = module.base if isinstance(module, LoRALinear) else module
                if isinstance(base, BASE_LINEARS):
                    out[(index, target)] = (base.in_features, base.out_features)
    return out
