"""StepPlan -> forward -> logits -> sampled tokens and logprobs.

The runner sees plans only (no scheduler objects): it keeps its own copy of
the request table up to date from each plan's writes, computes logits only
for the plan's logit rows, samples, and brings every result back to the host
in one copy, the step's single device sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend
from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.forward_batch import ForwardBatch, TableMirror, padded_tokens
from rollout_engine.models.decoder import DecoderForCausalLM
from rollout_engine.plan import SamplingPlan, StepOutput, StepPlan
from rollout_engine.kernels._triton import triton_available, use_kernel
from rollout_engine.kernels.batch_gemm import new_counters, use_counters
from rollout_engine.runner.device_lock import DEVICE_WIDE
from rollout_engine.runner.routes import RoutesCopy, RoutesPart
from rollout_engine.runner.sampler import (INVARIANT_ROWS, TORCH_ROWS, SampleResult, SamplingBatch, pack,
                                           raw_logprobs_per_row, sample, sample_per_row, score)

SCORE_ROWS = 256  # processed prompt logprobs: rows per block (a [rows, vocab] distribution each)


@dataclass
class StepHandle:
    """A launched step: its results are on their way to `host`. `bucket`: a
    step sampled in its decode graph's tail, whose `host` holds the tail's
    packed rows (tokens, then logprobs, `bucket` each; pooled, see
    `ModelRunner._pinned`)."""

    plan: StepPlan
    sampled: Any
    host: torch.Tensor | None
    event: Any
    bucket: int = 0


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_pool: KVPool, backend: AttentionBackend,
                 table_shape: tuple[int, int], device: torch.device, batch_invariant: bool = False):
        self.model = model
        self.batch_invariant = batch_invariant  # deterministic mode: sample each row alone
        # Steps off the graphs run on padded row counts (`forward_batch.padded_tokens`): on the GPU, for
        # cuBLAS's per-shape cost; not in deterministic mode, whose products are its own kernels.
        self.pads_eager = device.type == "cuda" and not batch_invariant
        self.kv_pool = kv_pool
        self.backend = backend
        self.device = device
        self.table_shape = table_shape
        self.table = TableMirror(*table_shape, device, on_device=backend.needs_device_table,
                                 on_host=not backend.needs_device_table)
        self.graphs = None  # a CudaGraphRunner once captured
        # Reused between steps (each new one is host time): events, and the
        # pinned buffers a graph tail's packed rows land in, by bucket. Each
        # goes back to its pool when its step is collected.
        self._events: list[torch.cuda.Event] = []
        self._pinned: dict[int, list[torch.Tensor]] = {}
        # The split small-batch products' counters (kernels/batch_gemm.py): this
        # runner's own, allocated here, outside the memory-saver regions.
        self.gemm_counters = new_counters(device) if device.type == "cuda" and triton_available() else None

    def capture_cuda_graphs(self, max_bs: int, capture_context, prompt_tokens: int = 0) -> None:
        """Decode graphs up to `max_bs` rows; with `prompt_tokens`, graphs cut
        at attention for the other steps up to that many tokens, where the
        model allows them (`prompt_graphs.supports`)."""
        from rollout_engine.runner import prompt_graphs
        from rollout_engine.runner.cuda_graph import CudaGraphRunner

        # The tail graphs sample as the eager sampler's fused path does; deterministic mode samples by
        # its own formula, on every path.
        sample = self.device.type == "cuda" and triton_available() and not self.batch_invariant
        prompt = None
        if prompt_tokens and prompt_graphs.ENABLED and prompt_graphs.supports(self.model, self.batch_invariant):
            prompt = prompt_graphs.PromptGraphs(self.model, prompt_tokens, self.device)
        self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_pool, self.table, max_bs, self.device,
                                      capture_context, sample=sample, prompt=prompt)
        with use_counters(self.gemm_counters):  # the graphs' split products count on this runner's counters
            self.graphs.capture()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, prev: StepHandle | None = None, to_host: bool = True) -> StepHandle:
        """Enqueue the step on the device and start copying its results to
        the host; returns at once. `prev`: the handle of the previous step,
        whose sampled tokens are the inputs of a plan with `prev_rows`.
        `to_host=False` (tensor-parallel ranks other than 0, whose results
        nobody reads): no copy to the host, only the sampled tokens kept on
        the device for the next plan."""
        self.table.apply(plan.table_writes)
        graphs = self.graphs
        if graphs is not None and plan.logits_for_all_rows and graphs.can_run(plan):
            input_ids = self._inputs_from_prev(plan, prev)
            if graphs.samples and self._samples_in_tail(plan):
                return self._launch_tail(plan, input_ids, to_host)
            hidden = graphs.replay(plan, input_ids)
        else:
            hidden = self._forward_eager(plan, prev)
        if not len(plan.logit_rows):
            return StepHandle(plan, None, None, None)
        logits = self._logits(plan, hidden)
        sampled, device_out = self._sample(plan, logits)
        if not to_host:
            return StepHandle(plan, sampled, None, None)
        if device_out.is_cuda:
            host = torch.empty(device_out.shape, dtype=device_out.dtype, pin_memory=True)
            host.copy_(device_out, non_blocking=True)
            return StepHandle(plan, sampled, host, self._record())
        return StepHandle(plan, sampled, device_out, None)

    @staticmethod
    def _samples_in_tail(plan: StepPlan) -> bool:
        """A plan the decode graphs' tails sample: one plain sampling row per
        row (`SamplingPlan.plain`), no prompt logprobs."""
        return (plan.sampling is not None and plan.sampling.plain and not len(plan.prompt_rows)
                and plan.samples_every_logit_row)

    def _launch_tail(self, plan: StepPlan, input_ids: torch.Tensor | None, to_host: bool) -> StepHandle:
        out, bucket = self.graphs.replay_sampled(plan, input_ids)
        bs = plan.batch_size
        sampled = SampleResult(out.tokens[:bs], out.logprobs[:bs], None, None)
        if not to_host:
            return StepHandle(plan, sampled, None, None)
        free = self._pinned.setdefault(bucket, [])
        host = free.pop() if free else torch.empty(out.packed.shape, dtype=out.packed.dtype, pin_memory=True)
        host.copy_(out.packed, non_blocking=True)
        return StepHandle(plan, sampled, host, self._record(), bucket)

    def _record(self) -> torch.cuda.Event:
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record()
        return event

    def collect(self, handle: StepHandle) -> StepOutput:
        """Wait for a launched step (the step's one host sync) and unpack it."""
        if handle.event is not None:
            handle.event.synchronize()
            self._events.append(handle.event)
        if handle.bucket:  # the tail's rows, `bucket` apart, copied out of the pooled buffer before it goes back
            packed = handle.host.numpy().copy()
            self._pinned[handle.bucket].append(handle.host)
            return self._unpack(handle.plan, handle.sampled, packed, stride=handle.bucket)
        return self._unpack(handle.plan, handle.sampled, None if handle.host is None else handle.host.numpy())

    def routes_of(self, slot_lists: list[np.ndarray]) -> list[RoutesPart]:
        """The routing recorded in each list's KV slots, copied to the host
        (in one copy) after every step launched so far (routing capture must
        be on)."""
        return RoutesCopy(self.kv_pool.routes, slot_lists).parts()

    def settle(self) -> None:
        """Wait until every step launched here has finished on the device."""
        if self.device.type == "cuda":
            with DEVICE_WIDE:
                torch.cuda.synchronize(self.device)

    def run(self, plan: StepPlan, prev: StepHandle | None = None) -> tuple[StepOutput, StepHandle]:
        """Launch and collect one plan (the handle feeds a next plan's `prev`)."""
        handle = self.launch(plan, prev)
        return self.collect(handle), handle

    def _forward_eager(self, plan: StepPlan, prev: StepHandle | None) -> torch.Tensor:
        """The hidden states of a step run outside the decode graphs, with its
        padding rows (`forward_batch.padded_tokens`) at the end: through the
        prompt graphs (`runner/prompt_graphs.py`) where they were captured
        and hold the step, else eagerly."""
        n = plan.num_tokens
        prompt = self.graphs.prompt if self.graphs is not None and n > 1 else None
        bucket = prompt.bucket(n) if prompt is not None and prompt.captured else None
        pad = bucket - n if bucket is not None else self._padding(n)
        fb = ForwardBatch.from_plan(plan, self.table, self.kv_pool, self.backend, self.device, pad)
        if plan.prev_rows is not None:
            fb.input_ids = self._inputs_from_prev(plan, prev, fb.input_ids)
        with use_counters(self.gemm_counters):
            if bucket is not None:  # through the graphs cut at attention; the LM head on padded_tokens(n) rows
                return prompt.run(fb, bucket)[: padded_tokens(n)]
            return self.model(fb.input_ids, fb.positions, fb)

    def _padding(self, n: int) -> int:
        """Padding rows for an eager step of `n` tokens (`pads_eager`)."""
        return padded_tokens(n) - n if self.pads_eager else 0

    def _logits(self, plan: StepPlan, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [len(plan.logit_rows), vocab] of the plan's logit rows. Off
        the graphs the LM head runs on a padded row count, as the eager
        step's products do: every row of `hidden` (padding rows included)
        when every row has logits, else the logit rows with row 0 repeated."""
        n = len(plan.logit_rows)
        if plan.logits_for_all_rows:
            logits = self.model.compute_logits(hidden)
            return logits if logits.shape[0] == n else logits[:n]
        rows = np.asarray(plan.logit_rows, dtype=np.int64)
        pad = self._padding(n)
        if pad:
            rows = np.concatenate([rows, np.zeros(pad, dtype=np.int64)])
        logits = self.model.compute_logits(hidden[self._on_device(rows)])
        return logits[:n] if pad else logits

    def _inputs_from_prev(self, plan: StepPlan, prev: StepHandle | None,
                          ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The plan's input ids on the device with the previous step's sampled
        tokens in place (`plan.prev_rows`). `ids`: the step's input ids on the
        device already (with any padding rows), written in place and
        returned; a plan that reads no tokens returns `ids` as given (None
        when none was)."""
        rows = plan.prev_rows
        if rows is None:
            return ids
        if plan.is_decode and len(rows) and (rows >= 0).all():  # a decode step: every input from the step before
            first = int(rows[0])
            if rows[-1] - first == len(rows) - 1 and (np.diff(rows) == 1).all():  # rows in order: a view
                tokens = prev.sampled.tokens[first: first + len(rows)]
            else:
                tokens = prev.sampled.tokens[self._on_device(rows)]
            if ids is None or ids.shape[0] == len(rows):
                return tokens
            ids[: len(rows)] = tokens
            return ids
        reads = rows >= 0
        last_token = np.cumsum(plan.extend_lens) - 1
        if ids is None:
            ids = self._on_device(plan.input_ids)
        ids[self._on_device(last_token[reads])] = prev.sampled.tokens[self._on_device(rows[reads])]
        return ids

    def _sample(self, plan: StepPlan, logits: torch.Tensor):
        pieces: list[torch.Tensor] = []
        sampled = None
        if plan.sampling is not None:
            rows = logits if plan.samples_every_logit_row else logits[self._on_device(plan.sample_rows)]
            if self.batch_invariant and not use_kernel(rows):
                sampled = sample_per_row(rows, plan.sampling, self.device)
            elif self.batch_invariant:  # per-row kernels: the whole batch at once
                sampled = sample(rows, SamplingBatch.build(plan.sampling, self.device), INVARIANT_ROWS)
            else:
                sampled = sample(rows, SamplingBatch.build(plan.sampling, self.device))
            pieces += [sampled.tokens, sampled.logprobs]
            if sampled.top_ids is not None:
                pieces += [sampled.top_ids, sampled.top_logprobs]
        if len(plan.prompt_rows):
            prompt_logits = logits[self._on_device(plan.prompt_rows)]
            targets = self._on_device(plan.prompt_targets)
            if plan.prompt_sampling is not None:  # some request scores its prompt under its sampling parameters
                pieces.append(self._score_processed(prompt_logits, targets, plan.prompt_sampling))
            elif self.batch_invariant:  # row by row, by the sampler's own formula: the bits of a sampled token's
                pieces.append(raw_logprobs_per_row(prompt_logits, targets))  # raw logprob
            else:
                lps = torch.log_softmax(prompt_logits, dim=-1)
                pieces.append(lps.gather(-1, targets[:, None]).squeeze(1))
        return sampled, pack(pieces)

    def _score_processed(self, logits: torch.Tensor, targets: torch.Tensor, sp: SamplingPlan) -> torch.Tensor:
        """Prompt logprobs in each row's mode, SCORE_ROWS rows at a time (a
        [rows, vocab] distribution per block); in deterministic mode one row
        at a time on the CPU, per-row kernels on the GPU."""
        per_row = self.batch_invariant and not use_kernel(logits)
        ops = INVARIANT_ROWS if self.batch_invariant and not per_row else TORCH_ROWS
        step = 1 if per_row else SCORE_ROWS
        parts = [score(logits[a: a + step], targets[a: a + step], SamplingBatch.build(sp.rows(a, a + step), self.device),
                       ops) for a in range(0, len(logits), step)]
        return torch.cat(parts)

    def _on_device(self, values) -> torch.Tensor:
        """An index tensor on the device without waiting for the device
        (`torch.tensor(..., device="cuda")` would synchronise)."""
        return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(self.device, non_blocking=True)

    @staticmethod
    def _unpack(plan: StepPlan, sampled, host: np.ndarray | None, stride: int | None = None) -> StepOutput:
        """`host`: the step's tokens, logprobs, top logprobs and prompt
        logprobs end to end (`pack`); `stride`: where the logprobs start when
        the tokens fill more than the plan's rows (a graph tail's bucket)."""
        n = len(plan.sampling) if plan.sampling is not None else 0
        empty = np.zeros(0)
        if host is None:
            return StepOutput(empty.astype(np.int64), empty, None, None, empty)
        stride = n if stride is None else stride
        tokens, lps = host[:n].astype(np.int64), host[stride: stride + n]
        at = 2 * stride
        top_ids = top_lps = None
        k = sampled.top_ids.shape[1] if sampled is not None and sampled.top_ids is not None else 0
        if k:
            top_ids = host[at: at + n * k].reshape(n, k).astype(np.int64)
            top_lps = host[at + n * k: at + 2 * n * k].reshape(n, k)
            at += 2 * n * k
        return StepOutput(tokens, lps, top_ids, top_lps, host[at:])
