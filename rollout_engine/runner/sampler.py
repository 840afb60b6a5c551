"""Batched sampling on the device: temperature, top-k, top-p, min-p, greedy,
with per-request seeds and logprobs.

Randomness: each row draws one uniform number from a hash of (seed, position
of the token being sampled) and inverts the CDF of its processed
distribution. The draw depends on nothing else in the batch, so a seeded
request reproduces whatever it is batched with, and a request resumed after
preemption samples the same tokens. Everything is tensor ops on the device
(no host RNG), so it can run inside a CUDA graph. On CUDA, a step whose rows
sample at a temperature without filters or top logprobs takes two fused
kernels instead (kernels/draw.py: no [B, V] tables written). Deterministic
mode keeps the general path for every row (a row's path must not depend on
its neighbours) and inverts its processed table with the same chunked
kernels, whose sums are fixed by the vocabulary alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.host_block import BlockLayout
from rollout_engine.kernels.draw import draw_from_weights, sample_rows
from rollout_engine.kernels.greedy import argmax_logsumexp, argmax_logsumexp_ref
from rollout_engine.kernels.row_scan import row_cumsum
from rollout_engine.plan import SamplingPlan

_MASK32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**31, so products of 32-bit values fit in int64


def _hash32(x: np.ndarray) -> np.ndarray:
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    x = (((x >> 16) ^ x) * _HASH_MUL) & _MASK32
    return (x >> 16) ^ x


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One float64 in (0, 1) per row, a pure function of (seed, position):
    int64 arrays in, computed on the host when the step's sampling inputs
    are built (a few microseconds, against a dozen small device kernels)."""
    seeds, positions = np.asarray(seeds, dtype=np.int64), np.asarray(positions, dtype=np.int64)
    h = _hash32(_hash32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    h = _hash32(h ^ (positions & _MASK32))
    h = _hash32(h ^ 0x2545F491)
    return (h.astype(np.float64) + 0.5) / 4294967296.0


def plan_uniforms(plan: SamplingPlan) -> np.ndarray:
    """Each row's draw (`seeded_uniform`); zeros when every row is greedy."""
    return np.zeros(len(plan)) if plan.all_greedy else seeded_uniform(plan.seeds, plan.positions)


def pack(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces flattened end to end into one float64 tensor, for one copy
    to the host (one copy each: on the GPU every launch is host time a small
    step waits on)."""
    out = torch.empty(sum(p.numel() for p in pieces), dtype=torch.float64, device=pieces[0].device)
    at = 0
    for p in pieces:
        out[at: at + p.numel()].copy_(p.reshape(-1))
        at += p.numel()
    return out


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor  # [B] float32; 0 = greedy
    top_ks: torch.Tensor  # [B] int64; 0 = off
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: position of the token being sampled
    uniforms: torch.Tensor  # [B] float64: seeded_uniform(seeds, positions), each row's draw
    raw_logprobs: torch.Tensor  # [B] bool: logprob_mode == "raw"
    use_sort_filters: bool
    use_min_p: bool
    all_greedy: bool
    max_top_logprobs: int
    unit_temperature: bool = False  # every row at temperature 0 or 1: softmax(logits / T) is softmax(logits)

    @staticmethod
    def build(plan: SamplingPlan, device: torch.device, max_top_logprobs: int | None = None) -> "SamplingBatch":
        # One copy, no conversion on the device (`host_block`): each would be a
        # driver call on the host's side of the step.
        n = len(plan)
        uniforms = plan_uniforms(plan)
        layout = BlockLayout((np.int64,) * 3 + (np.float64,) + (np.float32,) * 3 + (np.bool_,), (n,) * 8)
        top_ks, seeds, positions, uniforms, temperatures, top_ps, min_ps, raw = layout.upload(
            (plan.top_ks, plan.seeds, plan.positions, uniforms, plan.temperatures, plan.top_ps, plan.min_ps,
             plan.raw_logprobs), device)
        return SamplingBatch(
            temperatures=temperatures, top_ps=top_ps, min_ps=min_ps, top_ks=top_ks, seeds=seeds, positions=positions,
            uniforms=uniforms, raw_logprobs=raw,
            use_sort_filters=plan.use_sort_filters, use_min_p=plan.use_min_p, all_greedy=plan.all_greedy,
            max_top_logprobs=plan.max_top_logprobs if max_top_logprobs is None else max_top_logprobs,
            unit_temperature=bool(np.isin(plan.temperatures, (0.0, 1.0)).all()),
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, in each row's logprob mode
    top_ids: torch.Tensor | None  # [B, k]
    top_logprobs: torch.Tensor | None  # [B, k]


class RowOps:
    """The row reductions of sampling: torch's (fast; a row's bits can
    depend on the batch's shape) or, with `invariant`, per-row kernels whose
    bits do not (deterministic mode on the GPU)."""

    def __init__(self, invariant: bool = False):
        self.invariant = invariant

    def softmax(self, z: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
        """Row softmax; `lse`, the rows' log-sum-exp of z if already known
        (invariant ops: argmax_logsumexp's, which they would compute)."""
        if not self.invariant:
            return torch.softmax(z, dim=-1)
        if lse is None:
            _, _, lse = argmax_logsumexp(z)
        return torch.exp(z - lse[:, None])

    def cumsum(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.invariant:
            return x.cumsum(dim=-1, dtype=dtype)
        return row_cumsum(x, dtype)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B, 1]."""
        if not self.invariant:
            return x.sum(dim=-1, keepdim=True)
        return row_cumsum(x)[:, -1:]


TORCH_ROWS = RowOps()
INVARIANT_ROWS = RowOps(invariant=True)


def processed_probs(logits: torch.Tensor, sb: SamplingBatch, ops: RowOps = TORCH_ROWS,
                    log_norm: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution each row samples from: softmax at its temperature (1
    for greedy rows), then top-k, top-p (over the top-k mass) and min-p,
    renormalised. Filtered tokens have probability exactly 0. `log_norm`:
    the logits' log-sum-exp from argmax_logsumexp; with invariant ops and
    every temperature 0 or 1 it is the softmax's own (logits / 1 are the
    logits, bit for bit), so the softmax takes one pass, not three."""
    if ops.invariant and sb.unit_temperature and log_norm is not None:
        probs = ops.softmax(logits, log_norm)
    else:
        temps = torch.where(sb.temperatures > 0, sb.temperatures, torch.ones_like(sb.temperatures))
        probs = ops.softmax(logits / temps[:, None])
    keep = None
    # The batch's flags say whether any row filters; a row that does not
    # keeps its softmax untouched (not renormalised, no tail token dropped
    # by rounding), so its bits do not depend on its neighbours' filters.
    if sb.use_sort_filters:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        keep_sorted = (rank < sb.top_ks[:, None]) | (sb.top_ks[:, None] == 0)
        kept_p = sorted_p * keep_sorted
        cum = ops.cumsum(kept_p)
        mass_before = (cum - kept_p) / cum[:, -1:]
        keep_sorted &= mass_before < sb.top_ps[:, None]
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    if sb.use_min_p:
        above = probs >= sb.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        keep = above if keep is None else keep & above
    if keep is not None:
        filtered = filters_of(sb)[:, None]
        kept = probs * keep
        probs = torch.where(filtered, kept / ops.sum(kept), probs)
    return probs


def filters_of(sb: SamplingBatch) -> torch.Tensor:
    """[B] bool: rows with top-k, top-p or min-p."""
    return (sb.top_ks > 0) | (sb.top_ps < 1.0) | (sb.min_ps > 0)


def sample(logits: torch.Tensor, sb: SamplingBatch, ops: RowOps = TORCH_ROWS) -> SampleResult:
    """logits: [B, V] float32. Full [B, V] logprob tables are built only when
    top logprobs are asked for; otherwise only the chosen tokens' logprobs.
    With invariant row ops (GPU only) a row's results do not depend on the
    batch."""
    if use_kernel(logits):
        greedy_tokens, row_max, log_norm = argmax_logsumexp(logits)
        if _fused_draw_applies(sb, ops):
            return _sample_fused(logits, sb, greedy_tokens, row_max, log_norm)
    else:
        greedy_tokens, row_max, log_norm = argmax_logsumexp_ref(logits)
    needs_processed = not sb.all_greedy or sb.use_sort_filters or sb.use_min_p
    probs = processed_probs(logits, sb, ops, log_norm) if needs_processed else None
    if sb.all_greedy:
        tokens = greedy_tokens
    elif ops.invariant and use_kernel(probs):  # chunk sums fixed by V: no float64 prefix sum, no search
        drawn = draw_from_weights(probs, sb.uniforms, greedy_tokens)
        tokens = torch.where(sb.temperatures > 0, drawn, greedy_tokens)
    else:
        cdf = ops.cumsum(probs, torch.float64)
        target = sb.uniforms * cdf[:, -1]
        drawn = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
        drawn = drawn.clamp_(max=logits.shape[-1] - 1)
        # Rounding at the very top of the CDF must not pick a filtered token.
        drawn = torch.where(probs.gather(-1, drawn[:, None]).squeeze(1) > 0, drawn, probs.argmax(dim=-1))
        tokens = torch.where(sb.temperatures > 0, drawn, greedy_tokens)
    # Greedy rows without filters sample from the raw distribution at
    # temperature 1: their processed logprobs are the raw ones, computed as
    # raw ones whatever else the batch holds.
    plain = (sb.temperatures == 0) & ~filters_of(sb)
    if probs is None and sb.all_greedy:  # every token is its row's argmax; raw == processed
        logprobs = row_max - log_norm
    else:
        logprobs = _logprobs_of(logits, tokens, log_norm, probs, sb.raw_logprobs | plain)
    top_ids = top_lps = None
    if sb.max_top_logprobs:
        raw_table = logits - log_norm[:, None]
        table = raw_table if probs is None else torch.where((sb.raw_logprobs | plain)[:, None], raw_table,
                                                            torch.log(probs))
        top_lps, top_ids = table.topk(min(sb.max_top_logprobs, logits.shape[-1]), dim=-1)
    return SampleResult(tokens, logprobs, top_ids, top_lps)


def _fused_draw_applies(sb: SamplingBatch, ops: RowOps) -> bool:
    """Rows that sample at a temperature and none that filters or asks for
    top logprobs: the draw kernels (kernels/draw.py) take the whole step.
    Not in deterministic mode, whose row operations are fixed separately."""
    return not (ops.invariant or sb.all_greedy or sb.use_sort_filters or sb.use_min_p or sb.max_top_logprobs)


def _sample_fused(logits, sb: SamplingBatch, greedy_tokens, row_max, log_norm) -> SampleResult:
    """Greedy rows (no filters here) keep their argmax and report raw
    logprobs, as in `sample`; two launches in all (`kernels.draw.sample_rows`)."""
    tokens, logprobs = sample_rows(logits, sb.temperatures, row_max, log_norm, greedy_tokens, sb.uniforms,
                                   sb.raw_logprobs)
    return SampleResult(tokens, logprobs, None, None)


def _logprobs_of(logits, tokens, log_norm, probs, raw_rows) -> torch.Tensor:
    """Each row's logprob of `tokens`: raw where `raw_rows`, else from `probs`."""
    raw = logits.gather(-1, tokens[:, None]).squeeze(1) - log_norm
    processed = raw if probs is None else torch.log(probs.gather(-1, tokens[:, None]).squeeze(1))
    return torch.where(raw_rows, raw, processed)


def score(logits: torch.Tensor, targets: torch.Tensor, sb: SamplingBatch, ops: RowOps = TORCH_ROWS) -> torch.Tensor:
    """Each row's logprob of its target token in the row's logprob mode,
    computed as `sample` computes a sampled token's (processed prompt
    logprobs: a scored token equals the same token sampled there, bit for
    bit, in deterministic mode)."""
    _, _, log_norm = argmax_logsumexp(logits) if use_kernel(logits) else argmax_logsumexp_ref(logits)
    plain = (sb.temperatures == 0) & ~filters_of(sb)
    return _logprobs_of(logits, targets, log_norm, processed_probs(logits, sb, ops, log_norm), sb.raw_logprobs | plain)


def sample_per_row(logits: torch.Tensor, plan: SamplingPlan, device: torch.device) -> SampleResult:
    """`sample`, one row at a time (deterministic mode): each row's filters,
    reductions and draw see only that row, whatever else is in the batch."""
    k = plan.max_top_logprobs
    results = [sample(logits[i: i + 1], SamplingBatch.build(plan.row(i), device, k)) for i in range(len(plan))]
    cat = lambda name: None if getattr(results[0], name) is None else torch.cat([getattr(r, name) for r in results])  # noqa: E731
    return SampleResult(cat("tokens"), cat("logprobs"), cat("top_ids"), cat("top_logprobs"))


def raw_logprobs_per_row(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's raw logprob of its target, row by row, computed as `sample`
    computes a sampled token's raw logprob (deterministic mode: a prompt
    position scored equals the same token sampled there, bit for bit)."""
    if use_kernel(logits):  # one program per row already: the batch changes nothing
        _, _, log_norm = argmax_logsumexp(logits)
        return logits.gather(-1, targets[:, None]).squeeze(1) - log_norm
    out = []
    for i in range(logits.shape[0]):
        row = logits[i: i + 1]
        _, _, log_norm = argmax_logsumexp_ref(row)
        out.append(row.gather(-1, targets[i: i + 1, None]).squeeze(1) - log_norm)
    return torch.cat(out) if out else logits.new_zeros(0)
