"""Batch -> forward -> logits -> sampled tokens and logprobs.

Logits are computed only for the rows that need them: the last new token of
each sequence that samples, plus every prompt position of a request that
asked for prompt logprobs. All results come back to the host in one copy,
the step's single device sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollout_engine.attention.base import AttentionBackend
from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.models.decoder import DecoderForCausalLM
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.runner.forward_batch import DeviceTable, ForwardBatch
from rollout_engine.runner.sampler import SamplingBatch, sample
from rollout_engine.scheduler.batch import Batch
from rollout_engine.scheduler.scheduler import SeqResult


class LogitRows:
    """Which hidden rows need logits, and what each one is for."""

    def __init__(self, batch: Batch):
        rows: list[int] = []
        self.sample_pos: list[int] = []  # index into rows, per sampled request
        self.sample_seq: list[int] = []  # batch index of each sampling sequence
        self.sample_reqs: list = []  # the sampling requests, then every fork sibling
        self.prompt: list[tuple[int, int, int]] = []  # (seq index, first row, number of rows)
        targets: list[int] = []
        offset = 0
        for i, s in enumerate(batch.seqs):
            num_prompt = s.prompt_logprob_end - s.start
            if num_prompt > 0:
                self.prompt.append((i, len(rows), num_prompt))
                rows.extend(range(offset, offset + num_prompt))
                targets.extend(s.req.tokens(s.start + 1, s.prompt_logprob_end + 1))
            if s.samples:
                self.sample_seq.append(i)
                self.sample_pos.append(len(rows))
                self.sample_reqs.append(s.req)
                rows.append(offset + s.extend_len - 1)
            offset += s.extend_len
        # Fork siblings sample from their leader's row, with their own seeds.
        self.forks: list[tuple[int, int]] = []  # (batch index of the leader, sampled index)
        for j, i in enumerate(list(self.sample_seq)):
            for sib in batch.seqs[i].req.fork_siblings:
                self.forks.append((i, len(self.sample_reqs)))
                self.sample_pos.append(self.sample_pos[j])
                self.sample_reqs.append(sib)
        self.rows = rows
        self.targets = targets
        self.all_rows = rows == list(range(offset))


@dataclass
class StepHandle:
    """A launched step: its results are on their way to `host`."""

    batch: Batch
    sel: LogitRows
    sampled: Any
    host: torch.Tensor | None
    event: Any


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_pool: KVPool, backend: AttentionBackend,
                 table: ReqToTokenTable, device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.backend = backend
        self.table = table
        self.device = device
        self.device_table = DeviceTable(table, device) if backend.needs_device_table else None
        self.graphs = None  # a CudaGraphRunner once captured

    def capture_cuda_graphs(self, max_bs: int, capture_context) -> None:
        from rollout_engine.runner.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_pool, self.table, self.device_table,
                                      max_bs, self.device, capture_context)
        self.graphs.capture()

    @torch.inference_mode()
    def launch(self, batch: Batch, prev: "StepHandle | None" = None) -> "StepHandle":
        """Enqueue the step on the device and start copying its results to
        the host; returns at once. With `prev`, each sequence's input token is
        the one `prev` sampled for the same request (still on the device)."""
        if self.device_table is not None:
            self.device_table.sync()
        sel = LogitRows(batch)
        input_ids = self._tokens_from(prev, batch) if prev is not None else None
        if self.graphs is not None and sel.all_rows and self.graphs.can_run(batch):
            hidden = self.graphs.replay(batch, input_ids)
        else:
            fb = ForwardBatch.from_batch(batch, self.table, self.device_table, self.kv_pool, self.backend,
                                         self.device)
            if input_ids is not None:
                fb.input_ids = input_ids
            hidden = self.model(fb.input_ids, fb.positions, fb)
        if not sel.rows:
            return StepHandle(batch, sel, None, None, None)
        if not sel.all_rows:
            hidden = hidden[self._on_device(sel.rows)]
        logits = self.model.compute_logits(hidden)
        sampled, device_out = self._sample(batch, sel, logits)
        if device_out.is_cuda:
            host = torch.empty(device_out.shape, dtype=device_out.dtype, pin_memory=True)
            host.copy_(device_out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = device_out, None
        return StepHandle(batch, sel, sampled, host, event)

    def collect(self, handle: "StepHandle") -> list[SeqResult]:
        """Wait for a launched step (the step's one host sync) and unpack it."""
        if handle.host is None:
            return [SeqResult() for _ in handle.batch.seqs]
        if handle.event is not None:
            handle.event.synchronize()
        return self._unpack(handle.batch, handle.sel, handle.sampled, handle.host.numpy())

    def _tokens_from(self, prev: "StepHandle", batch: Batch) -> torch.Tensor:
        where = {id(r): j for j, r in enumerate(prev.sel.sample_reqs)}
        return prev.sampled.tokens[self._on_device([where[id(s.req)] for s in batch.seqs])]

    def _sample(self, batch: Batch, sel: LogitRows, logits: torch.Tensor):
        pieces: list[torch.Tensor] = []
        sampled = None
        if sel.sample_seq:
            reqs = sel.sample_reqs
            sb = SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs],
                                     [r.seq_len for r in reqs], self.device)
            direct = sel.sample_pos == list(range(logits.shape[0]))
            sampled = sample(logits if direct else logits[self._on_device(sel.sample_pos)], sb)
            pieces += [sampled.tokens.double(), sampled.logprobs.double()]
            if sampled.top_ids is not None:
                pieces += [sampled.top_ids.double().flatten(), sampled.top_logprobs.double().flatten()]
        if sel.prompt:
            prompt_rows = self._on_device([r for _, r0, n in sel.prompt for r in range(r0, r0 + n)])
            lps = torch.log_softmax(logits[prompt_rows], dim=-1)
            targets = self._on_device(sel.targets)
            pieces.append(lps.gather(-1, targets[:, None]).squeeze(1).double())
        return sampled, torch.cat(pieces)

    def _on_device(self, values: list[int]) -> torch.Tensor:
        """An index tensor on the device without waiting for the device
        (`torch.tensor(..., device="cuda")` would synchronise)."""
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    @staticmethod
    def _unpack(batch: Batch, sel: LogitRows, sampled, host: np.ndarray) -> list[SeqResult]:
        results = [SeqResult() for _ in batch.seqs]
        n = len(sel.sample_reqs)
        at = 0
        if n:
            tokens, lps = host[:n].astype(np.int64), host[n: 2 * n]
            at = 2 * n
            k = sampled.top_ids.shape[1] if sampled.top_ids is not None else 0
            if k:
                top_ids = host[at: at + n * k].reshape(n, k).astype(np.int64)
                top_lps = host[at + n * k: at + 2 * n * k].reshape(n, k)
                at += 2 * n * k
            sampled_results = []
            for j, req in enumerate(sel.sample_reqs):
                res = SeqResult(token=int(tokens[j]), logprob=float(lps[j]))
                want = req.params.top_logprobs
                if want:
                    res.top_logprobs = [(int(t), float(v)) for t, v in zip(top_ids[j, :want], top_lps[j, :want])]
                sampled_results.append(res)
            for j, i in enumerate(sel.sample_seq):
                results[i] = sampled_results[j]
            for i, j in sel.forks:
                results[i].fork_results = (results[i].fork_results or []) + [sampled_results[j]]
        for i, _, num in sel.prompt:
            results[i].prompt_logprobs = host[at: at + num].tolist()
            at += num
        return results
