"""FlashInfer paged attention: fa2 prefill over cached prefix + new tokens,
fa2 decode (tensor cores when 4+ query heads share a KV head, or from 128
rows on). Planned once per step for all layers; page indices are built on
the GPU from the device request table. An e4m3 KV cache is read by the same
kernels (scale 1: no k_scale / v_scale). Decode wrappers for CUDA graphs plan into fixed buffers.
A decode step of one sequence takes the engine's own one-launch kernel
(`kernels.one_seq_attention`, no plan: it reads the length on the device).
Decode steps of bf16 queries over an e4m3 cache go to the Triton backend's
kernel (`TRITON_DECODE_E4M3`; fp16 products: `kernels.attention`), and
over a bf16 cache those of 32 rows or more (`triton_decode_rows`); prefill
stays here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend, AttentionShape
from rollout_engine.attention.one_seq import ONE_SEQ, one_seq, one_seq_shape, takes_one_seq
from rollout_engine.kernels.kv_indices import build_page_indices

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20
TENSOR_CORE_MIN_BATCH = 128
# From this many rows on, the tensor-core decode kernel does not split a
# sequence's keys over several blocks: the rows fill the GPU by themselves, and
# the split's merge pass costs 2-8% of the kernel (64-256 rows, ragged
# lengths, with or without one 16k-token sequence among them;
# benchmarks/decode_attention.py). FlashInfer's fixed split size is not an
# option here: replayed in a CUDA graph captured without splits, it returned
# wrong outputs for the sequences it split.
NO_SPLIT_MIN_BATCH = 64
# Decode steps of one sequence through `kernels.one_seq_attention` (FlashInfer's
# kernel and merge pass took ~12 us a layer at 1,000 tokens of context;
# BENCHMARKS.md "Attention at batch 1"). A/B runs and tests turn it off.
ONE_SEQ_ENABLED = True
# Decode steps over an e4m3 cache with bf16 queries through the Triton
# backend (`TritonAttentionBackend`), whose kernel multiplies in fp16:
# FlashInfer's e4m3 decode is slower than its bf16 one on an H200, the Triton
# kernel takes 0.5-0.7x its time at 64-512 rows (BENCHMARKS.md, "Triton
# decode tiles"). Read when the backend is built (A/B runs set it before).
TRITON_DECODE_E4M3 = True
# Decode steps over a bf16 cache go to the same kernel from
# TRITON_DECODE_BF16_MIN_ROWS rows where TRITON_DECODE_BF16_MIN_GROUP or more
# query heads share a KV head (0 or less: never; with CUDA graphs the rows
# are the graph's). llama-3.1-8b (4 a KV head): steps 4-7% shorter at 64-256
# rows, 2% at 32. Qwen3-0.6B (2 a KV head): offline 6% faster since the
# kernel starts the longest sequences first (it was 6-9% slower before: with
# ragged lengths the long ones ran last). Below 32 rows FlashInfer splits
# long keys over blocks, where the Triton kernel has one program per row and
# KV head.
TRITON_DECODE_BF16_MIN_ROWS = 32
TRITON_DECODE_BF16_MIN_GROUP = 1


def triton_decode_rows(shape: AttentionShape) -> int | None:
    """The fewest rows whose decode steps a FlashInfer backend of `shape`
    sends to the Triton kernel; None: it sends none."""
    if shape.dtype != torch.bfloat16:
        return None
    if shape.cache_dtype == torch.float8_e4m3fn:
        return 1 if TRITON_DECODE_E4M3 else None
    group = shape.num_heads // shape.num_kv_heads  # the cache is bf16 here, as the queries
    if TRITON_DECODE_BF16_MIN_ROWS > 0 and group >= TRITON_DECODE_BF16_MIN_GROUP:
        return TRITON_DECODE_BF16_MIN_ROWS
    return None


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
        # With 2-3 they are from TENSOR_CORE_MIN_BATCH rows on (at 256 rows of
        # ragged lengths, 9% more KV bandwidth; benchmarks/decode_attention.py).
        group = shape.num_heads // shape.num_kv_heads
        self.tensor_core_min_batch = 1 if group >= 4 else TENSOR_CORE_MIN_BATCH
        self._decode: dict[bool, object] = {}  # eager decode wrappers, by tensor cores
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._plan_copied: torch.cuda.Event | None = None
        self.one_seq = ONE_SEQ_ENABLED and one_seq_shape(shape)  # read at construction (A/B runs set it before)
        self.triton_decode = None  # the delegate of decode steps of `triton_rows` rows or more
        self.triton_rows = triton_decode_rows(shape)  # read at construction (A/B runs set the switches before)
        if self.triton_rows is not None:
            from rollout_engine.attention.triton_backend import TritonAttentionBackend

            self.triton_decode = TritonAttentionBackend(shape)

    @property
    def reads_shared_prefixes(self) -> bool:
        """Its decode steps sent to the Triton kernel read shared prefixes once (`GROUPS`)."""
        return self.triton_decode is not None and self.triton_decode.reads_shared_prefixes

    def delegates(self, batch: int) -> bool:
        """Whether a decode step of `batch` rows goes to the Triton kernel."""
        return self.triton_rows is not None and batch >= self.triton_rows

    def tensor_cores(self, batch: int) -> bool:
        return batch >= self.tensor_core_min_batch

    def decode_wrapper(self, batch: int):
        tc = self.tensor_cores(batch)
        if tc not in self._decode:
            self._decode[tc] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tc, backend="fa2")
        return self._decode[tc]

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
        if self._plan_copied is None:  # one event, recorded again after each plan (a new one is host time)
            self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def split_args(self, batch: int) -> dict:
        """The decode plan's split-KV controls for `batch` rows (a captured
        graph's are those of its size, at capture and every replay)."""
        if self.tensor_cores(batch) and batch >= NO_SPLIT_MIN_BATCH:
            return {"disable_split_kv": True}
        return {}

    def plan_decode(self, wrapper, pt: PageTable, indices: torch.Tensor, batch: int,
                    seq_lens: torch.Tensor | None = None) -> None:
        s = self.shape
        self._before_plan()
        wrapper.plan(torch.from_numpy(pt.indptr), indices, torch.from_numpy(pt.last_page_len),
                     s.num_heads, s.num_kv_heads, s.head_dim, s.page_size, seq_lens=seq_lens,
                     q_data_type=s.dtype, kv_data_type=s.cache_dtype, non_blocking=True, **self.split_args(batch))
        self._after_plan()

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if takes_one_seq(self.one_seq, fb):  # no page table, no plan
            fb.attn_metadata = ONE_SEQ
            return
        if fb.is_decode and self.delegates(fb.batch_size):  # its metadata: a tuple (`forward` tells them apart)
            self.triton_decode.init_forward_metadata(fb)
            return
        s = self.shape
        pt = PageTable.of(fb.seq_lens, s.page_size)
        indices = self.page_indices(fb, pt)
        if fb.is_decode:
            wrapper = self.decode_wrapper(fb.batch_size)
            self.plan_decode(wrapper, pt, indices, fb.batch_size)
            fb.attn_metadata = wrapper
            return
        qo_indptr = np.zeros(fb.batch_size + 1, dtype=np.int32)
        np.cumsum(fb.extend_lens, out=qo_indptr[1:])
        self._before_plan()
        self.prefill.plan(torch.from_numpy(qo_indptr), torch.from_numpy(pt.indptr), indices,
                          torch.from_numpy(pt.last_page_len), s.num_heads, s.num_kv_heads, s.head_dim,
                          s.page_size, causal=True, q_data_type=s.dtype, kv_data_type=s.cache_dtype, non_blocking=True)
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
        if self.triton_decode is not None:
            self.triton_decode.init_graph_buffers(max_bs, max_context)

    def graph_metadata(self, bs: int, fb: "ForwardBatch"):
        if takes_one_seq(self.one_seq, fb):
            return ONE_SEQ
        if self.delegates(bs):
            return self.triton_decode.graph_metadata(bs, fb)
        wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores(bs),
            paged_kv_indptr_buffer=self.indptr_buf[: bs + 1], paged_kv_indices_buffer=self.indices_buf,
            paged_kv_last_page_len_buffer=self.last_page_len_buf[:bs], backend="fa2")
        self.indices_buf[:bs].zero_()
        dummy = PageTable(np.arange(bs + 1, dtype=np.int32), np.ones(bs, dtype=np.int32))
        self.plan_decode(wrapper, dummy, self.indices_buf[:bs], bs)
        self.graph_wrappers[bs] = wrapper
        return wrapper

    def prepare_replay(self, bs: int, bucket: int, seq_lens: np.ndarray, rows: np.ndarray,
                       fb: "ForwardBatch", shares: tuple | None = None) -> None:
        """Plan a replay of `bucket` rows for `bs` sequences: FlashInfer's plan
        copies the page table (padding sequences: one page, the reserved page
        0, one token) into the graph's buffers, then one kernel builds the
        page indices from the device table and those buffers, padding
        included. Host time is the cost here (each device call is tens of
        microseconds on the hosts measured): the indices are not passed to
        the plan (it would copy the buffer onto itself), and the sequence
        lengths are (it would derive them with tensor ops on the host)."""
        if fb.attn_metadata is ONE_SEQ:  # the kernel reads the length on the device: nothing to plan
            return
        if isinstance(fb.attn_metadata, tuple):
            self.triton_decode.prepare_replay(bs, bucket, seq_lens, rows, fb, shares)
            return
        pad = bucket - bs
        real = PageTable.of(seq_lens, self.shape.page_size)
        total = int(real.indptr[-1])
        pt = PageTable(np.concatenate([real.indptr, total + np.arange(1, pad + 1, dtype=np.int32)]),
                       np.concatenate([real.last_page_len, np.ones(pad, dtype=np.int32)]))
        lens = np.ones(bucket, dtype=np.int32)
        lens[:bs] = seq_lens
        self.plan_decode(self.graph_wrappers[bucket], pt, self.indices_buf[:0], bucket, torch.from_numpy(lens))
        build_page_indices(fb.table.tensor, fb.rows_device[:bs], self.indptr_buf[: bucket + 1], self.shape.page_size,
                           total, out=self.indices_buf, pad=pad)

    # ---- the layer call ------------------------------------------------------
    def forward(self, q, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        if fb.attn_metadata is ONE_SEQ:
            return one_seq(q, layer, fb)
        if isinstance(fb.attn_metadata, tuple):  # the Triton decode's
            return self.triton_decode.forward(q, layer, fb)
        pool = fb.kv_pool
        p = self.shape.page_size
        k_cache = pool.k[layer.layer_id].view(-1, p, layer.num_kv_heads, layer.head_dim)
        v_cache = pool.v[layer.layer_id].view(-1, p, layer.num_kv_heads, layer.head_dim)
        return fb.attn_metadata.run(q.contiguous(), (k_cache, v_cache))
