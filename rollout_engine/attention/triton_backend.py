"""Triton paged attention (kernels/attention.py): for GPUs without FlashInfer,
and the decode steps a FlashInfer backend sends here
(`flashinfer_backend.triton_decode_rows`). Reads K/V through the device
request table, so no page-index build is needed. A decode step of one
sequence takes `kernels.one_seq_attention` (one launch whose programs split
the keys, where the batch kernel has one per sequence and KV head, started
longest sequence first)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend, AttentionShape
from rollout_engine.attention.one_seq import ONE_SEQ, one_seq, one_seq_shape, takes_one_seq
from rollout_engine.kernels.attention import decode_attention, extend_attention, in_order, longest_first

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch


# Decode steps start their longest sequences first (`decode_attention`'s
# `order`): with ragged lengths, programs started in row order left the long
# sequences running alone at the end (BENCHMARKS.md, "Longest first"). Read
# per step and when a graph is captured (A/B runs set it before).
LONGEST_FIRST = True


class TritonMetadata(NamedTuple):
    """A step's metadata. With an `order` (decode steps, longest first), the
    lengths and the request-table `rows` are in that order (`in_order`);
    without one, `rows` is None: the step's own device rows."""
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor
    max_q_len: int
    order: torch.Tensor | None
    rows: torch.Tensor | None


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
        max_q = int(fb.extend_lens.max())
        if not (fb.is_decode and LONGEST_FIRST and self.orders_decode):
            dev = torch.from_numpy(np.concatenate([lens, qo_indptr])).to(self.shape.device, non_blocking=True)
            fb.attn_metadata = TritonMetadata(dev[:b], dev[b:], max_q, None, None)
            return
        order = longest_first(lens)
        dev = torch.from_numpy(np.concatenate([*in_order(order, lens, fb.rows), order, qo_indptr]))
        dev = dev.to(self.shape.device, non_blocking=True)
        fb.attn_metadata = TritonMetadata(dev[:b], dev[3 * b:], max_q, dev[2 * b: 3 * b], dev[b: 2 * b])

    # ---- captured decode steps: the kernels read lengths, rows and order from static buffers --
    def init_graph_buffers(self, max_bs: int, max_context: int) -> None:
        dev = self.shape.device
        # A graph of `bs` rows reads its lengths at [0, bs) and, ordered, its request-table rows at [bs, 2 bs)
        # and the order at [2 bs, 3 bs): one copy fills them.
        self.step_buf = torch.ones(3 * max_bs, dtype=torch.int32, device=dev)
        self.qo_indptr_buf = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)

    def graph_metadata(self, bs: int, fb: "ForwardBatch"):
        if takes_one_seq(self.one_seq, fb):
            return ONE_SEQ
        lens, qo_indptr = self.step_buf[:bs], self.qo_indptr_buf[: bs + 1]
        if not (LONGEST_FIRST and self.orders_decode):
            return TritonMetadata(lens, qo_indptr, 1, None, None)
        rows, order = self.step_buf[bs: 2 * bs], self.step_buf[2 * bs: 3 * bs]
        # until the first replay writes them: the captured batch's rows, in row order
        rows.copy_(fb.rows_device[:bs])
        order.copy_(torch.arange(bs, dtype=torch.int32, device=order.device))
        return TritonMetadata(lens, qo_indptr, 1, order, rows)

    def prepare_replay(self, bs: int, bucket: int, seq_lens: np.ndarray, rows: np.ndarray,
                       fb: "ForwardBatch") -> None:
        if fb.attn_metadata is ONE_SEQ:  # the kernel reads the length on the device
            return
        # Padding rows attend over one token (row 0's first slot) and are discarded.
        lens = np.ones(bucket, dtype=np.int32)
        lens[:bs] = seq_lens
        if fb.attn_metadata.order is None:
            host = lens
        else:
            all_rows = np.zeros(bucket, dtype=np.int64)
            all_rows[:bs] = rows
            order = longest_first(lens)
            host = np.concatenate([*in_order(order, lens, all_rows), order])
        self.step_buf[: host.size].copy_(torch.from_numpy(host).to(self.shape.device, non_blocking=True))

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        if fb.attn_metadata is ONE_SEQ:
            return one_seq(q, layer, fb)
        pool = fb.kv_pool
        k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
        meta = fb.attn_metadata
        table = fb.table.tensor
        if fb.is_decode:
            rows = fb.rows_device if meta.order is None else meta.rows
            return decode_attention(q, k_cache, v_cache, table, rows, meta.seq_lens, layer.scaling, meta.order)
        return extend_attention(q, k_cache, v_cache, table, fb.rows_device, meta.seq_lens, meta.qo_indptr,
                                meta.max_q_len, layer.scaling)
