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
from rollout_engine.forward_batch import INDEX_DTYPES, ForwardBatch, TableMirror
from rollout_engine.host_block import BlockLayout
from rollout_engine.memory.saver import plain_graph_capture
from rollout_engine.plan import StepPlan
from rollout_engine.runner.device_lock import DEVICE_WIDE

GraphContext = Callable[[torch.cuda.CUDAGraph, object], ContextManager]


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class StaticInputs:
    """The inputs a graph of `bs` rows reads: input ids, positions, KV slots
    (padding rows: 0, the reserved page) and the request-table rows (int32),
    in one block (`host_block`) that one copy fills before each replay."""

    def __init__(self, bs: int, device: torch.device):
        self.layout = BlockLayout(INDEX_DTYPES, (bs,) * 4)
        self.block = torch.zeros(self.layout.words, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc, self.rows = self.layout.views(self.block)
        self._host = np.zeros(self.layout.words, dtype=np.int64)

    def fill(self, plan: StepPlan) -> None:
        """This plan's rows first, zeros after them (padding). The host block
        is written afresh each time: a copy from pageable memory has read it
        by the time the call returns."""
        host = self.layout.host((plan.input_ids, plan.positions, plan.out_cache_loc, plan.rows), out=self._host)
        self.block.copy_(torch.from_numpy(host), non_blocking=True)


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
        # Each bucket's graph reads its inputs from a block of its own (`StaticInputs`), which one
        # host-to-device copy fills before a replay.
        self.inputs = {bs: StaticInputs(bs, device) for bs in self.buckets}
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
        inp = self.inputs[bs]
        return ForwardBatch(
            input_ids=inp.input_ids, positions=inp.positions, out_cache_loc=inp.out_cache_loc,
            extend_lens=ones, seq_lens=ones, rows=np.zeros(bs, dtype=np.int64), rows_device=inp.rows,
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
        for inp in self.inputs.values():
            inp.block.zero_()  # out_cache_loc 0: the reserved padding page
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
        inp = self.inputs[bucket]
        inp.fill(plan)
        if input_ids is not None:
            inp.input_ids[:bs].copy_(input_ids)
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


