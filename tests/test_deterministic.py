"""Deterministic (batch-invariant) mode on the CPU, fp32: a seeded sampled
request gives bitwise the same tokens and logprobs alone, among 63 others,
with chunked prefill, with part of its prompt from the prefix cache, and
after retraction. (Without the mode these differ in the last bits: the
batch shape changes how matrix products and reductions round.)"""
from __future__ import annotations

import random

import pytest

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

TARGET = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True, logprobs=True,
                        top_logprobs=3)


# fast: qwen3 (q/k norms) and qwen2_moe (experts, shared expert, biases); llama's plain path and olmoe with the slow
@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.slow), "qwen3", "qwen2_moe",
                                        pytest.param("olmoe", marks=pytest.mark.slow)])
def folder(request, tmp_path_factory):
    return save_model(make_hf_model(request.param, seed=1, num_hidden_layers=2), tmp_path_factory.mktemp("det"))


def _prompts(seed: int = 0):
    rng = random.Random(seed)
    target = [rng.randrange(1, 500) for _ in range(40)]
    others = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 150))] for _ in range(63)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 48), temperature=rng.choice([0, 0.7, 1.0]),
                             top_k=rng.choice([0, 20]), seed=rng.randrange(1000), ignore_eos=True)
              for _ in others]
    return target, others, params


def _target_output(folder, batch, params, **engine_kw):
    engine = RolloutEngine(folder, device="cpu", deterministic=True, **{"max_total_tokens": 16384, **engine_kw})
    return first_output(engine, batch, params)


def first_output(engine, batch, params):
    """The first request's output and the engine's cache counters; the engine is shut down."""
    try:
        outs = engine.generate(input_ids=batch, sampling_params=params)
        return outs[0], engine.cache_stats()
    finally:
        engine.shutdown()


def _same(a, b) -> None:
    assert a.output_token_ids == b.output_token_ids
    assert a.output_logprobs == b.output_logprobs  # bitwise: float equality, no tolerance
    assert a.top_logprobs == b.top_logprobs


def test_alone_equals_in_a_batch_of_63(folder):
    target, others, params = _prompts()
    alone, _ = _target_output(folder, [target], [TARGET])
    crowded, _ = _target_output(folder, [target] + others, [TARGET] + params)
    _same(alone, crowded)


def test_chunked_prefill_equals_whole(folder):
    target, others, params = _prompts()
    alone, _ = _target_output(folder, [target], [TARGET])
    chunked, _ = _target_output(folder, [target] + others[:8], [TARGET] + params[:8], max_prefill_tokens=7)
    _same(alone, chunked)


def test_a_prefix_from_the_cache_equals_computing_it(folder):
    target, _, _ = _prompts()
    alone, _ = _target_output(folder, [target], [TARGET])
    engine = RolloutEngine(folder, device="cpu", deterministic=True, max_total_tokens=16384)
    try:
        engine.generate(input_ids=[target[:25]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
        cached = engine.generate(input_ids=[target], sampling_params=TARGET)[0]
    finally:
        engine.shutdown()
    assert cached.num_cached_tokens >= 24
    _same(alone, cached)


def test_after_retraction_equals_alone(folder):
    target, others, params = _prompts()
    alone, _ = _target_output(folder, [target], [TARGET])
    long = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=i, ignore_eos=True) for i in range(24)]
    squeezed, stats = _target_output(folder, [target] + others[:24], [TARGET] + long, max_total_tokens=1200)
    assert stats["retractions"] > 0
    _same(alone, squeezed)


def test_deterministic_must_be_a_bool_and_picks_its_own_attention():
    with pytest.raises(ValueError, match="deterministic"):
        RolloutEngine("unused", deterministic="yes")
    with pytest.raises(ValueError, match="attention_backend"):
        RolloutEngine("unused", deterministic=True, attention_backend="flashinfer")


def test_fidelity_score_equals_the_engines_logprobs_bitwise(folder):
    from rollout_engine import fidelity

    target, others, _ = _prompts()
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5, n=2, ignore_eos=True,
                            logprob_mode="raw")
    engine = RolloutEngine(folder, device="cpu", deterministic=True, max_total_tokens=16384)
    try:
        outs = engine.generate(input_ids=[target] + others[:15], sampling_params=params)
        scores = fidelity.score(engine, outs)
    finally:
        engine.shutdown()
    assert scores == [o.output_logprobs for o in outs]  # bitwise
    gap = fidelity.hf_gap(folder, outs, scores)  # a different implementation: close, not equal
    assert gap["tokens"] == sum(len(o.output_token_ids) for o in outs) and gap["max_abs"] < 1e-4
    # A temporary engine from the model's folder scores the same.
    assert fidelity.score(folder, outs[:2], device="cpu", deterministic=True) == scores[:2]
    with pytest.raises(ValueError, match="sampling_params"):
        fidelity.score(folder, outs[:1], {"temperature": 0.5})


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=20, seed=5, n=2, ignore_eos=True),
    SamplingParams(max_new_tokens=24, temperature=1.3, min_p=0.05, seed=6, ignore_eos=True),
    SamplingParams(max_new_tokens=24, temperature=0, top_k=5, ignore_eos=True),  # greedy, scored with its filter
    SamplingParams(max_new_tokens=24, temperature=0.6, seed=7, ignore_eos=True)])
