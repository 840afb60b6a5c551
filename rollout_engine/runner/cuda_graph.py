"""CUDA graphs for decode steps: one graph per batch-size bucket, captured
once over static input buffers; a step pads its batch to the next bucket
(padding rows write their K/V to the reserved page 0 and are discarded).
Batches above the largest bucket run eagerly.

Backend-neutral: the attention backend owns its static metadata buffers
(`init_graph_buffers`, `graph_metadata` at capture, `prepare_replay` before
each replay).

Lifecycle: `capture()` after the KV pool exists, `replay()` per decode step,
`destroy()` to drop the graphs and their memory pool (and `capture()` again).
The graphs capture the decoder up to its final hidden states. With
`sample=True` each bucket has a second graph, its tail: the LM head and a
plain sampling step (temperature or greedy rows, no filters, no top
logprobs: `kernels.draw.sample_rows`), its tokens and logprobs packed for one
copy to the host. `replay_sampled()` runs both; a step that samples
otherwise runs the LM head and the sampler after `replay()`. On the hosts
measured every launch costs the host tens of microseconds or more, and the
tail replaces about ten of them with one.
"""
from __future__ import annotations

import bisect
import gc
from dataclasses import dataclass
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
from rollout_engine.runner.prompt_graphs import PromptGraphs
from rollout_engine.runner.sampler import pack, plan_uniforms

GraphContext = Callable[[torch.cuda.CUDAGraph, object], ContextManager]


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


# The tail's per-row sampling inputs: temperatures, seeded uniforms, raw-logprob flags.
SAMPLING_DTYPES = (np.float32, np.float64, np.bool_)


class StaticInputs:
    """The inputs a graph of `bs` rows reads: input ids, positions, KV slots
    (padding rows: 0, the reserved page) and the request-table rows (int32),
    and with `sampling` the tail's temperatures, uniforms and raw-logprob
    flags (padding rows: greedy), in one block (`host_block`) that one copy
    fills before each replay."""

    def __init__(self, bs: int, device: torch.device, sampling: bool = False):
        dtypes = INDEX_DTYPES + (SAMPLING_DTYPES if sampling else ())
        self.layout = BlockLayout(dtypes, (bs,) * len(dtypes))
        self.block = torch.zeros(self.layout.words, dtype=torch.int64, device=device)
        views = self.layout.views(self.block)
        self.input_ids, self.positions, self.out_cache_loc, self.rows = views[:4]
        self.temperatures, self.uniforms, self.raw_logprobs = views[4:] if sampling else (None, None, None)
        self._host = np.zeros(self.layout.words, dtype=np.int64)

    def fill(self, plan: StepPlan, sampling: bool = False) -> None:
        """This plan's rows first, zeros after them (padding); with `sampling`
        its sampling rows too. The host block is written afresh each time: a
        copy from pageable memory has read it by the time the call returns."""
        arrays = [plan.input_ids, plan.positions, plan.out_cache_loc, plan.rows]
        if sampling:
            sp = plan.sampling
            arrays += [sp.temperatures, plan_uniforms(sp), sp.raw_logprobs]
        host = self.layout.host(arrays, out=self._host)
        self.block.copy_(torch.from_numpy(host), non_blocking=True)


@dataclass
class TailOutputs:
    """What a bucket's tail graph writes: tokens [bs] int64, logprobs [bs]
    float32, and both as float64 in one array [2 * bs] (tokens, then
    logprobs) for the copy to the host."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    packed: torch.Tensor


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_pool: KVPool,
                 table: TableMirror, max_bs: int, device: torch.device,
                 capture_context: GraphContext = plain_graph_capture, sample: bool = False,
                 prompt: PromptGraphs | None = None):
        self.model, self.backend, self.kv_pool = model, backend, kv_pool
        # The steps off these graphs (prompt tokens), through graphs cut at attention, captured and
        # destroyed with these.
        self.prompt = prompt
        self.samples = sample  # each bucket also has a tail graph: LM head and plain sampling
        self.table, self.device = table, device
        self.max_bs = max_bs
        self.buckets = batch_size_buckets(max_bs)
        # Where graph memory comes from (a releasable region when the memory
        # saver can pause graph pools).
        self.capture_context = capture_context
        # Each bucket's graph reads its inputs from a block of its own (`StaticInputs`), which one
        # host-to-device copy fills before a replay.
        self.inputs = {bs: StaticInputs(bs, device, sample) for bs in self.buckets}
        backend.init_graph_buffers(max_bs, table.max_context)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.tails: dict[int, torch.cuda.CUDAGraph] = {}
        self.tail_outputs: dict[int, TailOutputs] = {}
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
            if self.samples:
                self._capture_tail(bs)
        torch.cuda.synchronize(self.device)
        if self.prompt is not None:
            self.prompt.capture(self.capture_context, self.kv_pool, self.backend, self.table)

    def _tail(self, bs: int) -> TailOutputs:
        from rollout_engine.kernels.draw import sample_rows
        from rollout_engine.kernels.greedy import argmax_logsumexp

        inp = self.inputs[bs]
        logits = self.model.compute_logits(self.outputs[bs])
        greedy, row_max, log_norm = argmax_logsumexp(logits)
        tokens, logprobs = sample_rows(logits, inp.temperatures, row_max, log_norm, greedy, inp.uniforms,
                                       inp.raw_logprobs)
        return TailOutputs(tokens, logprobs, pack([tokens, logprobs]))

    def _capture_tail(self, bs: int) -> None:
        """The LM head and sampling of bucket `bs`, reading its decoder
        graph's hidden states and its block's sampling rows."""
        for _ in range(2):
            self._tail(bs)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with self.capture_context(graph, self.mempool):
            self.tail_outputs[bs] = self._tail(bs)
        self.tails[bs] = graph

    def can_run(self, plan: StepPlan) -> bool:
        return self.captured and plan.is_decode and plan.batch_size <= self.max_bs

    def replay(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [bs, hidden] of a decode plan; `input_ids` (on the
        device) replaces the plan's own tokens when given."""
        bucket = self._replay(plan, input_ids, sampling=False)
        return self.outputs[bucket][:plan.batch_size]

    def replay_sampled(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> tuple[TailOutputs, int]:
        """A decode plan whose every row samples plainly (`SamplingPlan.plain`),
        through its bucket's decoder and tail graphs: the tail's outputs (the
        first `plan.batch_size` rows of each are the plan's) and the bucket."""
        bucket = self._replay(plan, input_ids, sampling=True)
        self.tails[bucket].replay()
        return self.tail_outputs[bucket], bucket

    def _replay(self, plan: StepPlan, input_ids: torch.Tensor | None, sampling: bool) -> int:
        bs = plan.batch_size
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        inp = self.inputs[bucket]
        inp.fill(plan, sampling)
        if input_ids is not None:
            inp.input_ids[:bs].copy_(input_ids)
        self.backend.prepare_replay(bs, bucket, plan.seq_lens, plan.rows, self.batches[bucket],
                                    (plan.share_keys, plan.share_lens))
        self.graphs[bucket].replay()
        return bucket

    def destroy(self) -> None:
        for graph in [*self.graphs.values(), *self.tails.values()]:
            graph.reset()  # now, not when the last reference goes: NCCL waits for captured collectives' graphs
        self.graphs.clear()
        self.outputs.clear()
        self.tails.clear()
        self.tail_outputs.clear()
        self.batches.clear()
        self.mempool = None
        if self.prompt is not None:
            self.prompt.destroy()


