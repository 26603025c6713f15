"""Many LoRA adapters on one base model, chosen per request: the registry.

``AdapterRegistry`` is the bookkeeping: registered names and paths, a device LRU of slots
(adapters of running requests and pinned ones are never evicted) and a host LRU of loaded
weights behind it; loaded lazily on first use. Registered at run time only from inside
RESIDENT_ADAPTERS_DIR. The weights are read and checked by ``load_adapter``
(session/model/lora_weights.py) and held on the device by ``LoraBank``, whose ``LoRALinear``
adds each row's deltas (session/model/lora_bank.py); their names are importable from here too
(the registry loads through this module's ``load_adapter``: tests/integration/test_schedules.py
replaces it here).

Who calls this: the engine loop thread (acquire/release around each request, register and
unregister through admin requests).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from session.errors import AdapterInUse, AdapterNotFound, BadRequest, CapacityExceeded, Forbidden, InvalidAdapter
from session.model.lora_bank import LoraBank, LoRALinear, install_lora, target_shapes
from session.model.lora_weights import TARGETS, AdapterWeights, load_adapter

__all__ = ["ADAPTER_NAME_RE", "AdapterInfo", "AdapterRegistry", "AdapterWeights", "LoRALinear", "LoraBank", "TARGETS",
           "install_lora", "load_adapter", "target_shapes"]

ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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
            weights = info.host
            if weights is None:
                weights = self._load(name, info.path)
                self._keep_on_host(info, weights)
                self.num_loads_from_disk += 1
            info.slot = self._take_slot()
            self.bank.load(info.slot, weights)
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
