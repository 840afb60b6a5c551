"""Batch invariance for the layers (deterministic mode).

A matrix product or a row reduction can take a different path, and round
differently, when the number of rows changes. In deterministic mode the
layers whose result could depend on it avoid that. On the GPU, matrix
products run through cuBLAS called at one row count (`layers.fixed_rows`)
for the weight shapes a check at start finds invariant, else through a
kernel whose reduction order depends only on the weight's shape
(kernels/invariant_matmul.py); RMSNorm's kernel is one program per row
already. On the CPU each row is computed alone, with the same shapes
whatever else is batched. Element-wise operations need nothing. Modules
that take part have a `batch_invariant` attribute, set per model by
`make_batch_invariant`."""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.invariant_matmul import invariant_matmul, launches_to_compile
from rollout_engine.layers import fixed_rows

log = logging.getLogger("rollout_engine")


def per_row(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """fn(x) computed one row (first dimension) at a time."""
    if x.shape[0] <= 1:
        return fn(x, *args)
    return torch.cat([fn(x[i: i + 1], *args) for i in range(x.shape[0])])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), each row's bits independent of the other rows."""
    if use_kernel(x):
        if fixed_rows.takes(weight, bias):
            return fixed_rows.linear(x, weight, bias)
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


def prepare_products(model: nn.Module) -> tuple[int, int]:
    """Make every matrix product of a batch-invariant `model` on the GPU
    ready before the first step: each weight shape is checked for cuBLAS at
    a fixed row count (`fixed_rows.verify`), and the shapes that fail (or
    all, with `fixed_rows.ENABLED` off) get their Triton kernels compiled
    (each bucket of the tile picks, each launch shape), so that no step of a
    rollout waits for Triton: a prompt, a short chunk or the LM head over a
    few sampled rows runs outside the CUDA graphs and may land in a bucket
    no captured batch size touched (about half a second per kernel, once per
    machine: Triton keeps them on disk). Returns (shapes through cuBLAS,
    shapes through Triton)."""
    seen, cublas, triton = set(), 0, 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not getattr(module, "batch_invariant", False) or weight is None or weight.dim() != 2:
            continue
        bias = getattr(module, "bias", None)
        key = (tuple(weight.shape), weight.dtype, bias is not None)
        if key in seen or not use_kernel(weight):
            continue
        seen.add(key)
        if fixed_rows.ENABLED and fixed_rows.verify(weight, bias):
            cublas += 1
            continue
        triton += 1
        n, k = weight.shape
        for rows, split in launches_to_compile(n, k, weight.device):
            x = torch.zeros(rows, k, dtype=weight.dtype, device=weight.device)
            invariant_matmul(x, weight, bias, split=split)
    if triton and fixed_rows.ENABLED:
        log.warning("deterministic mode: %d of %d product shapes failed the check of cuBLAS at %d rows and take "
                    "the slower Triton kernels", triton, cublas + triton, fixed_rows.ROWS)
    log.info("deterministic mode: %d product shapes through cuBLAS at %d rows, %d through Triton kernels", cublas,
             fixed_rows.ROWS, triton)
    if seen and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the checks' blocks and their graph's pool (the caller holds DEVICE_WIDE)
    return cublas, triton
