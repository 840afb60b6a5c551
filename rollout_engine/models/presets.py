"""Real model shapes for `load_format="dummy"` (random weights): benchmarks and
tests without a checkpoint."""
from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=151645,
    ),
    "qwen2.5-1.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=151645,
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=32768,
        rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=151645,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=[128001, 128008, 128009],
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    # MoE
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=151645,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936,
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, rms_norm_eps=1e-6, max_position_embeddings=8192,
        rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=151643,
        num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    # a small MoE of that family (not a released model): the routing-replay example on one GPU or the CPU
    "qwen3-moe-mini": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=32768,
        hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_theta=1000000.0, tie_word_embeddings=False, eos_token_id=2,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "olmoe-1b-7b": dict(
        architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304,
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=50279,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
    ),
}


class PresetConfig:
    """A minimal stand-in for a transformers config object."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


def preset_config(name: str) -> PresetConfig:
    if name not in PRESETS:
        raise ValueError(f"model {name!r} is neither a folder nor a preset ({sorted(PRESETS)})")
    return PresetConfig(**PRESETS[name])
