"""The one-row kernels (batch-1 decode) compiled when the engine is built.

At one row the linear layers and the LM head run Triton gemv kernels
(`kernels/gemv.py`; fp8 layers `kernels/fp8_row.py`; in decoder layers with
the norm, rotary embedding or activation inside: their `compile_one_row`),
compiled per weight shape and output dtype on first use. CUDA-graph capture compiles the layers' kernels
and the LM head's in the graphs' tails, but a step that samples with filters
or top logprobs runs the LM head outside the graphs (and without graphs
nothing is captured), so its first batch-1 step would wait on the compiler
mid-run (~0.2 s for the LM head's fp32 variant)."""
from __future__ import annotations

import torch
from torch import nn

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.fp8 import FP8
from rollout_engine.kernels.gemv import logits
from rollout_engine.layers.embedding import ParallelLMHead
from rollout_engine.layers.linear import ColumnParallelLinear, RowParallelLinear


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
        key = (kind, tuple(weight.shape), weight.dtype, bias is not None)
        if module.batch_invariant or key in seen or not use_kernel(weight):
            continue
        seen.add(key)
        dtype = torch.bfloat16 if weight.dtype == FP8 else weight.dtype  # fp8 runs with bf16 activations only
        x = torch.zeros(1, weight.shape[1], dtype=dtype, device=weight.device)
        if kind == "logits":  # the local product: no collective here
            logits(x, weight)
            continue
        module.product(x, bias)
    # The products with a norm, rotary embedding or activation inside (models/decoder.py): the layers
    # of a model share their shapes, so the first layer's variants are all of them.
    layer = next((m for m in model.modules() if hasattr(m, "compile_one_row")), None)
    if layer is not None and use_kernel(next(layer.parameters())):
        layer.compile_one_row()
    return len(seen)
