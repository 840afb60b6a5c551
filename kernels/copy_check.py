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


def check_finite_ref(src: torch.Tensor, dtype: torch.dtype, flag: torch.Tensor) -> None:
    for chunk in src.reshape(-1).split(1 << 24):  # bounded scratch memory for a large host tensor
        flag.add_((~torch.isfinite(chunk.to(dtype))).any().to(flag.device, flag.dtype))


@functools.cache
def _check_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def check_kernel(src_ptr, n, flag_ptr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        y = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(OUT_DTYPE).to(tl.float32)
        bad = tl.sum(((y != y) | (tl.abs(y) == float("inf"))).to(tl.int32), axis=0)
        if bad > 0:
            tl.atomic_max(flag_ptr, 1)

    return check_kernel


_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_finite(src: torch.Tensor, dtype: torch.dtype, flag: torch.Tensor) -> None:
    """flag (int32, 1 element) becomes non-zero if any value of `src`, cast
    to `dtype`, is not finite. Reads `src` once; writes nothing else."""
    fused = (src.is_cuda and flag.device == src.device and src.is_contiguous() and src.is_floating_point()
             and src.dtype in _TRITON_DTYPES and dtype in _TRITON_DTYPES and src.numel() > 0)
    if not fused:
        check_finite_ref(src, dtype, flag)
        return
    import triton.language as tl

    n = src.numel()
    out = getattr(tl, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[_TRITON_DTYPES[dtype]])
    _check_kernel()[(cdiv(n, BLOCK),)](src, n, flag, OUT_DTYPE=out, BLOCK=BLOCK, num_warps=8)


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
