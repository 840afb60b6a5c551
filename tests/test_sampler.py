"""Sampling, tested statistically on fixed logits, plus seeds through the engine."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.scheduler.plan_builder import sampling_plan
from rollout_engine.kernels.draw import draw_ref
from rollout_engine.runner.sampler import RowOps, SamplingBatch, processed_probs, sample, seeded_uniform

V = 50
DRAWS = 4000


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 2.0


def _draw(params: SamplingParams, logits: torch.Tensor, draws: int = DRAWS):
    """Sample `draws` times from the same logits with different seeds."""
    sb = SamplingBatch.build(sampling_plan([params] * draws, list(range(draws)), [17] * draws), torch.device("cpu"))
    return sample(logits.expand(draws, V).contiguous(), sb), sb


def _support(params: SamplingParams, logits: torch.Tensor) -> set[int]:
    """The support by definition, computed independently of the sampler."""
    probs = torch.softmax(logits / (params.temperature or 1.0), -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[: params.top_k] if params.top_k > 0 else order
    kept_mass = probs[keep].sum()
    out, before = [], 0.0
    for t in keep:
        if before / kept_mass < params.top_p:
            out.append(t)
        before += probs[t].item()
    return {t for t in out if probs[t] >= params.min_p * probs.max()}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
])
def test_filters_never_leave_their_support(params):
    logits = _logits()
    result, _ = _draw(params, logits)
    support = _support(params, logits)
    drawn = set(result.tokens.tolist())
    assert drawn <= support
    assert len(drawn) == len(support)  # and every supported token shows up


def test_frequencies_follow_the_processed_distribution():
    logits = _logits(1)
    params = SamplingParams(temperature=0.8, top_k=8)
    result, sb = _draw(params, logits, draws=20000)
    probs = processed_probs(logits[None], SamplingBatch.build(sampling_plan([params], [0], [0]), torch.device("cpu")))[0]
    counts = torch.bincount(result.tokens, minlength=V).double() / 20000
    assert torch.allclose(counts, probs.double(), atol=0.015)


def test_processed_logprobs_are_log_of_renormalised_distribution():
    logits = _logits(2)
    params = SamplingParams(temperature=0.5, top_p=0.7)
    result, _ = _draw(params, logits, draws=200)
    probs = torch.softmax(logits / 0.5, -1)
    support = sorted(_support(params, logits))
    renorm = probs[support] / probs[support].sum()
    expected = {t: math.log(p) for t, p in zip(support, renorm.tolist())}
    for tok, lp in zip(result.tokens.tolist(), result.logprobs.tolist()):
        assert lp == pytest.approx(expected[tok], abs=1e-5)


def test_raw_logprobs_are_the_model_softmax():
    logits = _logits(3)
    result, _ = _draw(SamplingParams(temperature=0.5, top_k=3, logprob_mode="raw"), logits, draws=50)
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(result.logprobs, raw[result.tokens], atol=1e-6)


def test_low_temperature_equals_greedy():
    logits = _logits(4)
    cold, _ = _draw(SamplingParams(temperature=1e-4), logits, draws=500)
    greedy, _ = _draw(SamplingParams(temperature=0), logits, draws=5)
    assert set(cold.tokens.tolist()) == {int(logits.argmax())} == set(greedy.tokens.tolist())


def test_uniforms_depend_only_on_seed_and_position():
    seeds = np.array([1, 2, 3, 1])
    pos = np.array([10, 10, 10, 10])
    u = seeded_uniform(seeds, pos)
    assert u[0] == u[3] and len(set(u.tolist())) == 3
    assert ((u > 0) & (u < 1)).all()
    many = seeded_uniform(np.arange(100000), np.full(100000, 5))
    assert abs(many.mean() - 0.5) < 0.01  # roughly uniform
    # The stream is part of what a seed means: these values are fixed.
    top = seeded_uniform(np.array([0, 7, (1 << 63) - 1]), np.array([0, 123, (1 << 40) + 5]))
    assert top.tolist() == FIXED_UNIFORMS


FIXED_UNIFORMS = [0.744951528380625, 0.8509465359384194, 0.8883778561139479]  # as the device computed them before


def test_uniforms_reach_the_device_unchanged():
    """The float64 uniforms travel as int64 bits with the step's other
    integers: the device gets exactly the host's values."""
    plan = sampling_plan([SamplingParams(temperature=1.0)] * 3, [0, 7, (1 << 63) - 1], [0, 123, (1 << 40) + 5])
    sb = SamplingBatch.build(plan, torch.device("cpu"))
    assert sb.uniforms.dtype == torch.float64
    assert sb.uniforms.tolist() == seeded_uniform(plan.seeds, plan.positions).tolist()


def test_seeded_requests_reproduce_whatever_the_batch(llama):
    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    alone = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)[0]
    others = [SamplingParams(max_new_tokens=30, temperature=1.0)] * 5
    crowd = engine.generate(input_ids=[[1, 2]] * 5 + [[5, 6, 7]], sampling_params=others + [params])
    assert crowd[-1].output_token_ids == alone.output_token_ids
    other_seed = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_new_tokens=20, temperature=1.0, top_p=0.9, seed=99))[0]
    assert other_seed.output_token_ids != alone.output_token_ids
    # n samples of a seeded prompt use seed + i: sample 1 of seed s is sample 0 of seed s + 1.
    pair = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        n=2, max_new_tokens=20, temperature=1.0, top_p=0.9, seed=1233))
    assert pair[1].output_token_ids == alone.output_token_ids


