"""Batch (live requests) -> StepPlan (plain data), and StepOutput -> one
result per scheduled sequence. The only place where what the runner computes
is read off Requests."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.plan import SamplingPlan, StepOutput, StepPlan
from rollout_engine.request import Request
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.batch import Batch


@dataclass(slots=True)
class SeqResult:
    token: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[float] | None = None
    fork_results: list["SeqResult"] | None = None  # one per fork sibling, same logits row


NO_RESULT = SeqResult()  # a sequence that neither sampled nor scored prompt tokens (shared: never written)


@dataclass
class PlanIndex:
    """Where a plan's rows come from, kept on the scheduler's side."""

    sample_seq: list[int] = field(default_factory=list)  # batch index of each leader's sampling row
    sample_reqs: list[Request] = field(default_factory=list)  # per sampling row: leaders, then fork siblings
    forks: list[tuple[int, int]] = field(default_factory=list)  # (batch index of the leader, sampling row)
    prompt: list[tuple[int, int]] = field(default_factory=list)  # (batch index, number of prompt rows)


def build_plan(batch: Batch, table: ReqToTokenTable, prev: PlanIndex | None = None,
               shares: bool = False) -> tuple[StepPlan, PlanIndex]:
    """The plan of `batch`. With `prev` (the plan of the step still running
    when `batch` was scheduled), the requests that sample in `prev` take the
    tokens `prev` is sampling as their inputs. `shares`: a decode plan names
    the sequences holding the same prefix (`shared_prefixes`)."""
    fast = _decode_plan(batch, table, prev, shares)
    if fast is not None:
        return fast
    index = PlanIndex()
    logit_rows: list[int] = []
    sample_rows: list[int] = []
    prompt_rows: list[int] = []
    targets: list[int] = []
    prompt_reqs: list[tuple[Request, int]] = []  # (request, prompt rows) in row order
    offset = 0
    for i, s in enumerate(batch.seqs):
        num_prompt = s.prompt_logprob_end - s.start
        if num_prompt > 0:
            index.prompt.append((i, num_prompt))
            prompt_rows.extend(range(len(logit_rows), len(logit_rows) + num_prompt))
            logit_rows.extend(range(offset, offset + num_prompt))
            targets.extend(s.req.tokens(s.start + 1, s.prompt_logprob_end + 1))
            prompt_reqs.append((s.req, num_prompt))
        if s.samples:
            index.sample_seq.append(i)
            index.sample_reqs.append(s.req)
            sample_rows.append(len(logit_rows))
            logit_rows.append(offset + s.extend_len - 1)
        offset += s.extend_len
    # Fork siblings sample from their leader's row, with their own seeds.
    for j, i in enumerate(list(index.sample_seq)):
        for sib in batch.seqs[i].req.fork_siblings:
            index.forks.append((i, len(index.sample_reqs)))
            sample_rows.append(sample_rows[j])
            index.sample_reqs.append(sib)
    prev_rows = _prev_rows(batch, prev)
    n = len(batch.seqs)
    i64 = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    plan = StepPlan(
        input_ids=batch.input_ids(), positions=batch.positions(), out_cache_loc=batch.out_cache_loc(),
        extend_lens=np.fromiter((s.extend_len for s in batch.seqs), dtype=np.int64, count=n),
        seq_lens=np.fromiter((s.end for s in batch.seqs), dtype=np.int64, count=n),
        rows=np.fromiter((s.req.row for s in batch.seqs), dtype=np.int64, count=n),
        prev_rows=prev_rows, table_writes=table.drain_writes(),
        logit_rows=i64(logit_rows), sample_rows=i64(sample_rows), prompt_rows=i64(prompt_rows),
        prompt_targets=i64(targets), sampling=_sampling(index.sample_reqs),
        is_decode=batch.is_decode, prompt_sampling=_prompt_sampling(prompt_reqs))
    if shares and batch.is_decode:
        plan.share_keys, plan.share_lens = shared_prefixes([s.req for s in batch.seqs])
    return plan, index


def shared_prefixes(reqs: list[Request]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The plan's `share_keys` and `share_lens` for these sequences: those
    holding the same prefix-cache node hold the same KV slots over the
    tokens it covers (their table rows start with the node's path); (None,
    None) when no two hold the same node."""
    nodes = [id(r.cache_node) if r.cache_node is not None else -1 for r in reqs]
    held = [n for n in nodes if n != -1]
    if len(set(held)) == len(held):
        return None, None
    return (np.array(nodes, dtype=np.int64),
            np.fromiter((r.locked_len if r.cache_node is not None else 0 for r in reqs), dtype=np.int64,
                        count=len(reqs)))


