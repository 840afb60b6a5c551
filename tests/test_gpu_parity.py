"""bf16 on the GPU: teacher-forced logprobs over HF's greedy sequence agree
with HF's within 2e-2 mean absolute difference; fp32 greedy tokens equal."""
from __future__ import annotations

import pytest
import torch

from conftest import MODEL_KINDS
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), list(range(200, 300, 3))]
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     initializer_range=0.02, rope_theta=100000.0)


def _teacher_forced_gap(hf, folder, backend, new_tokens=64, **engine_kw):
    engine = RolloutEngine(folder, device="cuda", dtype="bfloat16", attention_backend=backend,
                           max_total_tokens=8192, **engine_kw)
    hf = hf.to("cuda", torch.bfloat16)
    gaps = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq], device="cuda")).logits[0].float(), -1)
        ref = ref[:-1].gather(-1, torch.tensor(seq[1:], device="cuda")[:, None]).squeeze(1).cpu()
        out = engine.generate(input_ids=[seq], sampling_params=SamplingParams(
            max_new_tokens=1, temperature=0, prompt_logprobs=True))[0]
        ours = torch.tensor(out.prompt_logprobs[1:])
        gaps.append((ours - ref)[len(prompt) - 1:].abs().mean().item())
    engine.check_integrity()
    engine.shutdown()
    return max(gaps)


@pytest.mark.parametrize("kind,tie", MODEL_KINDS)
def test_bf16_teacher_forced_logprobs(tmp_path, kind, tie):
    hf = make_hf_model(kind, tie)
    folder = save_model(hf, tmp_path)
    assert _teacher_forced_gap(hf, folder, "torch") < 2e-2


def test_bf16_smollm2_shaped(tmp_path):
    hf = make_hf_model("llama", tie=True, **SMOLLM2_SHAPE)
    folder = save_model(hf, tmp_path)
    assert _teacher_forced_gap(hf, folder, "torch") < 2e-2


@pytest.mark.parametrize("kind,tie", MODEL_KINDS)
def test_fp32_greedy_tokens_on_gpu(tmp_path, kind, tie):
    hf = make_hf_model(kind, tie)
    folder = save_model(hf, tmp_path)
    engine = RolloutEngine(folder, device="cuda", dtype="float32", max_total_tokens=4096)
    hf = hf.to("cuda")
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=64, temperature=0))
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.output_token_ids == ref


def test_dummy_preset_sizes_kv_from_mem_fraction():
    engine = RolloutEngine("qwen3-0.6b", load_format="dummy", device="cuda", mem_fraction=0.5)
    assert engine.limits.kv_capacity > 100_000
    outs = engine.generate(input_ids=[[1, 2, 3]] * 4, sampling_params=SamplingParams(max_new_tokens=16))
    assert all(len(o.output_token_ids) == 16 for o in outs)


@pytest.mark.multigpu
@pytest.mark.parametrize("batch", [1, 3])
def test_tp2_decode_with_the_norms_taking_the_all_reduce_matches_hf(tmp_path, monkeypatch, caplog, batch):
    """ROLLOUT_ENGINE_ALLREDUCE=fused on two GPUs: decode in CUDA graphs, at
    one row (the products after the fused kernel without their norm) and at
    three, gives each generated token's logprob within the one-GPU tolerance
    of HF bf16 over the same tokens."""
    import logging

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("ROLLOUT_ENGINE_ALLREDUCE", "fused")
    hf = make_hf_model("qwen2", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                       num_key_value_heads=2, initializer_range=0.05)
    folder = save_model(hf, tmp_path)
    with caplog.at_level(logging.INFO, logger="rollout_engine"):
        engine = RolloutEngine(folder, device="cuda", dtype="bfloat16", tp_size=2, max_total_tokens=8192)
    assert "in one kernel" in caplog.text
    try:
        outs = engine.generate(input_ids=PROMPTS[:batch], sampling_params=SamplingParams(
            max_new_tokens=32, temperature=0, ignore_eos=True, logprobs=True, logprob_mode="raw"))
        engine.check_integrity()
    finally:
        engine.shutdown()
    hf = hf.to("cuda", torch.bfloat16)
    gaps = []
    for prompt, out in zip(PROMPTS, outs):
        seq = torch.tensor([prompt + out.output_token_ids], device="cuda")
        with torch.no_grad():
            ref = torch.log_softmax(hf(seq).logits[0].float(), -1)[len(prompt) - 1: -1]
        ref = ref.gather(-1, seq[0, len(prompt):, None]).squeeze(1).cpu()
        gaps.append((torch.tensor(out.output_logprobs) - ref).abs().mean().item())
    print(f"decode logprob gap, fused all-reduce + norm, batch {batch}: {max(gaps):.4f}")
    assert max(gaps) < 2e-2


@pytest.mark.multigpu
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_tp2_bf16_teacher_forced_logprobs(tmp_path, cuda_graph):
    """Two GPUs, the engine spawning its second rank: the same tolerance as
    one GPU, on a model FlashInfer serves (head_dim 64), graphs on and off."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    hf = make_hf_model("qwen2", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                       num_key_value_heads=2, initializer_range=0.05)
    folder = save_model(hf, tmp_path)
    one = _teacher_forced_gap(hf, folder, "auto", cuda_graph=cuda_graph)
    two = _teacher_forced_gap(hf, folder, "auto", cuda_graph=cuda_graph, tp_size=2)
    print(f"teacher-forced gap: tp=1 {one:.4f}, tp=2 {two:.4f}")
    assert two < 2e-2
