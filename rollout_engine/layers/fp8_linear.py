"""The fp8 product (quantization="fp8"): x W^T for an e4m3 weight with one
scale per output row. The activations are quantized per token on the fly
(kernels/fp8.py: quantize_rows), so y = (q_x q_W^T) * s_x * s_W. On a GPU
the product is one `torch._scaled_mm` (row-wise scales, fp32 accumulation,
output in x's dtype) where its shape rules allow (both dimensions of W
multiples of 16); elsewhere, and on the CPU, the same arithmetic in fp32 from
the dequantized operands, the reference the GPU path is held to."""
from __future__ import annotations

import torch

from rollout_engine.kernels.fp8 import quantize_rows


def scaled_mm_fits(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.is_cuda and n % 16 == 0 and k % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] in the engine dtype, weight e4m3 [N, K], scale_inv fp32
    [N, 1] -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, s = quantize_rows(rows)
    if scaled_mm_fits(weight) and x.dtype == torch.bfloat16:  # row-wise scales: bf16 output only
        y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale_inv.view(1, -1), out_dtype=x.dtype)
        y = y if bias is None else y + bias
    else:
        y = ((q.float() @ weight.float().t()) * s * scale_inv.t())
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])
