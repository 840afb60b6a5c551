"""Reference attention in plain torch: gathers each sequence's K/V from the
pool by slot index. Works on CPU and GPU; the yardstick the fast backends
are tested against. Decode steps run batched (contexts padded to the longest,
masked); extend steps loop over sequences with a causal mask."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from rollout_engine.attention.base import AttentionBackend

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.runner.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, **_):
        pass

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        device = fb.input_ids.device
        table = fb.table.table
        if fb.is_decode:  # contexts padded to the longest: [B, L] slots and a validity mask
            max_len = int(fb.seq_lens.max())
            valid = np.arange(max_len)[None, :] < fb.seq_lens[:, None]
            slots = np.where(valid, table[fb.rows, :max_len], 0)
            fb.attn_metadata = (torch.from_numpy(slots).to(device, non_blocking=True),
                                torch.from_numpy(valid).to(device, non_blocking=True)[:, None, None, :])
        else:  # each sequence's whole context
            fb.attn_metadata = [torch.from_numpy(table[r, :n]).to(device, non_blocking=True)
                                for r, n in zip(fb.rows, fb.seq_lens)]

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.kv_pool
        k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
        if fb.is_decode:
            return self._decode(q, k_cache, v_cache, layer, fb)
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)
        q_start = 0
        for i in range(fb.batch_size):
            q_len, kv_len = int(fb.extend_lens[i]), int(fb.seq_lens[i])
            idx = fb.attn_metadata[i]
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

    @staticmethod
    def _decode(q, k_cache, v_cache, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        """Grouped-query attention without materialising repeated K/V: the
        query heads of one KV head attend together."""
        slots, mask = fb.attn_metadata
        bsz, kv_heads = q.shape[0], layer.num_kv_heads
        qg = q.view(bsz, kv_heads, layer.num_heads // kv_heads, layer.head_dim)
        kb, vb = k_cache[slots].to(q.dtype), v_cache[slots].to(q.dtype)  # [B, L, kv_heads, d]
        # Padding reads slot 0, whose contents are arbitrary (NaN after a
        # release without backup): 0 * NaN would leak into real rows.
        vb = vb.masked_fill(~mask[:, 0, 0, :, None, None], 0)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, kb).float() * layer.scaling
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.einsum("bhgl,blhd->bhgd", probs, vb).reshape(bsz, layer.num_heads, layer.head_dim)
