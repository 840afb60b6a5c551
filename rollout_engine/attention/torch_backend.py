"""Reference attention in plain torch: gathers each sequence's K/V from the
pool by slot index. Works on CPU and GPU; the yardstick the fast backends
are tested against. Decode steps run batched (contexts padded to the longest,
masked); extend steps loop over sequences, each through SDPA's fused kernel
(causal without a mask when nothing is cached, else an explicit mask built
per chunk of queries)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from rollout_engine.attention.base import AttentionBackend

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch

# Bound on the elements of one extend mask (a float tensor: 64 MiB in fp32);
# longer contexts with a cached prefix are attended in chunks of queries.
_MASK_ELEMS = 1 << 24


def context_slots(fb: "ForwardBatch") -> list[torch.Tensor]:
    """Each sequence's whole context: its KV slots, in order."""
    device, table = fb.input_ids.device, fb.table.host
    return [torch.from_numpy(table[r, :n]).to(device, non_blocking=True) for r, n in zip(fb.rows, fb.seq_lens)]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, **_):
        pass

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        device = fb.input_ids.device
        table = fb.table.host
        if fb.is_decode:  # contexts padded to the longest: [B, L] slots and a validity mask
            max_len = int(fb.seq_lens.max())
            valid = np.arange(max_len)[None, :] < fb.seq_lens[:, None]
            slots = np.where(valid, table[fb.rows, :max_len], 0)
            fb.attn_metadata = (torch.from_numpy(slots).to(device, non_blocking=True),
                                torch.from_numpy(valid).to(device, non_blocking=True)[:, None, None, :])
        else:
            fb.attn_metadata = context_slots(fb)

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.kv_pool
        k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
        if fb.is_decode:
            return self._decode(q, k_cache, v_cache, layer, fb)
        out = torch.empty_like(q)
        q_start = 0
        for i in range(fb.batch_size):
            q_len = int(fb.extend_lens[i])
            idx = fb.attn_metadata[i]
            # 4-D [1, heads, len, d] views: SDPA takes its fused (flash) CPU
            # kernel only for 4-D inputs; 3-D ones run the math path, which
            # materialises [heads, q_len, kv_len] scores (GBs for long prompts).
            # enable_gqa lets the kernel share each KV head across its query
            # heads instead of copying K/V `group` times (repeat_interleave).
            qi = q[q_start: q_start + q_len].transpose(0, 1)[None]
            ki = k_cache[idx].to(q.dtype).transpose(0, 1)[None]
            vi = v_cache[idx].to(q.dtype).transpose(0, 1)[None]
            oi = self._extend_one(qi, ki, vi, layer.scaling)
            out[q_start: q_start + q_len] = oi[0].transpose(0, 1)
            q_start += q_len
        return out

    @staticmethod
    def _extend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One sequence: q [1, heads, q_len, d], its whole context k, v
        [1, kv_heads, kv_len, d]; query j sits at position kv_len - q_len + j."""
        q_len, kv_len = q.shape[2], k.shape[2]
        prefix = kv_len - q_len  # tokens already in the cache before this step
        if prefix == 0:
            # No cached prefix: the mask is the plain causal one, and
            # is_causal lets the fused kernel skip the blocks above the
            # diagonal without building any mask.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        if q_len == 1:  # the one query sees the whole context: no mask
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        # A cached prefix: is_causal would align the diagonal top-left (query j
        # sees keys <= j), but here query j sees keys <= prefix + j, so the
        # mask is explicit. It is built per chunk of queries, each chunk
        # attending only to the keys up to its last query, so the mask stays
        # at most about _MASK_ELEMS elements however long the context. It is
        # additive (0 / -inf) in q's dtype: a boolean one would be converted
        # to that by SDPA anyway, one more copy.
        out = torch.empty_like(q)
        chunk = max(1, _MASK_ELEMS // kv_len)
        for a in range(0, q_len, chunk):
            b = min(a + chunk, q_len)
            end = prefix + b  # keys [0, end) are visible to some query of the chunk
            q_pos = torch.arange(prefix + a, end, device=q.device)
            masked = torch.arange(end, device=q.device)[None, :] > q_pos[:, None]
            mask = torch.zeros(masked.shape, dtype=q.dtype, device=q.device).masked_fill_(masked, float("-inf"))
            out[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :end], v[:, :, :end],
                                                            attn_mask=mask, scale=scale, enable_gqa=True)
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
