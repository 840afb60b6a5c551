"""Triton paged attention (kernels/attention.py): for GPUs without FlashInfer.
Reads K/V through the device request table, so no page-index build is needed.
A decode step of one sequence takes `kernels.one_seq_attention` (one launch
whose programs split the keys, where the batch kernel has one per KV head)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend, AttentionShape
from rollout_engine.attention.one_seq import ONE_SEQ, one_seq, one_seq_shape, takes_one_seq
from rollout_engine.kernels.attention import decode_attention, extend_attention

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    needs_device_table = True
    supports_cuda_graph = True

    def __init__(self, shape: AttentionShape, **_):
        self.shape = shape
        self.one_seq = one_seq_shape(shape)

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if takes_one_seq(self.one_seq, fb):
            fb.attn_metadata = ONE_SEQ
            return
        qo_indptr = np.zeros(fb.batch_size + 1, dtype=np.int32)
        np.cumsum(fb.extend_lens, out=qo_indptr[1:])
        host = torch.from_numpy(np.concatenate([fb.seq_lens.astype(np.int32), qo_indptr]))
        dev = host.to(self.shape.device, non_blocking=True)
        fb.attn_metadata = (dev[: fb.batch_size], dev[fb.batch_size:], int(fb.extend_lens.max()))

    # ---- captured decode steps: the kernels read lengths from a static buffer --
    def init_graph_buffers(self, max_bs: int, max_context: int) -> None:
        dev = self.shape.device
        self.seq_lens_buf = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.qo_indptr_buf = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)

    def graph_metadata(self, bs: int, fb: "ForwardBatch"):
        if takes_one_seq(self.one_seq, fb):
            return ONE_SEQ
        return self.seq_lens_buf[:bs], self.qo_indptr_buf[: bs + 1], 1

    def prepare_replay(self, bs: int, bucket: int, seq_lens: np.ndarray, fb: "ForwardBatch") -> None:
        if fb.attn_metadata is ONE_SEQ:  # the kernel reads the length on the device
            return
        # Padding rows attend over one token (row 0's first slot) and are discarded.
        lens = np.ones(bucket, dtype=np.int32)
        lens[:bs] = seq_lens
        self.seq_lens_buf[:bucket].copy_(torch.from_numpy(lens).to(self.shape.device, non_blocking=True))

    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        if fb.attn_metadata is ONE_SEQ:
            return one_seq(q, layer, fb)
        pool = fb.kv_pool
        k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
        seq_lens, qo_indptr, max_q_len = fb.attn_metadata
        table = fb.table.tensor
        if fb.is_decode:
            return decode_attention(q, k_cache, v_cache, table, fb.rows_device, seq_lens, layer.scaling)
        return extend_attention(q, k_cache, v_cache, table, fb.rows_device, seq_lens, qo_indptr, max_q_len,
                                layer.scaling)
