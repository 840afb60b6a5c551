"""Shared by the GPU parity tests: tiny model shapes for the GPU, and the
engine's greedy outputs against Hugging Face, teacher-forced."""
from __future__ import annotations

import torch

from rollout_engine import SamplingParams

# FlashInfer compiles per head_dim: every GPU model uses 64. Groups of 4 take
# the tensor-core decode path, groups of 2 the CUDA-core one.
GPU_SHAPES = {
    "llama": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1),
    "llama3": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1),
    "qwen2": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64),
}
INIT_RANGE = 0.06  # wider than the CPU models: keeps bf16 activations in a realistic range


def gap_vs_hf(engine, hf, prompts):
    """Mean |raw logprob - HF's| over the engine's greedy outputs, teacher-forced
    (the largest over the prompts)."""
    gaps, outs = gaps_vs_hf(engine, hf, prompts)
    return max(gaps), outs


def gaps_vs_hf(engine, hf, prompts):
    """Per prompt, mean |raw logprob - HF's| over the engine's greedy
    outputs (48 tokens, teacher-forced); and the outputs."""
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
        max_new_tokens=48, temperature=0, logprob_mode="raw", ignore_eos=True))
    gaps = []
    for p, o in zip(prompts, outs):
        seq = torch.tensor([p + o.output_token_ids], device="cuda")
        with torch.no_grad():
            lps = torch.log_softmax(hf(seq).logits[0].float(), -1)
        ref = lps[len(p) - 1: -1].gather(-1, torch.tensor(o.output_token_ids, device="cuda")[:, None]).squeeze(1)
        gaps.append((torch.tensor(o.output_logprobs, device="cuda") - ref).abs().mean().item())
    return gaps, outs
