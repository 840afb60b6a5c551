"""The one-row kernels (batch-1 decode) compiled when the engine is built.

At one row the linear layers and the LM head run Triton gemv kernels
(`kernels/gemv.py`; the products after an RMSNorm with the norm inside),
compiled per weight shape and output dtype on first use. CUDA-graph capture compiles the layers' kernels, but the LM head runs
outside the graphs (and without graphs nothing is captured), so the first
step that decodes a single request would wait on the compiler mid-run
(~0.2 s for the LM head's fp32 variant)."""
from __future__ import annotations

import torch
from torch import nn

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.gemv import NORM_MAX_K, linear, logits, norm_gemv
from rollout_engine.layers.embedding import ParallelLMHead
from rollout_engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)


@torch.inference_mode()
def compile_one_row_kernels(model: nn.Module) -> int:
    """Run each distinct one-row product of `model` once (GPU only; layers in
    batch-invariant mode use their own kernels). Returns how many."""
    seen = set()
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            kind = "logits"
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            kind = "linear"
        else:
            continue
        weight, bias = module.weight, getattr(module, "bias", None)
        normed = isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)) and weight.shape[1] <= NORM_MAX_K
        key = (kind, tuple(weight.shape), weight.dtype, bias is not None, normed)
        if module.batch_invariant or key in seen or not use_kernel(weight):
            continue
        seen.add(key)
        x = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        if kind == "logits":  # the local product: no collective here
            logits(x, weight)
            continue
        linear(x, weight, bias)
        # Products that follow an RMSNorm take it inside at one row (models/decoder.py), with the
        # residual add before it; only the first layer's qkv has none.
        if normed:
            ones = torch.ones(weight.shape[1], dtype=weight.dtype, device=weight.device)
            for residual in ((None, x) if isinstance(module, QKVParallelLinear) else (x,)):
                norm_gemv(x, residual, ones, 1e-6, weight, bias)
    return len(seen)
