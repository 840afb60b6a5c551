"""Steps with prompt tokens through the graphs cut at attention
(runner/prompt_graphs.py). On the CPU nothing is captured: the pieces
between attentions run as they are, over the same fixed buffers and padding
rows as the graphs, so these tests check the cut itself (the pieces, the
buffers between them, the padding to a bucket); the graphs' replay is checked
on the GPU (the last test here, and test_gpu_differential.py, whose engines
take the graphs)."""
from __future__ import annotations

import pytest

from differential import (Reference, WorkloadGenerator, assert_outputs_close, prompt_logprob_outputs, stress,
                          tight_pool_stress)
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams, forward_batch
from rollout_engine.runner import prompt_graphs
from rollout_engine.runner.prompt_graphs import PromptGraphs, prompt_buckets


def test_buckets_cover_every_step_size_in_padded_steps():
    for top in (1, 64, 100, 8448, 16640):  # up to MAX_TOKENS
        b = prompt_buckets(top)
        assert b[-1] >= top and (len(b) == 1 or b[-2] < top)
        assert all(t % forward_batch.PAD_TOKENS == 0 for t in b) and b == sorted(set(b))
        # a bucket pads a step by less than 64 tokens below 512, 128 below 2,048, 256 beyond
        assert all(hi - lo <= (64 if lo < 512 else 128 if lo < 2048 else 256) for lo, hi in zip(b, b[1:]))
    assert prompt_buckets(8448)[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 640]
    assert len(prompt_buckets(8448)) == 45 and len(prompt_buckets(16384 + 256)) == 77
    assert prompt_buckets(1 << 20) == prompt_buckets(prompt_graphs.MAX_TOKENS)  # larger steps run eagerly


class _Graphs:
    """Where the decode graphs sit in the runner: none here, the prompt pieces only."""

    samples = False

    def __init__(self, prompt: PromptGraphs):
        self.prompt = prompt

    def can_run(self, plan) -> bool:
        return False

    def destroy(self) -> None:
        self.prompt.destroy()


def _prompt_engine(folder, monkeypatch, **kw) -> tuple[RolloutEngine, list[tuple[int, int]]]:
    """A CPU engine whose steps of two tokens or more go through the prompt
    pieces; the list collects (tokens, bucket) per step that did."""
    engine = RolloutEngine(folder, device="cpu", **kw)
    runner = engine.core.parts.runner
    cfg = engine.core.parts.config
    runner.pads_eager = True  # the LM head's rows padded as on the GPU
    prompt = PromptGraphs(runner.model, cfg.max_prefill_tokens + cfg.max_running_requests, runner.device)
    prompt.capture(None, runner.kv_pool, runner.backend, runner.table)
    runner.graphs = _Graphs(prompt)
    seen: list[tuple[int, int]] = []
    run = prompt.run

    def record(fb, t):
        seen.append((t - fb.pad, t))
        return run(fb, t)

    monkeypatch.setattr(prompt, "run", record)
    return engine, seen


@pytest.mark.parametrize("kind,page_size", [("llama", 1), ("qwen3", 16),
                                             pytest.param("qwen2", 16, marks=pytest.mark.slow)])
def test_prompt_pieces_match_the_reference_over_random_call_sequences(tmp_path, monkeypatch, kind, page_size):
    """Chunked prompts, prefix-cache hits, retractions, aborts and n > 1 on one
    engine, its prompt and mixed steps through the pieces: every output
    checked against Hugging Face."""
    hf = make_hf_model(kind, seed=7)
    folder = save_model(hf, tmp_path / kind)
    engine, seen = _prompt_engine(folder, monkeypatch, max_total_tokens=400, max_prefill_tokens=48,
                                  page_size=page_size, max_running_requests=24)
    tight_pool_stress(engine, hf, seed=21 + page_size)
    assert len(seen) > 20 and all(t in prompt_buckets(72) and t >= n for n, t in seen)
    assert any(t > n for n, t in seen)  # padded steps
    assert engine.cache_stats()["hit_rate"] > 0.1


def test_steps_above_the_largest_bucket_run_eagerly(tmp_path, monkeypatch):
    """With the buckets capped below the engine's largest step, the steps
    above them take the eager path, the others the pieces, in one engine."""
    monkeypatch.setattr(prompt_graphs, "MAX_TOKENS", 64)
    hf = make_hf_model("llama", seed=9)
    engine, seen = _prompt_engine(save_model(hf, tmp_path / "m"), monkeypatch, max_total_tokens=400,
                                  max_prefill_tokens=96, max_running_requests=24)
    runner = engine.core.parts.runner
    eager: list[int] = []
    model_forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda ids, pos, fb: eager.append(ids.shape[0] - fb.pad)
                        or model_forward(ids, pos, fb))
    gen = WorkloadGenerator(seed=3, token_range=(0, 512), max_prompt_len=90, max_new_tokens=12, max_batch=8)
    report = stress(engine, Reference(hf, "cpu"), gen, num_calls=12, margin=1e-3, logprob_tol=1e-3)
    assert not report.violations, report.violations[:5]
    assert seen and all(t == 64 for _, t in seen)
    assert any(n > 64 for n in eager)  # the larger steps, eagerly


