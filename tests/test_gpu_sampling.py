"""The fused draw kernels (temperature sampling without filters) against
their torch reference and the distribution they sample, at the vocabulary
sizes of real models; and the engine's sampled logprobs against a
forward-only score of the same tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_engine.kernels.draw import draw, draw_ref, sample_rows, sample_rows_ref
from rollout_engine.kernels.greedy import argmax_logsumexp
from rollout_engine.runner.sampler import SamplingBatch, sample, seeded_uniform
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.plan_builder import sampling_plan

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [151936, 128256, 32000, 50])
def test_draw_matches_its_reference(vocab):
    g = torch.Generator(device="cuda").manual_seed(vocab)
    rows = 512
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    logits[::7] *= 10  # peaked rows
    logits[1, : vocab // 2] = float("-inf")
    temps = torch.rand(rows, device="cuda", generator=g) * 1.5 + 0.05
    greedy, row_max, _ = argmax_logsumexp(logits)
    u = torch.from_numpy(seeded_uniform(np.arange(rows), np.full(rows, 11))).cuda()
    tokens, lps = draw(logits, temps, row_max, greedy, u)
    ref_tokens, ref_lps = draw_ref(logits, temps, row_max, greedy, u)
    same = tokens == ref_tokens
    # Float32 sums against float64: a draw within rounding of a token boundary may differ.
    assert same.float().mean() >= 0.995, same.float().mean()
    assert torch.allclose(lps[same], ref_lps[same], atol=1e-4, rtol=1e-5)
    x = logits.gather(-1, tokens[:, None]).squeeze(1)
    assert torch.isfinite(x).all()  # never a token of probability 0


def test_draw_frequencies_follow_the_softmax():
    vocab, draws = 151936, 20000  # 20000 rows: past 2**31 elements, where a 32-bit row offset would wrap
    g = torch.Generator(device="cuda").manual_seed(3)
    row = torch.randn(vocab, device="cuda", generator=g) * 2
    row[:20] += 9  # a head of 20 likely tokens above a long tail
    logits = row.expand(draws, vocab).contiguous()
    temps = torch.full((draws,), 0.7, device="cuda")
    greedy, row_max, _ = argmax_logsumexp(logits)
    u = torch.from_numpy(seeded_uniform(np.arange(draws), np.full(draws, 5))).cuda()
    tokens, _ = draw(logits, temps, row_max, greedy, u)
    probs = torch.softmax(row.double() / 0.7, -1)
    freq = torch.bincount(tokens, minlength=vocab).double() / draws
    assert (freq[:20] - probs[:20]).abs().max() < 0.012
    assert abs(freq[20:].sum() - probs[20:].sum()) < 0.012  # the tail's mass too


def test_sample_takes_the_fused_draw_and_keeps_greedy_and_raw_rows():
    """A batch mixing sampled, greedy and raw-logprob rows: the fused path
    gives what the general path gives (tokens up to rounding, logprobs in
    each row's mode)."""
    vocab, rows = 151936, 64
    g = torch.Generator(device="cuda").manual_seed(8)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    params = [SamplingParams(temperature=[0.0, 0.8, 1.0, 1.2][i % 4], logprob_mode=["processed", "raw"][i % 3 == 0])
              for i in range(rows)]
    sb = SamplingBatch.build(sampling_plan(params, list(range(rows)), [40] * rows), torch.device("cuda"))
    fused = sample(logits, sb)
    general = sample(logits.cpu(), SamplingBatch.build(sampling_plan(params, list(range(rows)), [40] * rows),
                                                        torch.device("cpu")))
    same = fused.tokens.cpu() == general.tokens
    assert same.float().mean() >= 0.95
    assert torch.allclose(fused.logprobs.cpu()[same], general.logprobs[same], atol=1e-4)
    greedy_rows = torch.tensor([p.temperature == 0 for p in params])
    assert (fused.tokens.cpu()[greedy_rows] == logits.argmax(-1).cpu()[greedy_rows]).all()


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_sample_rows_equals_draw_and_torch_selections_bitwise(rows):
    """The sampler's fused step in two launches (greedy rows keep their
    argmax, raw and greedy rows report raw logprobs inside the pick kernel)
    gives the bits of `draw` followed by the torch selections it replaced."""
    vocab = 151936
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    temps = torch.tensor([[0.0, 0.6, 1.0, 1.3][i % 4] for i in range(rows)], device="cuda")
    raw = torch.tensor([i % 3 == 0 for i in range(rows)], device="cuda")
    greedy, row_max, log_norm = argmax_logsumexp(logits)
    u = torch.from_numpy(seeded_uniform(np.arange(rows), np.full(rows, 9))).cuda()
    tokens, lps = sample_rows(logits, temps, row_max, log_norm, greedy, u, raw)
    ref_tokens, ref_lps = sample_rows_ref(logits, temps, row_max, log_norm, greedy, u, raw)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(lps, ref_lps)
    greedy_rows = temps == 0
    assert torch.equal(tokens[greedy_rows], logits.argmax(-1)[greedy_rows])
