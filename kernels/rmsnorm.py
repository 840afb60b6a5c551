"""RMSNorm, optionally fused with the residual add before it.

Numerics follow Hugging Face: the residual sum is rounded to the model dtype,
normalised in fp32, rounded, then scaled by the weight."""
from __future__ import annotations

import functools

import torch

from rollout_engine.kernels._triton import next_pow2, pdl_args


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new residual); the residual is x + residual when given."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, stride_xt, stride_xh, stride_rt, N, eps,
                       NUM_HEADS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if PDL:  # the weight above is never written by a kernel; the rest waits for the one before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + t * stride_rt + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r_out_ptr.dtype.element_ty)
            tl.store(r_out_ptr + t * N + cols, x, mask=mask)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        out = (y * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (t * NUM_HEADS + h) * N + cols, out, mask=mask)

    return rmsnorm_kernel


def _warps(n: int) -> int:
    """Warps per row: one for rows up to 1024 wide, eight for wider ones
    (benchmarks/small_kernels.py, H200: 1.84 -> 1.75 us at 256 x 1024,
    2.57 -> 2.45 us at 256 x 3584)."""
    return 1 if n <= 1024 else 8


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [T, N] or [T, H, N] (per-head norm; any token/head strides, unit
    stride inside a row). Outputs are contiguous."""
    n = x.shape[-1]
    tokens = x.shape[0]
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r_out = torch.empty((tokens, n), dtype=x.dtype, device=x.device) if residual is not None else None
    if tokens:
        _kernel()[(tokens, heads)](
            x, residual if residual is not None else x, weight, out, r_out if r_out is not None else out,
            x.stride(0), stride_h, residual.stride(0) if residual is not None else 0, n, eps,
            NUM_HEADS=heads, HAS_RES=residual is not None, BLOCK=next_pow2(n), num_warps=warps or _warps(n),
            **pdl_args(x))
    return out, r_out
