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


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose entries are split between tensor-parallel
    ranks (OLMoE's q and k norms, over the whole projection): each rank holds
    `local` entries and the matching slice of the weight (slice `index` of the
    full weight); the sum of squares is all-reduced. Ranks holding the same
    slice (replicated KV heads) add it equally often, so the mean is the sum
    over every rank's `local` entries."""

    def __init__(self, local: int, index: int, eps: float, comm, replicas: int = 1):
        super().__init__()
        self.eps, self.comm, self.local, self.index = eps, comm, local, index
        self.replicas = replicas  # consecutive ranks holding the same slice (weights/loader.py's layout)
        self.weight = nn.Parameter(torch.ones(local), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        from rollout_engine.layers.weight_copy import copy_into, expect_shape

        expect_shape(full, (self.local * (self.comm.tp_size // self.replicas),))
        copy_into(param.data, full.narrow(0, self.index * self.local, self.local))

    batch_invariant = False  # layers/invariant.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.tp_size == 1:  # a plain RMSNorm of each row (one program per row on the GPU)
            x = x.contiguous()
            gpu = use_kernel(x)
            if self.batch_invariant and not gpu and x.shape[0] > 1:
                return torch.cat([self.forward(x[i: i + 1]) for i in range(x.shape[0])])
            return (rmsnorm if gpu else rmsnorm_ref)(x, self.weight, self.eps, None)[0]
        xf = x.float()
        squares = self.comm.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        out = xf * torch.rsqrt(squares / (self.local * self.comm.tp_size) + self.eps)
        return self.weight * out.to(x.dtype)
