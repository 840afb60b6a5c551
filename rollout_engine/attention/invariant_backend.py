"""Batch-invariant attention (deterministic mode): on the CPU a loop over
queries, on the GPU a Triton kernel (BatchInvariantTritonBackend below).

Each query attends alone to its own context, keys 0 up to its position,
with the same operations on tensors of the same shapes wherever it comes
from: a whole prompt, a chunk of seven, after a prefix served by the cache,
or a decode step among any number of others. Its result therefore has the
same bits in all of them. Slow (a loop over queries), and meant to be."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout_engine.attention.base import AttentionBackend, AttentionShape
from rollout_engine.attention.torch_backend import context_slots
from rollout_engine.attention.triton_backend import TritonAttentionBackend
from rollout_engine.kernels.attention import invariant_attention

if TYPE_CHECKING:
    from rollout_engine.forward_batch import ForwardBatch
    from rollout_engine.layers.attention import PagedAttention


class BatchInvariantAttentionBackend(AttentionBackend):
    def __init__(self, **_):
        pass

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        fb.attn_metadata = context_slots(fb)

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        k_cache, v_cache = fb.kv_pool.k[layer.layer_id], fb.kv_pool.v[layer.layer_id]
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)
        row = 0
        for i, slots in enumerate(fb.attn_metadata):
            q_len = 1 if fb.is_decode else int(fb.extend_lens[i])
            kv_len = len(slots)
            k = k_cache[slots].float().repeat_interleave(group, dim=1).permute(1, 2, 0)  # [heads, d, kv]
            v = v_cache[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, kv, d]
            for j in range(q_len):
                end = kv_len - q_len + j + 1  # this query's position + 1
                scores = torch.bmm(q[row + j].float()[:, None, :], k[:, :, :end].contiguous()) * layer.scaling
                weights = torch.softmax(scores, dim=-1)
                out[row + j] = torch.bmm(weights, v[:, :end].contiguous())[:, 0].to(q.dtype)
            row += q_len
        return out


class BatchInvariantTritonBackend(TritonAttentionBackend):
    """Batch-invariant attention on the GPU (deterministic mode): one Triton
    kernel for decode and extend (kernels/attention.py, `invariant_attention`):
    a query's result is the same in a decode step or a prompt, chunked or not,
    after a cached prefix or not, whatever else runs. No split of the keys
    across programs, so long contexts at small batches run below FlashInfer's
    speed. Captured in CUDA graphs like the Triton backend. Never the
    one-sequence kernel: it splits the keys, so a sequence alone would not
    equal itself in a batch."""

    orders_decode = False  # its kernel's grid is by sequence and query block
    shares_prefixes = False  # a sequence's bits must not depend on the sequences it shares a prefix with

    def __init__(self, shape: AttentionShape, **_):
        super().__init__(shape)
        self.one_seq = False

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.kv_pool
        meta = fb.attn_metadata  # never in an order here (orders_decode)
        return invariant_attention(q, pool.k[layer.layer_id], pool.v[layer.layer_id], fb.table.tensor,
                                   fb.rows_device, meta.seq_lens, meta.qo_indptr, meta.max_q_len, layer.scaling)