def test_prompt_pieces_agree_with_eager_steps_on_prompt_logprobs(tmp_path, monkeypatch):
    """A step whose every row has logits (prompt logprobs): the padding rows
    of the bucket are dropped before them."""
    hf = make_hf_model("qwen3", seed=8)
    folder = save_model(hf, tmp_path / "m")
    plain = prompt_logprob_outputs(RolloutEngine(folder, device="cpu", max_prefill_tokens=40))
    engine, seen = _prompt_engine(folder, monkeypatch, max_prefill_tokens=40)
    cut = prompt_logprob_outputs(engine)
    assert seen
    # destroyed and captured again (a release of the graphs in "recapture" mode): buffers allocated afresh
    runner = engine.core.parts.runner
    prompt = runner.graphs.prompt
    prompt.destroy()
    assert not prompt.captured and not prompt.buffers
    assert [o.output_token_ids for o in prompt_logprob_outputs(engine)] == \
        [o.output_token_ids for o in cut]  # eagerly meanwhile
    prompt.capture(None, runner.kv_pool, runner.backend, runner.table)
    count = len(seen)
    again = prompt_logprob_outputs(engine)
    assert len(seen) > count
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in cut]
    assert_outputs_close(plain, cut, 1e-4)


def test_which_models_take_prompt_graphs(tmp_path):
    dense = RolloutEngine(save_model(make_hf_model("llama", seed=1), tmp_path / "d"), device="cpu")
    assert prompt_graphs.supports(dense.core.parts.runner.model, batch_invariant=False)
    assert not prompt_graphs.supports(dense.core.parts.runner.model, batch_invariant=True)
    moe = RolloutEngine(save_model(make_hf_model("qwen3_moe", seed=1), tmp_path / "m"), device="cpu")
    assert not prompt_graphs.supports(moe.core.parts.runner.model, batch_invariant=False)


def _peaked_llama(folder):
    """A random model with peaked logits (large initialisation, untied head)."""
    import torch

    hf = make_hf_model("llama", seed=5, vocab_size=4096, hidden_size=256, num_attention_heads=4,
                       num_key_value_heads=1, num_hidden_layers=4, initializer_range=0.08)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    return save_model(hf, folder)


@pytest.mark.gpu
def test_gpu_prompt_graphs_replay_as_eager_steps_and_survive_release(tmp_path, monkeypatch):
    """On the GPU: the graphs are captured for a dense model; prompt logprobs
    (every row's logits) and greedy outputs through them agree with eager
    steps; after releasing and resuming the KV cache and the graphs (kept in
    place in this process's torch hook mode) the same engine gives the same
    bits."""
    import numpy as np

    folder = _peaked_llama(tmp_path / "m")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4096, size=int(n)).tolist() for n in (3, 17, 64, 65, 130, 300, 420, 470, 490)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=True, prompt_logprobs=True,
                            ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", max_prefill_tokens=256, max_running_requests=32)
    engine = RolloutEngine(folder, enable_memory_saver=True, **kw)
    prompt = engine.core.parts.runner.graphs.prompt
    assert prompt is not None and prompt.captured and prompt.max_tokens >= 256 + 32
    runs: list[int] = []
    run = prompt.run
    monkeypatch.setattr(prompt, "run", lambda fb, t: runs.append(t) or run(fb, t))
    cut = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(set(runs)) >= 2  # chunks and mixed steps in buckets of more than one size
    monkeypatch.setattr(prompt_graphs, "ENABLED", False)
    eager_engine = RolloutEngine(folder, **kw)
    assert eager_engine.core.parts.runner.graphs.prompt is None
    eager = eager_engine.generate(input_ids=prompts, sampling_params=params)
    eager_engine.shutdown()
    gaps = np.concatenate([np.abs(np.subtract(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
                           for a, b in zip(cut, eager)])
    print(f"prompt logprobs, graphs cut at attention vs eager: mean gap {gaps.mean():.4f}, max {gaps.max():.4f}")
    assert gaps.mean() < 0.02 and gaps.max() < 0.5
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(cut, eager))
    assert same >= len(prompts) - 1
    before = len(runs)
    engine.release_memory(["kv_cache", "cuda_graph"])
    engine.resume_memory(["kv_cache", "cuda_graph"])
    again = engine.generate(input_ids=prompts, sampling_params=params)
    assert len(runs) > before and prompt.captured
    for a, b in zip(cut, again):
        assert a.output_token_ids == b.output_token_ids and a.output_logprobs == b.output_logprobs
    engine.shutdown()
