from __future__ import annotations

import torch
from torch import nn

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.rmsnorm import rmsnorm, rmsnorm_ref


class RMSNorm(nn.Module):
    """Computed in fp32 and rounded before the weight, as Hugging Face does.
    With `residual`, adds it first and also returns the new residual stream
    (one fused kernel on the GPU). A 3-D input is normalised per head."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    batch_invariant = False  # layers/invariant.py

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        gpu = use_kernel(x)  # the kernel is one program per row: invariant as it is
        if self.batch_invariant and not gpu and x.shape[0] > 1:
            return self._per_row(x, residual)
        fn = rmsnorm if gpu else rmsnorm_ref
        out, new_residual = fn(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)

    def _per_row(self, x: torch.Tensor, residual: torch.Tensor | None):
        rows = [self.forward(x[i: i + 1], None if residual is None else residual[i: i + 1]) for i in range(x.shape[0])]
        if residual is None:
            return torch.cat(rows)
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
