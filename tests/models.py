"""Tiny random Hugging Face models saved as safetensors folders, for tests."""
from __future__ import annotations

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.15, eos_token_id=None, bos_token_id=None, pad_token_id=None)


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
    else:
        raise ValueError(kind)
    if kind == "qwen2":  # random biases, so that the qkv bias path is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
    return model.eval()


def save_model(model, folder, max_shard_size=None) -> str:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return str(folder)
