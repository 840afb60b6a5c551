"""Tensor-parallel collectives. The only place that imports torch.distributed;
layers call these methods and never see a process group. At tp_size=1 every
collective is the identity."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class TPComm:
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when tp_size > 1
    fast: Any = None  # a OneShotAllReduce for small messages (CUDA), see fast_allreduce.py
    fused: Any = None  # the all-reduce + residual add + RMSNorm in one kernel, see fused_norm.py

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got {self.tp_rank} of {self.tp_size}")
        if self.tp_size > 1 and self.group is None:
            raise ValueError("tp_size > 1 needs a process group")

    def with_fast_all_reduce(self, dtype: torch.dtype, device: torch.device) -> "TPComm":
        """This comm, with the one-shot path for small messages where it
        works (a collective: every rank calls it together)."""
        from rollout_engine.distributed.fast_allreduce import make_fast_all_reduce

        return replace(self, fast=make_fast_all_reduce(self.group, self.tp_size, dtype, device))

    def with_fused_norm(self, hidden: int, dtype: torch.dtype, device: torch.device) -> "TPComm":
        """This comm, with the all-reduce taken into the RMSNorm after it
        where that works (a collective: every rank calls it together)."""
        from rollout_engine.distributed.fused_norm import make_fused_norm

        return replace(self, fused=make_fused_norm(self, hidden, dtype, device))

    def fuses_norms(self, rows: int) -> bool:
        """Whether a forward of `rows` tokens leaves each row-parallel sum to
        the norm after it (`all_reduce_norm`)."""
        return self.fused is not None and rows <= self.fused.max_tokens

    def all_reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(all_reduce(x), residual) for an RMSNorm `norm` (its weight and
        eps): (normalised rows, new residual stream), in one kernel where the
        fused path takes these rows."""
        if self.fused is not None and self.fused.fits(x, residual):
            return self.fused(x, residual, norm.weight, norm.eps)
        return norm(self.all_reduce(x), residual)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks (the result may be `x` itself)."""
        if self.tp_size == 1:
            return x
        if self.fast is not None and self.fast.fits(x):
            return self.fast(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. KV capacity: all ranks
        must size their pools alike)."""
        if self.tp_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
