"""Triton paged attention (kernels/attention.py): for GPUs without FlashInfer,
and the decode steps a FlashInfer backend sends here
(`flashinfer_backend.triton_decode_rows`). Reads K/V through the device
request table, so no page-index build is needed. A decode step of one
sequence takes `kernels.one_seq_attention` (one launch whose programs split
the keys, where the batch kernel has one per sequence and KV head, started
longest sequence first)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend, AttentionShape
from rollout_engine.attention.one_seq import ONE_SEQ, one_seq, one_seq_shape, takes_one_seq
from rollout_engine.kernels.attention import decode_attention, extend_attention, longest_first

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch


# Decode steps start their longest sequences first (`decode_attention`'s
# `order`): with ragged lengths, programs started in row order left the long
# sequences running alone at the end (BENCHMARKS.md, "Longest first"). Read
# per step and when a graph is captured (A/B runs set it before).
LONGEST_FIRST = True


class TritonAttentionBackend(AttentionBackend):
    needs_device_table = True
    supports_cuda_graph = True
    orders_decode = True  # decode steps start their longest sequences first (with LONGEST_FIRST)

    def __init__(self, shape: AttentionShape, **_):
        self.shape = shape
        self.one_seq = one_seq_shape(shape)

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if takes_one_seq(self.one_seq, fb):
            fb.attn_metadata = ONE_SEQ
            return
        b = fb.batch_size
        qo_indptr = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(fb.extend_lens, out=qo_indptr[1:])
        lens = fb.seq_lens.astype(np.int32)
        ordered = fb.is_decode and LONGEST_FIRST and self.orders_decode
        parts = [lens, qo_indptr] + ([longest_first(lens)] if ordered else [])
        dev = torch.from_numpy(np.concatenate(parts)).to(self.shape.device, non_blocking=True)
        fb.attn_metadata = (dev[:b], dev[b: 2 * b + 1], int(fb.extend_lens.max()), dev[2 * b + 1:] if ordered else None)

    # ---- captured decode steps: the kernels read lengths (and the order) from static buffers --
    def init_graph_buffers(self, max_bs: int, max_context: int) -> None:
        dev = self.shape.device
        # A graph of `bs` rows reads the lengths at [0, bs) and the order at [bs, 2 bs): one copy fills both.
        self.lens_order_buf = torch.ones(2 * max_bs, dtype=torch.int32, device=dev)
        self.qo_indptr_buf = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)

    def graph_metadata(self, bs: int, fb: "ForwardBatch"):
        if takes_one_seq(self.one_seq, fb):
            return ONE_SEQ
        order = self.lens_order_buf[bs: 2 * bs] if LONGEST_FIRST and self.orders_decode else None
        if order is not None:
            order.copy_(torch.arange(bs, dtype=torch.int32, device=order.device))  # until the first replay writes one
        return self.lens_order_buf[:bs], self.qo_indptr_buf[: bs + 1], 1, order

    def prepare_replay(self, bs: int, bucket: int, seq_lens: np.ndarray, fb: "ForwardBatch") -> None:
        if fb.attn_metadata is ONE_SEQ:  # the kernel reads the length on the device
            return
        # Padding rows attend over one token (row 0's first slot) and are discarded.
        lens = np.ones(bucket, dtype=np.int32)
        lens[:bs] = seq_lens
        host = np.concatenate([lens, longest_first(lens)]) if fb.attn_metadata[3] is not None else lens
        self.lens_order_buf[: host.size].copy_(torch.from_numpy(host).to(self.shape.device, non_blocking=True))

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        if fb.attn_metadata is ONE_SEQ:
            return one_seq(q, layer, fb)
        pool = fb.kv_pool
        k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
        seq_lens, qo_indptr, max_q_len, order = fb.attn_metadata
        table = fb.table.tensor
        if fb.is_decode:
            return decode_attention(q, k_cache, v_cache, table, fb.rows_device, seq_lens, layer.scaling, order)
        return extend_attention(q, k_cache, v_cache, table, fb.rows_device, seq_lens, qo_indptr, max_q_len,
                                layer.scaling)
