"""Greedy generation is token-identical to Hugging Face `generate` (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from conftest import MODEL_KINDS
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, list(range(100, 140)), [300, 11], list(range(200, 300, 3))]


def hf_greedy(hf, prompt, max_new_tokens):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf, prompt, output):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(prompt[1:] + output)
    return lps[:-1].gather(-1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("kind,tie", MODEL_KINDS)
def test_greedy_tokens_and_raw_logprobs_match_hf(tiny_models, kind, tie):
    hf, folder = tiny_models[(kind, tie)]
    engine = RolloutEngine(folder, max_total_tokens=4096)
    params = SamplingParams(max_new_tokens=64, temperature=0, logprob_mode="raw", ignore_eos=True)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == hf_greedy(hf, prompt, 64)
        ref = hf_logprobs(hf, prompt, out.output_token_ids)[len(prompt) - 1:]
        assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=1e-4)
        assert out.finish_reason == "length"
    engine.check_integrity()


def test_sharded_checkpoint_with_index(tmp_path):
    hf = make_hf_model("qwen2", tie=False, seed=3)
    folder = save_model(hf, tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    engine = RolloutEngine(folder, max_total_tokens=2048)
    out = engine.generate(input_ids=[PROMPTS[2]], sampling_params=SamplingParams(max_new_tokens=32, temperature=0))
    assert out[0].output_token_ids == hf_greedy(hf, PROMPTS[2], 32)


def test_prompt_logprobs_match_hf(llama):
    hf, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096, max_prefill_tokens=16)  # chunked too
    prompt = PROMPTS[4]
    out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=4, temperature=0, prompt_logprobs=True))[0]
    ref = hf_logprobs(hf, prompt, out.output_token_ids)[: len(prompt) - 1]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), ref, atol=1e-4)


def test_top_logprobs_are_the_k_most_likely(llama):
    hf, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    prompt = PROMPTS[0]
    out = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=8, temperature=0, top_logprobs=5, logprob_mode="raw"))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.output_token_ids])).logits[0, len(prompt) - 1: -1]
    ref_vals, ref_ids = torch.log_softmax(logits.float(), -1).topk(5)
    for step, top in enumerate(out.top_logprobs):
        assert [t for t, _ in top] == ref_ids[step].tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), ref_vals[step], atol=1e-4)
        assert top[0][0] == out.output_token_ids[step]
