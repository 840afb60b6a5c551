"""Copy a weight into place and flag non-finite values in the same pass
(one read of the source, one write of the destination), so a weight update
checks finiteness without a second pass over the weights or a host sync per
tensor. The flag is an int32 device scalar that becomes non-zero when a
stored value is NaN or infinite (checked after the cast to the destination's
dtype, so an fp32 value that overflows fp16 counts too).

`check_finite` is the read-only half: the same flag, from one read of the
source and no write, so a whole update can be checked before its first copy
(an atomic update).

Wrappers `copy_and_check` / `check_finite`, torch references
`copy_and_check_ref` / `check_finite_ref`."""
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
    def copy_check_kernel(src_ptr, dst_ptr, n, flag_ptr, CHECK_DTYPE: tl.constexpr, WRITE: tl.constexpr,
                          BLOCK: tl.constexpr):
        # WRITE: store the cast values into dst and check what was stored;
        # otherwise only check the values cast to CHECK_DTYPE (dst unused).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src_ptr + offs, mask=mask, other=0.0)
        if WRITE:
            y = x.to(dst_ptr.dtype.element_ty)
            tl.store(dst_ptr + offs, y, mask=mask)
        else:
            y = x.to(CHECK_DTYPE)
        yf = y.to(tl.float32)
        bad = tl.sum(((yf != yf) | (tl.abs(yf) == float("inf"))).to(tl.int32), axis=0)
        if bad > 0:
            tl.atomic_max(flag_ptr, 1)

    return copy_check_kernel


def check_finite_ref(src: torch.Tensor, dtype: torch.dtype, flag: torch.Tensor) -> None:
    for chunk in src.reshape(-1).split(1 << 24):  # bounded scratch memory for a large host tensor
        flag.add_((~torch.isfinite(chunk.to(dtype))).any().to(flag.device, flag.dtype))


_TRITON_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_finite(src: torch.Tensor, dtype: torch.dtype, flag: torch.Tensor) -> None:
    """flag (int32, 1 element) becomes non-zero if any value of `src`, cast
    to `dtype`, is not finite. Reads `src` once; writes nothing else."""
    fused = (src.is_cuda and flag.device == src.device and src.is_contiguous() and src.dtype in _TRITON_DTYPES
             and dtype in _TRITON_DTYPES and src.numel() > 0)
    if not fused:
        check_finite_ref(src, dtype, flag)
        return
    import triton.language as tl

    n = src.numel()
    _kernel()[(cdiv(n, BLOCK),)](src, src, n, flag, CHECK_DTYPE=getattr(tl, _TRITON_DTYPES[dtype]), WRITE=False,
                                 BLOCK=BLOCK, num_warps=8)


def copy_and_check(dst: torch.Tensor, src: torch.Tensor, flag: torch.Tensor) -> None:
    """dst <- src (cast to dst's dtype); flag (int32, 1 element, dst's device)
    becomes non-zero if any stored value is not finite. Same shapes; src
    already on dst's device."""
    fused = (dst.is_cuda and src.device == dst.device and dst.is_contiguous() and src.is_contiguous()
             and dst.is_floating_point() and src.is_floating_point() and dst.numel() > 0)
    if not fused:
        copy_and_check_ref(dst, src, flag)
        return
    import triton.language as tl

    n = dst.numel()
    _kernel()[(cdiv(n, BLOCK),)](src, dst, n, flag, CHECK_DTYPE=tl.float32, WRITE=True, BLOCK=BLOCK, num_warps=8)
