"""How many tokens the KV cache gets."""
from __future__ import annotations

import torch

from rollout_engine.cache.kv_pool import KVPool, RoutesLayout
from rollout_engine.config import EngineConfig
from rollout_engine.models.config import ModelConfig

CPU_KV_BYTES = 1 << 30  # default KV budget on the CPU


def kv_dtype_of(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's for "auto", else e4m3."""
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def routes_layout(cfg: EngineConfig, mc: ModelConfig) -> RoutesLayout | None:
    """The routing-capture buffer's layout: with enable_return_routed_experts
    on an MoE model, else None."""
    if not cfg.enable_return_routed_experts or mc.moe is None:
        return None
    return RoutesLayout.of(mc.moe.num_experts, len(mc.moe.sparse_layers), mc.moe.top_k)


def kv_bytes_per_token(mc: ModelConfig, num_kv_heads: int, dtype: torch.dtype,
                       routes: RoutesLayout | None = None) -> int:
    return KVPool.bytes_per_token(mc.num_layers, num_kv_heads, mc.head_dim, dtype, routes)


def activation_reserve(cfg: EngineConfig, mc: ModelConfig, dtype_bytes: int) -> int:
    """Room kept free for one step's activations, logits and sampling."""
    per_token = 4 * mc.hidden_size + 2 * mc.intermediate_size + mc.q_size + 2 * mc.kv_size
    if mc.moe is not None:  # each token's top-k expert rows: gate/up, activation, fp32 outputs
        per_token += mc.moe.top_k * (3 * mc.moe.intermediate_size + 2 * mc.hidden_size) + mc.moe.num_experts
    acts = cfg.max_prefill_tokens * per_token * dtype_bytes * 2
    sampling = cfg.max_running_requests * mc.vocab_size * 4 * 8
    return (1 << 30) + acts + sampling


def kv_capacity_tokens(cfg: EngineConfig, mc: ModelConfig, per_token: int, device: torch.device,
                       free_before_load: int, weight_bytes: int, dtype_bytes: int) -> int:
    if cfg.max_total_tokens is not None:
        return cfg.max_total_tokens
    if device.type != "cuda":
        return max(1024, min(2 * mc.max_position, CPU_KV_BYTES // per_token))
    budget = int(free_before_load * cfg.mem_fraction) - weight_bytes - activation_reserve(cfg, mc, dtype_bytes)
    tokens = budget // per_token
    if tokens < 1024:
        total = torch.cuda.mem_get_info(device)[1]
        held = ("; this process (a trainer's tensors, an engine not shut down) or another one holds the rest"
                if free_before_load < 0.9 * total else "")
        raise ValueError(
            f"mem_fraction={cfg.mem_fraction} leaves room for only {max(tokens, 0)} KV tokens (free before the "
            f"weights loaded: {free_before_load / 2**30:.1f} of the GPU's {total / 2**30:.1f} GiB{held}; the weights "
            f"take {weight_bytes / 2**30:.1f} GiB); raise mem_fraction or set max_total_tokens")
    return int(tokens)
