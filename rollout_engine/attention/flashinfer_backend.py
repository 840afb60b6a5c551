"""FlashInfer paged attention: fa2 prefill over cached prefix + new tokens,
fa2 decode (tensor cores when 4+ query heads share a KV head). Planned once
per step for all layers; page indices are built on the GPU from the device
request table. Decode wrappers for CUDA graphs plan into fixed buffers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend, AttentionShape
from rollout_engine.kernels.kv_indices import build_page_indices

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20


@dataclass
class PageTable:
    """Host page-table layout of one step (FlashInfer's CSR form)."""

    indptr: np.ndarray  # [B + 1] int32
    last_page_len: np.ndarray  # [B] int32

    @staticmethod
    def of(seq_lens: np.ndarray, page_size: int) -> "PageTable":
        pages = -(-seq_lens // page_size)
        indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        return PageTable(indptr, (seq_lens - (pages - 1) * page_size).astype(np.int32))


class FlashInferAttentionBackend(AttentionBackend):
    needs_device_table = True
    supports_cuda_graph = True

    def __init__(self, shape: AttentionShape, **_):
        import flashinfer

        self.fi = flashinfer
        self.shape = shape
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=shape.device)
        # Tensor cores whenever 4+ query heads share a KV head: at every batch
        # size measured (1 to 256) as fast or faster than the CUDA-core kernel.
        self.use_tensor_cores = shape.num_heads // shape.num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend="fa2")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._plan_copied: torch.cuda.Event | None = None

    # ---- planning --------------------------------------------------------------
    def page_indices(self, fb: "ForwardBatch", pt: PageTable, out: torch.Tensor | None = None) -> torch.Tensor:
        indptr = torch.from_numpy(pt.indptr).to(self.shape.device, non_blocking=True)
        return build_page_indices(fb.table.tensor, fb.rows_device, indptr, self.shape.page_size,
                                  int(pt.indptr[-1]), out=out)

    def _before_plan(self) -> None:
        """A plan writes its schedule into a pinned host buffer and queues a
        copy to the device. With steps launched ahead, the previous plan's
        copy may still be queued: wait until it has run before overwriting."""
        if self._plan_copied is not None:
            self._plan_copied.synchronize()

    def _after_plan(self) -> None:
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def plan_decode(self, wrapper, pt: PageTable, indices: torch.Tensor) -> None:
        s = self.shape
        self._before_plan()
        wrapper.plan(torch.from_numpy(pt.indptr), indices, torch.from_numpy(pt.last_page_len),
                     s.num_heads, s.num_kv_heads, s.head_dim, s.page_size,
                     q_data_type=s.dtype, kv_data_type=s.dtype, non_blocking=True)
        self._after_plan()

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        s = self.shape
        pt = PageTable.of(fb.seq_lens, s.page_size)
        indices = self.page_indices(fb, pt)
        if fb.is_decode:
            self.plan_decode(self.decode, pt, indices)
            fb.attn_metadata = self.decode
            return
        qo_indptr = np.zeros(fb.batch_size + 1, dtype=np.int32)
        np.cumsum(fb.extend_lens, out=qo_indptr[1:])
        self._before_plan()
        self.prefill.plan(torch.from_numpy(qo_indptr), torch.from_numpy(pt.indptr), indices,
                          torch.from_numpy(pt.last_page_len), s.num_heads, s.num_kv_heads, s.head_dim,
                          s.page_size, causal=True, q_data_type=s.dtype, kv_data_type=s.dtype, non_blocking=True)
        self._after_plan()
        fb.attn_metadata = self.prefill

    # ---- captured decode steps ------------------------------------------------
    def init_graph_buffers(self, max_bs: int, max_context: int) -> None:
        """Page-table buffers shared by every captured batch size (one graph
        replays at a time); one decode wrapper per size plans into them."""
        dev = self.shape.device
        max_pages = -(-max_context // self.shape.page_size)
        self.indptr_buf = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.last_page_len_buf = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.indices_buf = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=dev)
        self.graph_wrappers: dict[int, object] = {}

    def graph_metadata(self, bs: int, fb: "ForwardBatch"):
        wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self.indptr_buf[: bs + 1], paged_kv_indices_buffer=self.indices_buf,
            paged_kv_last_page_len_buffer=self.last_page_len_buf[:bs], backend="fa2")
        self.indices_buf[:bs].zero_()
        dummy = PageTable(np.arange(bs + 1, dtype=np.int32), np.ones(bs, dtype=np.int32))
        self.plan_decode(wrapper, dummy, self.indices_buf[:bs])
        self.graph_wrappers[bs] = wrapper
        return wrapper

    def prepare_replay(self, bs: int, bucket: int, seq_lens: np.ndarray, fb: "ForwardBatch") -> None:
        pad = bucket - bs
        real = PageTable.of(seq_lens, self.shape.page_size)
        total = int(real.indptr[-1])
        # Padding sequences: one page (the reserved page 0), one token.
        pt = PageTable(np.concatenate([real.indptr, total + np.arange(1, pad + 1, dtype=np.int32)]),
                       np.concatenate([real.last_page_len, np.ones(pad, dtype=np.int32)]))
        indptr = torch.from_numpy(real.indptr).to(self.shape.device, non_blocking=True)
        build_page_indices(fb.table.tensor, fb.rows_device[:bs], indptr, self.shape.page_size, total,
                           out=self.indices_buf)
        if pad:
            self.indices_buf[total: total + pad].zero_()
        self.plan_decode(self.graph_wrappers[bucket], pt, self.indices_buf[: total + pad])

    # ---- the layer call ------------------------------------------------------
    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        pool = fb.kv_pool
        p = self.shape.page_size
        k_cache = pool.k[layer.layer_id].view(-1, p, layer.num_kv_heads, layer.head_dim)
        v_cache = pool.v[layer.layer_id].view(-1, p, layer.num_kv_heads, layer.head_dim)
        return fb.attn_metadata.run(q.contiguous(), (k_cache, v_cache))