def test_fidelity_score_under_sampling_params_equals_processed_logprobs_bitwise(folder, params):
    """Processed logprobs (the distribution sampled from): scoring the
    sequences under the same parameters gives the engine's logprobs bit for
    bit, with rows of other modes in the same steps; raw scores differ."""
    from rollout_engine import fidelity

    target, others, _ = _prompts()
    engine = RolloutEngine(folder, device="cpu", deterministic=True, max_total_tokens=16384)
    try:
        outs = engine.generate(input_ids=[target] + others[:7], sampling_params=params)
        scores = fidelity.score(engine, outs, params)
        raw = fidelity.score(engine, outs)
        # Processed and raw prompt rows in one step: each keeps its own mode.
        mixed = engine.generate(input_ids=[o.prompt_token_ids + o.output_token_ids for o in outs[:2]],
                                sampling_params=[SamplingParams(max_new_tokens=1, prompt_logprobs=True,
                                                                prompt_logprob_mode=m, temperature=params.temperature,
                                                                top_k=params.top_k, top_p=params.top_p,
                                                                min_p=params.min_p) for m in ("processed", "raw")])
    finally:
        engine.shutdown()
    assert scores == [o.output_logprobs for o in outs]  # bitwise
    assert raw != scores
    cut = [len(o.prompt_token_ids) for o in outs[:2]]
    assert mixed[0].prompt_logprobs[cut[0]:] == scores[0] and mixed[1].prompt_logprobs[cut[1]:] == raw[1]


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_tensor_parallel_two_ranks_stays_batch_invariant(tmp_path):
    folder = save_model(make_hf_model("llama", seed=1, num_hidden_layers=2), tmp_path / "m")
    target, others, params = _prompts()
    alone, _ = _target_output(folder, [target], [TARGET], tp_size=2)
    crowded, _ = _target_output(folder, [target] + others[:20], [TARGET] + params[:20], tp_size=2,
                                max_prefill_tokens=7)
    _same(alone, crowded)


def test_the_matmul_tile_picks_keep_one_reduction_order():
    """The deterministic matmul may pick its tiles by the number of rows only
    because every pick shares BLOCK_K (the bits depend on it, through the
    chunks, and not on the tiles): a pick with another BLOCK_K would make a
    row's bits depend on its batch. The buckets rise, the last is open, and
    the kernels compiled at start cover every bucket and launch shape."""
    import torch

    from rollout_engine.kernels.invariant_matmul import (DECODE_MAX_ROWS, DECODE_TILES, ROW_PICKS, WIDE_N, _splits,
                                                         launches_to_compile, pick_tiles)

    bounds = [most for most, _, _ in ROW_PICKS]
    assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]) and DECODE_MAX_ROWS in bounds
    assert {t.block_k for _, narrow, wide in ROW_PICKS for t in (narrow, wide)} == {DECODE_TILES.block_k}
    cpu = torch.device("cpu")  # counted as an H100's 132 SMs
    for n, k in ((1000, 4096), (3584, 18944), (4608, 3584), (WIDE_N, 4096), (152064, 3584)):
        compiled = {(pick_tiles(m, n, k), split) for m, split in launches_to_compile(n, k, cpu)}
        for m in (1, 2, 9, 33, 64, 65, 100, 128, 129, 256, 257, 700, 768, 769, 1536, 1537, 3000, 70000):
            tiles = pick_tiles(m, n, k)
            assert (tiles, _splits(m, n, k, tiles, 132)) in compiled, (n, k, m)
    assert pick_tiles(256, 4096, 4096) == ROW_PICKS[2][1] and pick_tiles(257, WIDE_N, 4096) == ROW_PICKS[3][2]


def test_the_invariant_backend_never_takes_the_one_sequence_kernel(monkeypatch):
    """The one-sequence kernel splits a sequence's keys over programs, so a
    decode step alone would round otherwise than in a batch: the invariant
    backend keeps its own kernel (and its metadata) at batch 1."""
    import torch

    from rollout_engine.attention import one_seq
    from rollout_engine.attention.base import AttentionShape
    from rollout_engine.attention.invariant_backend import BatchInvariantTritonBackend
    from rollout_engine.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(one_seq, "triton_available", lambda: True)
    shape = AttentionShape(8, 2, 128, 16, torch.bfloat16, torch.device("cuda"))
    assert TritonAttentionBackend(shape).one_seq
    assert not BatchInvariantTritonBackend(shape).one_seq
