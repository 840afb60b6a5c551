"""Weights of FP8 checkpoints (Qwen3-FP8, DeepSeek-V3 style): an e4m3
`X.weight` with fp32 block scales `X.weight_scale_inv` [ceil(N / 128),
ceil(K / 128)]. Every path that takes (name, tensor) pairs (loading, the
updates, their checks) sees such a weight as one fp32 tensor `X.weight`, its
values read back through the block scales (kernels/fp8.py:
dequantize_blocks); an engine in bf16 or fp32 holds them so, and an fp8
engine quantizes them into its own layout (one scale per output row), as it
does any update. The two halves may come in either order and apart (other
tensors between them); one whose other half never comes is a ValueError
naming it."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from rollout_engine.kernels.fp8 import BLOCK, FP8, dequantize_blocks

SCALE_SUFFIX = "_scale_inv"


def _dequantize(name: str, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    if q.dim() != 2:
        raise ValueError(f"{name}: an FP8 weight with block scales must be 2-D, got shape {tuple(q.shape)}")
    want = (-(-q.shape[0] // BLOCK), -(-q.shape[1] // BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)}, but {BLOCK}x{BLOCK} blocks of "
                         f"a {tuple(q.shape)} weight need {want}")
    if q.device.type == "meta" or scale_inv.device.type == "meta":
        return torch.empty(q.shape, dtype=torch.float32, device="meta")
    return dequantize_blocks(q, scale_inv.to(q.device))


def dequantized(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` with each FP8 weight and its block scales joined into
    one fp32 tensor under the weight's name; everything else as it comes."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in weights:
                yield base, _dequantize(base, weights.pop(base), tensor)
            else:
                scales[base] = tensor
        elif isinstance(tensor, torch.Tensor) and tensor.dtype == FP8:
            if name in scales:
                yield name, _dequantize(name, tensor, scales.pop(name))
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights:
        raise ValueError(f"{min(weights)}: an e4m3 weight without its {SCALE_SUFFIX} (the block scales FP8 "
                         f"checkpoints store beside it)")
    if scales:
        raise ValueError(f"{min(scales)}{SCALE_SUFFIX}: block scales without their e4m3 weight {min(scales)}")
