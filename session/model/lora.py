"""Many LoRA adapters on one base model, chosen per request.

- ``load_adapter`` reads a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
  and checks it: the config's fields and their types, targets, ranks and shapes against the base
  model, finite weights; anything wrong is a 400 (``InvalidAdapter``).
- ``LoraBank`` holds device slots of stacked LoRA weights for every target linear of the language
  model; slot 0 is the base model (no adapter). ``LoRALinear`` wraps a base linear and, for each
  batch adds ``(x @ A^T) @ B^T`` (B pre-scaled by alpha / r) per row's adapter: one forward pass
  serves a batch that mixes adapters, with no per-row weight copies (see ``LoraBank.set_rows``).
- ``AdapterRegistry`` is the bookkeeping: registered names and paths, a device LRU of slots
  (adapters of running requests and pinned ones are never evicted) and a host LRU of loaded
  weights behind it; loaded lazily on first use. Registered at run time only from inside
  RESIDENT_ADAPTERS_DIR.

Who calls this: the engine loop thread (acquire/release around each request, register and
unregister through admin requests). Plain PEFT key names work for LLaVA and plain causal LMs.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from session.errors import AdapterInUse, AdapterNotFound, BadRequest, CapacityExceeded, Forbidden, InvalidAdapter
from session.model.quantize import QuantizedLinear

logger = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the base linears LoRA wraps: float ones, and weight-only quantized ones (RESIDENT_QUANTIZATION), whose
# product comes back in the float dtype the deltas are added in
BASE_LINEARS = (nn.Linear, QuantizedLinear)
_KEY_RE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class AdapterWeights:
    """One adapter's weights in host memory. B is pre-multiplied by the LoRA scale."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A [r, in], B [out, r])

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes; more is not one
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def load_adapter(name: str, path: str | Path, shapes: dict[tuple[int, str], tuple[int, int]],
                 max_rank: int, dtype: torch.dtype = torch.float32) -> AdapterWeights:
    """Read and validate a PEFT LoRA adapter; ``shapes`` maps (layer, target) -> (in, out) of the base.
    Every weight must be finite, also once scaled and in ``dtype`` (the bank's): one NaN or Inf in a
    mixed batch's shared products would reach other rows (``LoRALinear``)."""
    path = Path(path)
    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise InvalidAdapter(f"{path} is not a PEFT adapter directory (needs adapter_config.json and "
                             "adapter_model.safetensors)")
    rank, scale = lora_scale(name, read_config(name, config_path), max_rank)
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(weights_path))
    except Exception as exc:
        raise InvalidAdapter(f"adapter {name!r} cannot be read: {exc}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.search(key)
        if match is None:
            raise InvalidAdapter(f"adapter {name!r} has weight {key!r} for a module we cannot adapt; "
                                 f"supported targets: {list(TARGETS)}")
        layer, target, which = int(match.group(1)), match.group(2), match.group(3)
        if (layer, target) not in shapes:
            raise InvalidAdapter(f"adapter {name!r} targets {target} of layer {layer}, which the base model "
                                 "does not have")
        pair = pairs.setdefault((layer, target), {})
        if which in pair:
            raise InvalidAdapter(f"adapter {name!r} has two lora_{which} weights for {(layer, target)}")
        pair[which] = _finite(name, f"weight {key!r}", tensor, dtype)
    weights = {}
    for key, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise InvalidAdapter(f"adapter {name!r} lacks lora_{'B' if 'A' in pair else 'A'} for {key}")
        fan_in, fan_out = shapes[key]
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise InvalidAdapter(f"adapter {name!r} {key}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the "
                                 f"base ({fan_out} x {fan_in}) at rank {rank}")
        scaled = _finite(name, f"lora_B of {key} scaled by lora_alpha / r = {scale:g}", b * scale, dtype)
        weights[key] = (a.contiguous(), scaled.contiguous())
    if not weights:
        raise InvalidAdapter(f"adapter {name!r} has no LoRA weights")
    return AdapterWeights(name=name, rank=rank, weights=weights)


def read_config(name: str, config_path: Path) -> dict:
    """adapter_config.json as a dict; anything else (too big, not UTF-8, not JSON, not an object) is a 400."""
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            raise InvalidAdapter(f"adapter {name!r}: adapter_config.json is over {MAX_CONFIG_BYTES} bytes")
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise InvalidAdapter(f"adapter {name!r}: adapter_config.json is not UTF-8 JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"adapter {name!r}: adapter_config.json must hold a JSON object, not "
                             f"{_JSON_TYPES.get(type(config), type(config).__name__)}")
    return config


def lora_scale(name: str, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale of B) from a PEFT LoRA config, every field we read checked for its type and range."""
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapter(f"adapter {name!r} is {config.get('peft_type')!r}, only LORA is supported")
    rank = config.get("r")
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise InvalidAdapter(f"adapter {name!r} has rank {rank!r}; supported ranks are 1..{max_rank} "
                             "(an integer 'r')")
    alpha = config.get("lora_alpha", rank)
    if not _finite_number(alpha):
        raise InvalidAdapter(f"adapter {name!r} has lora_alpha {alpha!r}; it must be a finite number")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool) and rslora is not None:
        raise InvalidAdapter(f"adapter {name!r} has use_rslora {rslora!r}; it must be true or false")
    targets = config.get("target_modules")  # PEFT: a list of names, or one regular expression
    if not (targets is None or isinstance(targets, str) or
            (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise InvalidAdapter(f"adapter {name!r} has target_modules {targets!r}; it must be a list of module "
                             "names (or a string)")
    return rank, alpha / (rank ** 0.5 if rslora else rank)


def _finite_number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _finite(name: str, what: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in float32, if it is a floating-point weight whose values are finite in ``dtype`` too."""
    if not tensor.is_floating_point():
        raise InvalidAdapter(f"adapter {name!r}: {what} is {tensor.dtype}; LoRA weights are floating point")
    if not torch.isfinite(tensor).all():
        raise InvalidAdapter(f"adapter {name!r}: {what} has NaN or infinite values")
    weight = tensor.float()
    if not (torch.isfinite(weight).all() and torch.isfinite(weight.to(dtype)).all()):
        raise InvalidAdapter(f"adapter {name!r}: {what} has values too large for float32 or {dtype} "
                             "(RESIDENT_DTYPE)")
    return weight


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
        self.mixed: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._cat_cache: dict = {}  # ((layer, target), adapters present) -> (A^T cat, B^T cat)
        self.version = 0  # bumped by every load: a slot's weights changed
        # CPU: our kernel for decode rows' deltas (csrc/lora.h; the runner sets it where the library
        # builds), (y [N, out], x [N, in], A^T, B^T, mask [N, R] or None) -> None, y updated in place
        self.kernel = None
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

    def slot_delta(self, key: tuple[int, str], x: torch.Tensor) -> torch.Tensor:
        """x [B, T, in] -> each row's LoRA delta [B, T, out] from its slot in ``rows`` (``slot_rows``).
        Few rows gather their own slots' factors (a copy of one slot's per row); more read every slot's
        once, the cheaper past half as many rows as slots: each row keeps its own slot's product (a
        select, as in ``set_rows``) and the slots' deltas are summed (the others add exact zeros)."""
        at, bt, rows = self.at[key], self.bt[key], self.rows
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
        return self.concatenated(key, self.mixed[0])

    @property
    def row_mask(self) -> torch.Tensor | None:
        """This forward's mix's row mask [B, 1, R] (``mixed``; our kernels select on it), or None."""
        return self.mixed[1] if self.mixed is not None else None

    @property
    def row_drop(self) -> torch.Tensor | None:
        """True where ``row_mask`` is 0: the columns of another adapter than the row's [B, 1, R], or None."""
        return self.mixed[2] if self.mixed is not None else None

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
        if bank.rows is not None:  # each row's own slot, a device tensor (``slot_rows``)
            return y.add_(bank.slot_delta(self.key, x))
        if bank.single is None and bank.mixed is None:
            return y
        a, b = bank.factors(self.key)  # [in, R], [R, out]
        mask = bank.row_mask  # [B, 1, R]: each row keeps only its own adapter's columns; None: one adapter
        if bank.kernel is not None and x.shape[-2] == 1 and not torch.compiler.is_compiling():
            # decode rows (one token each), eager: the kernel the C++ decode layer calls, so both give these
            # bits (a compiled graph, RESIDENT_COMPILE, traces ATen's products below)
            bank.kernel(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]).contiguous(), a, b,
                        None if mask is None else mask.view(-1, mask.shape[-1]))
        elif mask is None:
            y.view(-1, y.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]) @ a, b)
        else:
            h = (x @ a).masked_fill_(bank.row_drop, 0)  # [B, T, R]; a select (see ``LoraBank.set_rows``)
            y.view(-1, y.shape[-1]).addmm_(h.view(-1, h.shape[-1]), b)
        return y