def test_engine_seed_makes_unseeded_runs_repeatable(llama):
    _, folder = llama
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    a = RolloutEngine(folder, max_total_tokens=2048, seed=3).generate(input_ids=[[1, 2]] * 3, sampling_params=params)
    b = RolloutEngine(folder, max_total_tokens=2048, seed=3).generate(input_ids=[[1, 2]] * 3, sampling_params=params)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]


class _RowByRow(RowOps):
    """Row reductions computed one row at a time: invariant on the CPU, as
    the per-row kernels are on the GPU (deterministic mode's batched path)."""

    def __init__(self):
        super().__init__(invariant=False)

    def softmax(self, z):
        return torch.cat([torch.softmax(z[i: i + 1], dim=-1) for i in range(len(z))])

    def cumsum(self, x, dtype=None):
        return torch.cat([x[i: i + 1].cumsum(dim=-1, dtype=dtype) for i in range(len(x))])

    def sum(self, x):
        return torch.cat([x[i: i + 1].sum(dim=-1, keepdim=True) for i in range(len(x))])


@pytest.mark.parametrize("target", [SamplingParams(temperature=0, top_logprobs=3),
                                    SamplingParams(temperature=1.0, top_logprobs=3),
                                    SamplingParams(temperature=0.7, top_logprobs=3),
                                    SamplingParams(temperature=0.7, top_p=0.9, top_logprobs=3)])
def test_a_row_does_not_see_its_neighbours_filters(target):
    """With row-invariant reductions, a row's token, logprob and top
    logprobs are bitwise the same alone and next to rows that filter (top-k,
    top-p, min-p) or sample: the batch-wide flags must not renormalise,
    trim or re-derive a row that does not ask for it."""
    ops = _RowByRow()
    logits = torch.stack([_logits(s) for s in range(4)]) * 3

    def first(params):
        plan = sampling_plan(params, [5] * len(params), [9] * len(params))
        out = sample(logits[: len(params)], SamplingBatch.build(plan, torch.device("cpu")), ops)
        return out.tokens[0], out.logprobs[0], out.top_logprobs[0], out.top_ids[0]

    alone = first([target])
    for others in ([SamplingParams(temperature=0.7, top_p=0.8)], [SamplingParams(temperature=0, min_p=0.1)],
                   [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0)]):
        crowded = first([target] + others)
        assert all(torch.equal(a, b) for a, b in zip(alone, crowded)), (target, others)


def test_the_fused_draws_reference_samples_as_the_sampler_does():
    """kernels/draw.py's reference (what the CUDA kernels are checked
    against) draws the sampler's tokens with its logprobs, for rows at a
    temperature without filters."""
    rows = 400
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(rows, 3000, generator=g) * 3
    params = [SamplingParams(temperature=[0.6, 1.0, 1.4][i % 3]) for i in range(rows)]
    sb = SamplingBatch.build(sampling_plan(params, list(range(rows)), [9] * rows), torch.device("cpu"))
    general = sample(logits, sb)
    tokens, logprobs = draw_ref(logits, sb.temperatures, logits.max(-1).values, logits.argmax(-1), sb.uniforms)
    assert (tokens == general.tokens).float().mean() >= 0.995
    same = tokens == general.tokens
    assert torch.allclose(logprobs[same], general.logprobs[same], atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 8, 13])
def test_sampling_inputs_travel_in_one_block_unchanged(n):
    """SamplingBatch.build packs every per-row input into one block (one
    copy to the device): each field reads back exactly what the plan holds."""
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], top_p=0.5 + i / 100, min_p=i / 1000,
                             top_k=i % 4, logprob_mode=["raw", "processed"][i % 2]) for i in range(n)]
    seeds = [(i * 7919) << 33 | i for i in range(n)]
    plan = sampling_plan(params, seeds, [100 + i for i in range(n)])
    sb = SamplingBatch.build(plan, torch.device("cpu"))
    assert torch.equal(sb.temperatures, torch.from_numpy(plan.temperatures))
    assert torch.equal(sb.top_ps, torch.from_numpy(plan.top_ps))
    assert torch.equal(sb.min_ps, torch.from_numpy(plan.min_ps))
    assert torch.equal(sb.top_ks, torch.from_numpy(plan.top_ks))
    assert torch.equal(sb.seeds, torch.from_numpy(plan.seeds))
    assert torch.equal(sb.positions, torch.from_numpy(plan.positions))
    assert torch.equal(sb.raw_logprobs, torch.from_numpy(plan.raw_logprobs))
    expected = np.zeros(n) if plan.all_greedy else seeded_uniform(plan.seeds, plan.positions)
    assert torch.equal(sb.uniforms, torch.from_numpy(expected))
    assert sb.raw_logprobs.dtype == torch.bool and sb.temperatures.dtype == torch.float32
    # every field starts on a 16-byte boundary, as a fresh tensor does (Triton specializes its kernels on it)
    fields = (sb.temperatures, sb.top_ps, sb.min_ps, sb.top_ks, sb.seeds, sb.positions, sb.uniforms, sb.raw_logprobs)
    assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in fields)
