"""Per-session KV cache: preallocated buffers that grow in whole blocks.

Layout, one tensor each for keys and values: ``[num_layers, num_kv_heads, capacity, head_dim]``.
A step writes its new positions in place; attention reads the view ``[:, :, :length]``,
so no decode step allocates cache memory. Capacity grows in multiples of ``block_tokens``
(amortised copy) or, with ``static=True``, is fixed at ``max_tokens`` from the start: the
shape a static-shape compiler (NeuronCore, torch.compile without dynamic shapes) needs.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_tokens: int, max_tokens: int, static: bool = False):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.block_tokens = block_tokens
        self.max_tokens = max_tokens
        self.static = static
        self.length = 0  # tokens whose keys and values are stored
        capacity = max_tokens if static else 0
        self.k = self._empty(capacity)
        self.v = self._empty(capacity)

    def _empty(self, capacity: int) -> torch.Tensor:
        # Static caches are read whole under a mask: masked positions get weight 0, and 0 * NaN from
        # uninitialised memory would still be NaN, so they start zeroed. Dynamic ones never read past length.
        alloc = torch.zeros if self.static else torch.empty
        return alloc(self.num_layers, self.num_kv_heads, capacity, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held on the device (both buffers, whole capacity)."""
        return 2 * self.k.numel() * self.k.element_size()

    def capacity_for(self, num_tokens: int) -> int:
        """The capacity ``ensure_capacity(num_tokens)`` would leave (never less than today's)."""
        if self.static:
            return self.max_tokens
        blocks = -(-num_tokens // self.block_tokens)
        return max(self.capacity, min(blocks * self.block_tokens, self.max_tokens))

    def ensure_capacity(self, num_tokens: int) -> None:
        """Called before a prefill or decode run with the largest length it may reach."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"KV cache cannot hold {num_tokens} tokens (max {self.max_tokens})")
        if num_tokens <= self.capacity:
            return
        capacity = self.capacity_for(num_tokens)
        k, v = self._empty(capacity), self._empty(capacity)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [num_kv_heads, T, head_dim] for positions start .. start+T-1
        end = start + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v

    def keys(self, layer: int, end: int) -> torch.Tensor:
        return self.k[layer, :, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self.v[layer, :, :end]

    def crop(self, length: int) -> None:
        """Forget positions from ``length`` on (the buffers stay allocated)."""
        self.length = min(self.length, length)

    def release(self) -> None:
        """Free the buffers; a later ``ensure_capacity`` allocates again (static caches: in full)."""
        self.length = 0
        self.k = self._empty(0)
        self.v = self._empty(0)