def _prev_rows(batch: Batch, prev: PlanIndex | None) -> np.ndarray | None:
    """Per sequence, the sampling row of `prev` whose token is its last input
    (a request that samples in `prev` decodes that token next), or -1 where
    the input is known; None when no sequence reads `prev`'s tokens."""
    if prev is None or not prev.sample_reqs:
        return None
    where = {id(r): j for j, r in enumerate(prev.sample_reqs)}
    rows = np.fromiter((where.get(id(s.req), -1) for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
    return rows if (rows >= 0).any() else None


def _decode_plan(batch: Batch, table: ReqToTokenTable, prev: PlanIndex | None,
                 shares: bool = False) -> tuple[StepPlan, PlanIndex] | None:
    """`build_plan` for the common step, in one pass over the batch: every
    sequence extends by one token and samples the next (no prompt rows, no
    fork siblings). None for any other batch."""
    seqs = batch.seqs
    n = len(seqs)
    reqs, tokens, starts, slots, rows = [], [], [], [], []
    for s in seqs:
        req = s.req
        if s.extend_len != 1 or not s.samples or req.fork_siblings:
            return None
        reqs.append(req)
        tokens.append(req.token_at(s.start))
        starts.append(s.start)
        slots.append(s.slots[0])
        rows.append(req.row)
    if not n:
        return None
    i64 = np.int64
    positions = np.array(starts, dtype=i64)
    every = np.arange(n, dtype=i64)
    empty = np.zeros(0, dtype=i64)
    plan = StepPlan(
        input_ids=np.array(tokens, dtype=i64), positions=positions, out_cache_loc=np.array(slots, dtype=i64),
        extend_lens=np.ones(n, dtype=i64), seq_lens=positions + 1, rows=np.array(rows, dtype=i64),
        prev_rows=_prev_rows(batch, prev), table_writes=table.drain_writes(), logit_rows=every, sample_rows=every,
        prompt_rows=empty, prompt_targets=empty, sampling=_sampling(reqs), is_decode=True)
    if shares:
        plan.share_keys, plan.share_lens = shared_prefixes(reqs)
    return plan, PlanIndex(sample_seq=list(range(n)), sample_reqs=reqs)


def _sampling(reqs: list[Request]) -> SamplingPlan | None:
    if not reqs:
        return None
    return sampling_plan([r.params for r in reqs], [r.seed for r in reqs], [r.seq_len for r in reqs])


def _prompt_sampling(prompt_reqs: list[tuple[Request, int]]) -> SamplingPlan | None:
    """Each prompt row's parameters, when any of them is processed (else
    None: every prompt row is raw, the common case)."""
    if not any(r.params.prompt_logprob_mode == "processed" for r, _ in prompt_reqs):
        return None
    params = [r.params for r, num in prompt_reqs for _ in range(num)]
    plan = sampling_plan(params, [0] * len(params), [0] * len(params))
    plan.raw_logprobs = np.array([p.prompt_logprob_mode == "raw" for p in params], dtype=bool)
    return plan


def sampling_plan(params: list[SamplingParams], seeds: list[int], positions: list[int]) -> SamplingPlan:
    cols = np.array([p.plan_row for p in params], dtype=np.float64).reshape(len(params), 6).T
    return SamplingPlan(
        temperatures=cols[0].astype(np.float32), top_ps=cols[1].astype(np.float32),
        min_ps=cols[2].astype(np.float32), top_ks=cols[3].astype(np.int64),
        seeds=np.array(seeds, dtype=np.int64), positions=np.array(positions, dtype=np.int64),
        raw_logprobs=cols[4].astype(bool), top_logprobs=cols[5].astype(np.int64))


def seq_results(num_seqs: int, index: PlanIndex, out: StepOutput) -> list[SeqResult]:
    """One result per scheduled sequence (fork siblings' under their leader's)."""
    results = [NO_RESULT] * num_seqs
    tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()
    sampled = []
    for j, req in enumerate(index.sample_reqs):
        res = SeqResult(tokens[j], logprobs[j])
        want = req.params.top_logprobs
        if want:
            res.top_logprobs = list(zip(out.top_ids[j, :want].tolist(), out.top_logprobs[j, :want].tolist()))
        sampled.append(res)
    for j, i in enumerate(index.sample_seq):
        results[i] = sampled[j]
    for i, j in index.forks:
        results[i].fork_results = (results[i].fork_results or []) + [sampled[j]]
    at = 0
    for i, num in index.prompt:
        if results[i] is NO_RESULT:
            results[i] = SeqResult()
        results[i].prompt_logprobs = out.prompt_logprobs[at: at + num].tolist()
        at += num
    return results
