"""The fp8 product (quantization="fp8"): x W^T for an e4m3 weight with one
scale per output row. The activations are quantized per token on the fly
(kernels/fp8.py: quantize_rows), so y = (q_x q_W^T) * s_x * s_W.

On a GPU, where the shapes allow (both dimensions of W multiples of 16), the
products run on the tensor cores in fp8 with fp32 sums: one row by
`kernels.fp8_row` (the row quantized inside the product: one launch; it is
measured faster in the step than a gemv on CUDA cores, which converts e4m3
element by element); otherwise the rows are quantized in one launch
(kernels/fp8_quantize.py) and multiplied, up to MAX_FP8_ROWS rows by
`kernels.batch_gemm` (tiles and split reductions that fill the GPU), more by
`torch._scaled_mm` (row-wise scales, the bias in its epilogue, output in x's
dtype; `FAST_ACCUM`: the tensor cores' own running sums, whose precision on
Hopper is below fp32's, where the Triton kernels here promote every 128
products into fp32: on an H200 +3.5% fp8 grpo throughput (+5.4% with the
e4m3 cache), the products' largest error 0.5-1.2% of their largest output
against 0.25% promoted, and no
change in the engine's distance from bf16 beyond run-to-run noise:
BENCHMARKS.md, "Triton decode tiles").
Elsewhere, and on the CPU, the same arithmetic in fp32 from the dequantized
operands: the reference the GPU paths are held to."""
from __future__ import annotations

import torch

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.batch_gemm import MAX_FP8_ROWS, fp8_batch_gemm
from rollout_engine.kernels.fp8 import quantize_rows
from rollout_engine.kernels.fp8_quantize import quantize_rows_gpu
from rollout_engine.kernels.fp8_row import fp8_one_row, fp8_row

# `torch._scaled_mm`'s use_fast_accum (benchmarks/ab_switch.py turns it off for A/B runs).
FAST_ACCUM = True


def scaled_mm_fits(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.is_cuda and n % 16 == 0 and k % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] in the engine dtype, weight e4m3 [N, K], scale_inv fp32
    [N, 1] -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if fp8_one_row(rows, weight):
        y = fp8_row(rows, weight, scale_inv, bias)[0]
    elif scaled_mm_fits(weight) and x.dtype == torch.bfloat16:  # row-wise scales: bf16 output only
        kernels = use_kernel(rows) and rows.stride(1) == 1
        q, s = quantize_rows_gpu(rows) if kernels else quantize_rows(rows)
        if kernels and rows.shape[0] <= MAX_FP8_ROWS:  # decode batches: tiles that fill the GPU
            y = fp8_batch_gemm(q, s, weight, scale_inv, bias, x.dtype)
        else:
            y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale_inv.view(1, -1), bias=bias,
                                 out_dtype=x.dtype, use_fast_accum=FAST_ACCUM)
    else:
        q, s = quantize_rows(rows)
        y = ((q.float() @ weight.float().t()) * s * scale_inv.t())
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])
