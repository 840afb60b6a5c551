"""SiLU(gate) * up over the fused gate_up projection output."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rollout_engine.kernels._triton import pdl_args


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, stride_x, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the kernel before (the product)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
        a = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like F.silu
        tl.store(out_ptr + t * N + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    return silu_mul_kernel


def silu_and_mul(x: torch.Tensor, block: int = 1024, warps: int = 4) -> torch.Tensor:
    tokens, two_n = x.shape
    n = two_n // 2
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens:
        _kernel()[(tokens, -(-n // block))](x, out, x.stride(0), n, BLOCK=block, num_warps=warps, **pdl_args(x))
    return out