def install_lora(layers, bank: LoraBank) -> None:
    """Wrap every target linear of the language model's layers (done once, at start-up)."""
    for index, layer in enumerate(layers):
        for parent in (layer.self_attn, layer.mlp):
            for target in TARGETS:
                base = getattr(parent, target, None)
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


@dataclass
class AdapterInfo:
    name: str
    path: str
    pinned: bool = False
    host: AdapterWeights | None = None  # loaded weights (host tier), or None until first use
    slot: int = 0  # device slot, 0 = not on the device
    num_running: int = 0  # requests using it now: never evicted under them
    uid: int = 0  # this registration's number: a name registered again (other weights) gets another

    @property
    def tier(self) -> str:
        return "device" if self.slot else ("host" if self.host is not None else "disk")


class AdapterRegistry:
    """Registered adapters, a device LRU of bank slots and a host LRU of loaded weights.

    ``register`` (the admin API, and the journal's adapters at start-up) reads a directory the caller
    names, so it takes only one inside ``adapters_dir`` (RESIDENT_ADAPTERS_DIR) once symlinks are
    resolved: what the operator put there. Without an adapters dir nothing registers at run time.
    """

    def __init__(self, bank: LoraBank, shapes: dict[tuple[int, str], tuple[int, int]], *, max_device: int,
                 max_host: int, max_rank: int, adapters_dir: str | Path | None = None):
        self.bank = bank
        self.adapters_dir = Path(adapters_dir).resolve() if adapters_dir else None
        self.shapes = shapes
        self.max_host = max_host
        self.max_rank = max_rank
        self._adapters: dict[str, AdapterInfo] = {}  # name -> info
        self._free_slots = list(range(max_device, 0, -1))
        self._device_lru: OrderedDict[str, None] = OrderedDict()  # names on the device, least recent first
        self._host_lru: OrderedDict[str, None] = OrderedDict()  # names with host weights, least recent first
        self.num_loads_from_disk = 0
        self.num_loads_to_device = 0
        self.num_device_evictions = 0
        self._registrations = 0  # AdapterInfo.uid of the last registration

    def _info(self, name: str, path: str, pinned: bool = False) -> AdapterInfo:
        self._registrations += 1
        info = self._adapters[name] = AdapterInfo(name=name, path=path, pinned=pinned, uid=self._registrations)
        return info

    def cache_key(self, name: str) -> bytes:
        """What keys this adapter's KV blocks apart from any other's, a re-registration's included."""
        return f"adapter:{name}#{self.get(name).uid}".encode()

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def scan(self, directory: str | Path) -> list[str]:
        """Register every adapter directory found under ``directory`` (named by its folder)."""
        found = []
        for path in sorted(Path(directory).iterdir()) if Path(directory).is_dir() else []:
            if (path / "adapter_config.json").is_file() and path.name not in self._adapters:
                if ADAPTER_NAME_RE.fullmatch(path.name):
                    self._info(path.name, str(path))
                    found.append(path.name)
        return found

    def register(self, name: str, src: str, pinned: bool = False) -> AdapterInfo:
        """Register the adapter in ``src`` (see the class) under ``name``, its weights loaded and checked."""
        if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name):
            raise BadRequest(f"adapter name must match {ADAPTER_NAME_RE.pattern}, got {name!r:.200}")
        if name in self._adapters:
            raise AdapterInUse(f"adapter {name!r} is already registered; unregister it first")
        path = self.resolve_src(src)
        weights = self._load(name, path)  # validates before changing anything
        info = self._info(name, str(path), pinned)
        self._keep_on_host(info, weights)
        if pinned:
            self.acquire(name)
            self.release(name)
        return info

    def resolve_src(self, src: str) -> Path:
        """The directory ``src`` names (absolute, or relative to the adapters dir), symlinks resolved.
        Forbidden (403) outside the adapters dir, or with none; asked before whether it exists, so
        that paths outside cannot be probed."""
        root = self.adapters_dir
        if root is None:
            raise Forbidden("adapters register at run time only from inside RESIDENT_ADAPTERS_DIR, which is not "
                            "set on this server: set it, and copy the adapter's directory into it")
        if not isinstance(src, str) or not src or "\0" in src:
            raise BadRequest(f"src must name the adapter's directory inside RESIDENT_ADAPTERS_DIR, got {src!r:.200}")
        message = f"adapter src {src!r:.200} is not inside RESIDENT_ADAPTERS_DIR ({root}); copy the adapter there"
        try:
            if not (root / src).resolve().is_relative_to(root):
                raise Forbidden(message)
            path = (root / src).resolve(strict=True)
        except (OSError, RuntimeError):  # missing, unreadable, or a symlink loop
            raise InvalidAdapter(f"adapter src {src!r:.200} does not exist in RESIDENT_ADAPTERS_DIR ({root})") from None
        if not path.is_relative_to(root):  # a symlink made between the two looks
            raise Forbidden(message)
        return path

    def unregister(self, name: str, num_sessions: int, dry_run: bool = False) -> None:
        """Refused (409) while live sessions are bound to it or requests run with it."""
        info = self.get(name)
        if num_sessions or info.num_running:
            raise AdapterInUse(f"adapter {name!r} is used by {num_sessions} live session(s) and "
                               f"{info.num_running} running request(s); close them first")
        if dry_run:
            return
        self._evict_from_device(info)
        self._host_lru.pop(name, None)
        del self._adapters[name]

    def get(self, name: str) -> AdapterInfo:
        info = self._adapters.get(name)
        if info is None:
            raise AdapterNotFound(f"adapter {name!r} is not registered; GET /adapters lists them")
        return info

    def list(self) -> list[dict]:
        return [{"name": i.name, "src": i.path, "tier": i.tier, "pinned": i.pinned, "running": i.num_running}
                for i in self._adapters.values()]

    def acquire(self, name: str) -> int:
        """Called when a request with this adapter starts: make it resident; returns its bank slot."""
        info = self.get(name)
        if not info.slot:
            if info.host is None:
                self._keep_on_host(info, self._load(name, info.path))
                self.num_loads_from_disk += 1
            info.slot = self._take_slot()
            self.bank.load(info.slot, info.host)
            self.num_loads_to_device += 1
        self._device_lru[name] = None
        self._device_lru.move_to_end(name)
        if name in self._host_lru:  # its host copy may have left the host LRU while it sat on the device
            self._host_lru.move_to_end(name)
        info.num_running += 1
        return info.slot

    def release(self, name: str) -> None:
        self._adapters[name].num_running -= 1

    def _load(self, name: str, path: str | Path) -> AdapterWeights:
        return load_adapter(name, path, self.shapes, self.max_rank, dtype=self.bank.dtype)

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        for name in self._device_lru:  # least recently used first
            info = self._adapters[name]
            if not info.num_running and not info.pinned:
                slot = info.slot
                self._evict_from_device(info)
                self._free_slots.remove(slot)
                return slot
        raise CapacityExceeded("every adapter slot on the device is in use by running requests or pinned",
                               retry_after_s=1)

    def _evict_from_device(self, info: AdapterInfo) -> None:
        if info.slot:
            self._free_slots.append(info.slot)
            info.slot = 0
            self._device_lru.pop(info.name, None)
            self.num_device_evictions += 1

    def _keep_on_host(self, info: AdapterInfo, weights: AdapterWeights) -> None:
        info.host = weights
        self._host_lru[info.name] = None
        self._host_lru.move_to_end(info.name)
        while len(self._host_lru) > self.max_host:
            oldest = next(iter(self._host_lru))
            if oldest == info.name:
                break
            self._host_lru.pop(oldest)
            self._adapters[oldest].host = None  # reloaded from disk on next use (its device copy stays)
