"""Per-layer K and V tensors, allocated once. Slot s of layer l holds the key
and value of one token: k[l][s] is [kv_heads, head_dim].

With routing capture (MoE, `enable_return_routed_experts`) the pool also
holds `routes` [slots, moe_layers, top_k]: the experts each MoE layer chose
for the token whose KV is in that slot, written by the routing kernel. It
lives and dies with the KV (same slots, same memory region), so a cache hit,
a fork or a retraction reports the routing the KV was computed with."""
from __future__ import annotations

from typing import NamedTuple

import torch


class RoutesLayout(NamedTuple):
    moe_layers: int
    top_k: int
    dtype: torch.dtype  # uint8 up to 256 experts, else int16

    @staticmethod
    def of(num_experts: int, moe_layers: int, top_k: int) -> "RoutesLayout":
        return RoutesLayout(moe_layers, top_k, torch.uint8 if num_experts <= 256 else torch.int16)

    @property
    def bytes_per_token(self) -> int:
        return self.moe_layers * self.top_k * self.dtype.itemsize


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, routes: RoutesLayout | None = None):
        self.num_slots = num_slots
        self.dtype = dtype
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.routes = None if routes is None else torch.zeros((num_slots, routes.moe_layers, routes.top_k),
                                                              dtype=routes.dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        routes: RoutesLayout | None = None) -> int:
        kv = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return kv + (routes.bytes_per_token if routes is not None else 0)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool (one memory tag)."""
        return self.k + self.v + ([self.routes] if self.routes is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
