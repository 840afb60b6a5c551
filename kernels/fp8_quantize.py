"""Per-token fp8 quantization of activations on the GPU in one launch: each
program takes one row, finds its largest magnitude and writes the row in
e4m3 with its fp32 multiplier. The values equal `kernels.fp8.quantize_rows`
(one scale per token) bit for bit: the multiplier is amax * (1 / 448) in
fp32, each element the fp32 product of x and the multiplier's reciprocal
(correctly rounded, taken once per row), cast to e4m3 round-to-nearest-even
with saturation at +-448 (the reference's clamp).
Torch's own ops take eight launches for this, each a pass over the rows."""
from __future__ import annotations

import functools

import torch

from rollout_engine.kernels._triton import next_pow2, pdl_args
from rollout_engine.kernels.fp8 import FP8, INV_E4M3_MAX

ONE_PASS_MAX = 8192  # widest row held in registers once; wider rows are read twice (the second from L2)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, INV_MAX: tl.constexpr, BLOCK: tl.constexpr,
                             ONE_PASS: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the kernel that wrote x
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * K
        cols = tl.arange(0, BLOCK)
        if ONE_PASS:
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
            s = tl.where(amax > 0, amax * INV_MAX, 1.0)
            tl.store(q_row + cols, (x * tl.fdiv(1.0, s, ieee_rounding=True)).to(tl.float8e4nv), mask=cols < K)
        else:
            amax = tl.max(tl.abs(tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)), axis=0)
            for k0 in range(BLOCK, K, BLOCK):
                kb = k0 + cols
                amax = tl.maximum(amax, tl.max(tl.abs(tl.load(x_row + kb, mask=kb < K, other=0.0).to(tl.float32)),
                                               axis=0))
            s = tl.where(amax > 0, amax * INV_MAX, 1.0)
            r = tl.fdiv(1.0, s, ieee_rounding=True)
            for k0 in range(0, K, BLOCK):
                kb = k0 + cols
                x = tl.load(x_row + kb, mask=kb < K, other=0.0).to(tl.float32)
                tl.store(q_row + kb, (x * r).to(tl.float8e4nv), mask=kb < K)
        tl.store(s_ptr + row, s)

    return quantize_rows_kernel


def quantize_rows_gpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit column stride, on a GPU with Triton) -> (q e4m3 [T, K]
    contiguous, scale_inv fp32 [T, 1]), equal to `quantize_rows(x)`."""
    t, k = x.shape
    q = torch.empty((t, k), dtype=FP8, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        one_pass = k <= ONE_PASS_MAX
        block = next_pow2(k) if one_pass else 2048
        _kernel()[(t,)](x, q, s, k, x.stride(0), INV_MAX=INV_E4M3_MAX, BLOCK=block, ONE_PASS=one_pass,
                        num_warps=8 if block >= 4096 else 4, **pdl_args(x))
    return q, s
