"""Reference attention in plain torch: gathers each sequence's K/V from the
pool by slot index. Works on CPU and GPU; slow, but the yardstick the fast
backends are tested against."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rollout_engine.attention.base import AttentionBackend

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.runner.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, **_):
        pass

    def forward(self, q, k, v, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.kv_pool
        pool.store(layer.layer_id, fb.out_cache_loc, k, v)
        k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)
        q_start = 0
        for i in range(fb.batch_size):
            q_len, kv_len = int(fb.extend_lens[i]), int(fb.seq_lens[i])
            idx = fb.kv_indices[fb.kv_indptr[i]: fb.kv_indptr[i + 1]]
            qi = q[q_start: q_start + q_len].transpose(0, 1)  # [heads, q_len, d]
            ki = k_cache[idx].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            vi = v_cache[idx].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            mask = None
            if q_len > 1:  # query j sits at position kv_len - q_len + j
                q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
                mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scaling)
            out[q_start: q_start + q_len] = oi.transpose(0, 1)
            q_start += q_len
        return out
