"""The attention layer: holds its layer id and head counts, and hands the
rotated queries to the step's attention backend, which reads K/V from the
pool (the rotary layer has already written this step's K/V there)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from rollout_engine.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim ** -0.5

    def forward(self, q: torch.Tensor, fb: "ForwardBatch", out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, heads, d] for the step's new tokens. Returns [T, heads * d].
        Padding rows (`fb.pad`, at the end) are left out of the backend's call
        and get zeros. `out` ([T, heads * d]): the real rows are written
        there and it is returned; its padding rows are left as they are
        (the caller's to zero)."""
        n = q.shape[0] - fb.pad
        o = fb.attn_backend.forward(q[:n] if fb.pad else q, self, fb).reshape(n, self.num_heads * self.head_dim)
        if out is not None:
            out[:n].copy_(o)
            return out
        return F.pad(o, (0, 0, 0, fb.pad)) if fb.pad else o
