"""Batch invariance for the layers (deterministic mode on the CPU).

A matrix product or a row reduction can take a different path, and round
differently, when the number of rows changes. In deterministic mode the
layers whose result could depend on it compute each row alone: the same
shapes whatever else is batched, so the same bits. Element-wise operations
need nothing. Modules that take part have a `batch_invariant` attribute,
set per model by `make_batch_invariant`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def per_row(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
    """fn(x) computed one row (first dimension) at a time."""
    if x.shape[0] <= 1:
        return fn(x, *args)
    return torch.cat([fn(x[i: i + 1], *args) for i in range(x.shape[0])])


def make_batch_invariant(model: nn.Module) -> int:
    """Switch every taking-part module of `model` to per-row computation;
    returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
            count += 1
    return count
