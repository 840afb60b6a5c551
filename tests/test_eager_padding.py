"""Steps run outside the CUDA graphs (prompt chunks, mixed steps) run on a
padded row count (forward_batch.padded_tokens): the padding rows must not
change any request's tokens or logprobs, must never be attended to, and
must not reach the logits. On the GPU the runner pads by default; here it is
switched on with a small multiple so that nearly every step is padded."""
from __future__ import annotations

import pytest

from differential import assert_outputs_close, prompt_logprob_outputs, tight_pool_stress
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, forward_batch
from rollout_engine.runner.model_runner import ModelRunner


def test_padded_row_counts():
    m = forward_batch.PAD_TOKENS
    assert [forward_batch.padded_tokens(n) for n in (1, 2, m - 1)] == [1, 2, m - 1]  # small steps: as they are
    assert [forward_batch.padded_tokens(n) for n in (m, m + 1, 2 * m, 8233)] == [m, 2 * m, 2 * m, -(-8233 // m) * m]


def _padding_engine(folder, monkeypatch, **kw) -> tuple[RolloutEngine, list[tuple[int, int, bool]]]:
    """An engine whose runner pads its steps to multiples of 8 rows; the list
    collects (plan tokens, rows the model ran on, decode step) per step."""
    monkeypatch.setattr(forward_batch, "PAD_TOKENS", 8)
    engine = RolloutEngine(folder, device="cpu", **kw)
    runner = engine.core.parts.runner
    runner.pads_eager = True
    seen: list[tuple[int, int, bool]] = []
    model_forward = runner.model.forward

    def forward(input_ids, positions, fb):
        seen.append((input_ids.shape[0] - fb.pad, input_ids.shape[0], fb.is_decode))
        assert positions.shape[0] == fb.out_cache_loc.shape[0] == input_ids.shape[0]
        return model_forward(input_ids, positions, fb)

    monkeypatch.setattr(runner.model, "forward", forward)
    inputs_from_prev = runner._inputs_from_prev

    def from_prev(plan, prev, ids=None):  # a padded step taking tokens sampled in the step before
        if ids is not None and plan.prev_rows is not None and ids.shape[0] > plan.num_tokens:
            runner.padded_reads = getattr(runner, "padded_reads", set()) | {bool(plan.is_decode)}
        return inputs_from_prev(plan, prev, ids)

    monkeypatch.setattr(runner, "_inputs_from_prev", from_prev)
    return engine, seen


# qwen3 at page size 16 in the slow tests: test_prompt_graphs.py runs that pair through buckets padded further
@pytest.mark.parametrize("kind,page_size", [("llama", 1), pytest.param("qwen3", 16, marks=pytest.mark.slow)])
def test_padded_steps_match_the_reference_over_random_call_sequences(tmp_path, monkeypatch, kind, page_size):
    """Chunked prompts, prefix-cache hits, retractions, aborts and n > 1 on one
    engine, every step padded: every output checked against Hugging Face."""
    hf = make_hf_model(kind, seed=5)
    folder = save_model(hf, tmp_path / kind)
    engine, seen = _padding_engine(folder, monkeypatch, max_total_tokens=400, max_prefill_tokens=48,
                                   page_size=page_size, max_running_requests=24)
    tight_pool_stress(engine, hf, seed=11 + page_size)
    padded = [(n, rows, decode) for n, rows, decode in seen if rows > n]
    assert len(padded) > len(seen) // 10, f"{len(padded)} of {len(seen)} steps padded"
    assert all(rows % 8 == 0 and rows - n < 8 for n, rows, _ in padded)
    # both kinds of padded step took inputs sampled in the step before (overlap): decode steps, whose every
    # input is such a token, and steps with prompt rows, where some are
    assert {decode for _, _, decode in padded} == {True, False}
    assert engine.core.parts.runner.padded_reads == {True, False}
    assert engine.cache_stats()["hit_rate"] > 0.1


def test_padded_and_unpadded_engines_agree_with_prompt_logprobs(tmp_path, monkeypatch):
    """Prompt logprobs read the logits of every prompt row: the padding rows
    are dropped before them (a step whose every row has logits included)."""
    hf = make_hf_model("llama", seed=6)
    folder = save_model(hf, tmp_path / "m")
    plain = prompt_logprob_outputs(RolloutEngine(folder, device="cpu", max_prefill_tokens=40))
    engine, seen = _padding_engine(folder, monkeypatch, max_prefill_tokens=40)
    padded = prompt_logprob_outputs(engine)
    assert any(rows > n for n, rows, _ in seen)
    assert_outputs_close(plain, padded, 1e-5)


def test_a_cpu_engine_does_not_pad(tmp_path):
    """Off the GPU there is no per-shape cost to save: padding rows would only cost."""
    folder = save_model(make_hf_model("llama", seed=7), tmp_path / "m")
    assert RolloutEngine(folder, device="cpu").core.parts.runner.pads_eager is False


@pytest.mark.gpu
def test_gpu_engines_pad_their_eager_steps_and_stay_at_the_reference(tmp_path, monkeypatch):
    """On the GPU the runner pads by default (not in deterministic mode): its
    chunked prompt steps run padded and its greedy outputs stay as close to
    Hugging Face, teacher-forced, as an unpadded engine's."""
    import torch

    from gpu_parity import GPU_SHAPES, INIT_RANGE, gap_vs_hf

    from rollout_engine.runner import prompt_graphs

    # the eager path itself: with prompt graphs (the default) these steps would run through them
    monkeypatch.setattr(prompt_graphs, "ENABLED", False)
    hf = make_hf_model("qwen3", initializer_range=INIT_RANGE, **GPU_SHAPES["qwen3"])
    folder = save_model(hf, tmp_path / "m")
    hf = hf.to("cuda", torch.bfloat16)
    prompts = [[(11 * i + j) % 500 for j in range(70 + 13 * i)] for i in range(5)]
    det = RolloutEngine(folder, device="cuda", deterministic=True, max_total_tokens=8192)
    assert det.core.parts.runner.pads_eager is False
    det.shutdown()
    gaps = {}
    for pads in (False, True):
        engine = RolloutEngine(folder, device="cuda", max_prefill_tokens=100, max_total_tokens=8192)
        runner = engine.core.parts.runner
        assert runner.pads_eager is True  # the default on the GPU
        runner.pads_eager = pads
        seen = []
        model_forward = runner.model.forward
        monkeypatch.setattr(runner.model, "forward",
                            lambda ids, pos, fb: seen.append(fb.pad) or model_forward(ids, pos, fb))
        gaps[pads], _ = gap_vs_hf(engine, hf, prompts)
        assert any(seen) == pads
        engine.shutdown()
    print(f"gap vs HF: unpadded {gaps[False]:.4f}, padded {gaps[True]:.4f}")
    assert gaps[True] < 2e-2 and gaps[False] < 2e-2
