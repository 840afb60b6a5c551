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


# Hand the backend the output rows to write into (a padded step's, a prompt graph's `o` buffer) instead of
# copying its result there. Off until measured on a GPU (benchmarks/ab_switch.py ...WRITE_INTO_OUT=1): off,
# the result is copied, as before.
WRITE_INTO_OUT = False


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
        and get zeros. `out` ([T, heads * d], contiguous): the real rows are
        written there and it is returned; its padding rows are left as they
        are (the caller's to zero). The backend is handed the rows to write
        into (`WRITE_INTO_OUT`), so one that can skips a copy of the result."""
        t, width = q.shape[0], self.num_heads * self.head_dim
        n = t - fb.pad
        if out is None and fb.pad and WRITE_INTO_OUT:
            out = q.new_empty(t, width)
            out[n:].zero_()
        target = out[:n].view(n, self.num_heads, self.head_dim) if out is not None and WRITE_INTO_OUT else None
        o = fb.attn_backend.forward(q[:n] if fb.pad else q, self, fb, out=target)
        if out is None:
            o = o.reshape(n, width)
            return F.pad(o, (0, 0, 0, fb.pad)) if fb.pad else o
        if target is None or o.data_ptr() != target.data_ptr():  # a backend that wrote its own
            out[:n].copy_(o.reshape(n, width))
        return out
