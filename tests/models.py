"""Tiny random Hugging Face models saved as safetensors folders, for tests."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.15, eos_token_id=None, bos_token_id=None, pad_token_id=None)


# Tiny MoE configs: a dense layer among the sparse ones where the
# architecture has them (Qwen's mlp_only_layers), a shared expert (Qwen2-MoE),
# renormalized top-k or not, and experts narrower than the dense MLP.
MOE = {
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=32, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2Moe", dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                   norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "olmoe": ("Olmoe", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
}


def make_hf_model(kind: str, tie: bool = False, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    kw = {**TINY, "tie_word_embeddings": tie, **overrides}
    if kind == "llama":
        config = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama3":
        kw["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=64)
        config = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "qwen3":
        kw.setdefault("head_dim", 32)
        config = transformers.Qwen3Config(**kw)
        model = transformers.Qwen3ForCausalLM(config)
    elif kind in MOE:
        name, extra = MOE[kind]
        config = getattr(transformers, f"{name}Config")(**{**kw, **extra, **overrides})
        model = getattr(transformers, f"{name}ForCausalLM")(config)
    else:
        raise ValueError(kind)
    if kind in ("qwen2", "qwen2_moe"):  # random biases, so that the qkv bias path is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
    return model.eval()


def save_model(model, folder, max_shard_size=None) -> str:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return str(folder)
