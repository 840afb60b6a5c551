"""CUDA graphs for decode steps: one graph per batch-size bucket, captured
once over static input buffers; a step pads its batch to the next bucket
(padding rows write their K/V to the reserved page 0 and are discarded).
Batches above the largest bucket run eagerly.

Backend-neutral: the attention backend owns its static metadata buffers
(`init_graph_buffers`, `graph_metadata` at capture, `prepare_replay` before
each replay).

Lifecycle: `capture()` after the KV pool exists, `replay()` per decode step,
`destroy()` to drop the graphs and their memory pool (and `capture()` again).
The graphs capture the decoder up to its final hidden states; the LM head
and sampling run after the replay.
"""
from __future__ import annotations

import bisect
import gc
from typing import Callable, ContextManager

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend
from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.forward_batch import ForwardBatch, TableMirror
from rollout_engine.memory.saver import plain_graph_capture
from rollout_engine.plan import StepPlan
from rollout_engine.runner.device_lock import DEVICE_WIDE

GraphContext = Callable[[torch.cuda.CUDAGraph, object], ContextManager]


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_pool: KVPool,
                 table: TableMirror, max_bs: int, device: torch.device,
                 capture_context: GraphContext = plain_graph_capture):
        self.model, self.backend, self.kv_pool = model, backend, kv_pool
        self.table, self.device = table, device
        self.max_bs = max_bs
        self.buckets = batch_size_buckets(max_bs)
        # Where graph memory comes from (a releasable region when the memory
        # saver can pause graph pools).
        self.capture_context = capture_context
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.out_cache_loc = torch.zeros(max_bs, **i64)  # 0: the reserved padding page
        self.rows = torch.zeros(max_bs, dtype=torch.int32, device=device)
        backend.init_graph_buffers(max_bs, table.max_context)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.mempool = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _static_batch(self, bs: int) -> ForwardBatch:
        ones = np.ones(bs, dtype=np.int64)
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            extend_lens=ones, seq_lens=ones, rows=np.zeros(bs, dtype=np.int64), rows_device=self.rows[:bs],
            table=self.table, kv_pool=self.kv_pool, attn_backend=self.backend,
            is_decode=True)

    def capture(self) -> None:
        with DEVICE_WIDE:  # no other engine's thread synchronises the device meanwhile
            # Python's collector runs on whichever thread allocates: during a
            # capture it could free a dropped engine's graphs on this thread,
            # and destroying an executable graph is not allowed while a
            # capture is under way. Collect first, then keep it off.
            gc.collect()
            was_enabled = gc.isenabled()
            gc.disable()
            try:
                self._capture()
            finally:
                if was_enabled:
                    gc.enable()

    @torch.inference_mode()
    def _capture(self) -> None:
        self.mempool = torch.cuda.graph_pool_handle()
        for buf in (self.input_ids, self.positions, self.out_cache_loc, self.rows):
            buf.zero_()
        for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            fb = self._static_batch(bs)
            fb.attn_metadata = self.backend.graph_metadata(bs, fb)
            for _ in range(2):  # warm-up outside the graph (lazy inits, JIT, autotuning)
                self.model(fb.input_ids, fb.positions, fb)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with self.capture_context(graph, self.mempool):
                self.outputs[bs] = self.model(fb.input_ids, fb.positions, fb)
            self.graphs[bs], self.batches[bs] = graph, fb
        torch.cuda.synchronize(self.device)

    def can_run(self, plan: StepPlan) -> bool:
        return self.captured and plan.is_decode and plan.batch_size <= self.max_bs

    def replay(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [bs, hidden] of a decode plan; `input_ids` (on the
        device) replaces the plan's own tokens when given."""
        bs = plan.batch_size
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        zeros = np.zeros(bucket - bs, dtype=np.int64)
        packed = np.concatenate([plan.input_ids, zeros, plan.positions, zeros, plan.out_cache_loc, zeros,
                                 plan.rows, zeros])
        packed = torch.from_numpy(packed).to(self.device, non_blocking=True).view(4, bucket)
        self.input_ids[:bucket].copy_(packed[0])
        self.positions[:bucket].copy_(packed[1])
        self.out_cache_loc[:bucket].copy_(packed[2])
        self.rows[:bucket].copy_(packed[3])
        if input_ids is not None:
            self.input_ids[:bs].copy_(input_ids)
        self.backend.prepare_replay(bs, bucket, plan.seq_lens, self.batches[bucket])
        self.graphs[bucket].replay()
        return self.outputs[bucket][:bs]

    def destroy(self) -> None:
        for graph in self.graphs.values():
            graph.reset()  # now, not when the last reference goes: NCCL waits for captured collectives' graphs
        self.graphs.clear()
        self.outputs.clear()
        self.batches.clear()
        self.mempool = None


