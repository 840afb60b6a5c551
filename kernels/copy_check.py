"""Copy a weight into place and flag non-finite values in the same pass
(one read of the source, one write of the destination), so a weight update
checks finiteness without a second pass over the weights or a host sync per
tensor. The flag is an int32 device scalar that becomes non-zero when a
stored value is NaN or infinite (checked after the cast to the destination's
dtype, so an fp32 value that overflows fp16 counts too).

One wrapper (`copy_and_check`), one torch reference (`copy_and_check_ref`)."""
from __future__ import annotations

import functools

import torch

from rollout_engine.kernels._triton import cdiv

BLOCK = 8192


def copy_and_check_ref(dst: torch.Tensor, src: torch.Tensor, flag: torch.Tensor) -> None:
    dst.copy_(src)
    flag.add_((~torch.isfinite(dst)).any().to(flag.dtype))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_check_kernel(src_ptr, dst_ptr, n, flag_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(src_ptr + offs, mask=mask, other=0.0).to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + offs, y, mask=mask)
        yf = y.to(tl.float32)
        bad = tl.sum(((yf != yf) | (tl.abs(yf) == float("inf"))).to(tl.int32), axis=0)
        if bad > 0:
            tl.atomic_max(flag_ptr, 1)

    return copy_check_kernel


def copy_and_check(dst: torch.Tensor, src: torch.Tensor, flag: torch.Tensor) -> None:
    """dst <- src (cast to dst's dtype); flag (int32, 1 element, dst's device)
    becomes non-zero if any stored value is not finite. Same shapes; src
    already on dst's device."""
    fused = (dst.is_cuda and src.device == dst.device and dst.is_contiguous() and src.is_contiguous()
             and dst.is_floating_point() and src.is_floating_point() and dst.numel() > 0)
    if not fused:
        copy_and_check_ref(dst, src, flag)
        return
    n = dst.numel()
    _kernel()[(cdiv(n, BLOCK),)](src, dst, n, flag, BLOCK=BLOCK, num_warps=8)
