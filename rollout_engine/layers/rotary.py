"""Rotary position embedding (neox layout, as in HF Llama/Qwen), with Llama-3
frequency scaling. The cos/sin table is a buffer, not a weight: it survives a
weights release."""
from __future__ import annotations

import math

import torch
from torch import nn

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.rope import QKNorm, rope, rope_and_store, rope_and_store_ref, rope_ref
from rollout_engine.models.config import RopeConfig


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.scaling_type != "llama3":
        return inv_freq
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_frequencies(head_dim, rope))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, heads, d], k: [T, kv_heads, d]; positions: [T]. On the GPU
        one kernel rotates both and returns contiguous tensors."""
        fn = rope if use_kernel(q) else rope_ref
        return fn(positions, q, k, self.cos, self.sin)

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                         qk_norm: QKNorm | None = None) -> torch.Tensor:
        """Rotated q; rotated k and v go into the layer's KV cache at `loc`
        (one kernel on the GPU). `qk_norm`: per-head RMSNorm of q and k
        first, in the same kernel."""
        fn = rope_and_store if use_kernel(q) else rope_and_store_ref
        return fn(positions, q, k, v, self.cos, self.sin, k_cache, v_cache, loc, qk_norm)
