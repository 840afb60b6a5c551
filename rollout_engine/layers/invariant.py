"""Batch invariance for the layers (deterministic mode).

A matrix product or a row reduction can take a different path, and round
differently, when the number of rows changes. In deterministic mode the
layers whose result could depend on it avoid that: on the GPU, matrix
products run a kernel whose reduction order depends only on the weight's
shape (kernels/invariant_matmul.py) and RMSNorm's kernel is one program
per row already; on the CPU each row is computed alone, with the same shapes
whatever else is batched. Element-wise operations need nothing. Modules that
take part have a `batch_invariant` attribute, set per model by
`make_batch_invariant`."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.invariant_matmul import DECODE_MAX_ROWS, invariant_matmul


def per_row(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """fn(x) computed one row (first dimension) at a time."""
    if x.shape[0] <= 1:
        return fn(x, *args)
    return torch.cat([fn(x[i: i + 1], *args) for i in range(x.shape[0])])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), each row's bits independent of the other rows."""
    if use_kernel(x):
        return invariant_matmul(x, weight, bias)
    return per_row(F.linear, x, weight, bias)


def make_batch_invariant(model: nn.Module) -> int:
    """Switch every taking-part module of `model` to batch-invariant computation;
    returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
            count += 1
    return count


def compile_prompt_kernels(model: nn.Module) -> int:
    """Compile the matrix-product kernels of prompt-sized batches (more than
    DECODE_MAX_ROWS rows, both launch shapes) for every weight shape of a
    batch-invariant `model` on the GPU, so that the first long prompt does
    not wait for Triton (about half a second per shape; decode shapes are
    compiled by the CUDA-graph capture). Returns how many shapes."""
    seen = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not getattr(module, "batch_invariant", False) or weight is None or weight.dim() != 2:
            continue
        bias = getattr(module, "bias", None)
        key = (tuple(weight.shape), weight.dtype, bias is not None)
        if key in seen or not use_kernel(weight):
            continue
        seen.add(key)
        x = torch.zeros(DECODE_MAX_ROWS + 1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        for split in (True, False):
            invariant_matmul(x, weight, bias, split=split)
    return len(seen)
