from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Computed in fp32 and cast back before the weight, as Hugging Face does,
    so fp32 and bf16 results match the reference."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
