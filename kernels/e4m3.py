"""Rounding to e4m3 inside Triton kernels exactly as torch rounds, and the
KV cache's store rule, shared by every kernel that writes K/V.

`e4m3_value` rounds fp32 to the nearest e4m3 value (ties to even) in fp32
arithmetic, as torch's conversion does; the GPU's own conversion
instruction differs from it on rare ties between subnormals. Kernels that
write e4m3 call it before the cast, so their bytes equal the torch
references'.

The KV cache (`kv_cache_dtype`): a value bound for the cache is first
rounded to the model's dtype (the K/V the model computed); an e4m3 cache
then holds that value clamped to +-448 and rounded to e4m3, with the
fixed scale 1 (no multiplier: the attention kernels read the values as
they are). `to_kv` is the torch rule, `kv_value` the Triton one."""
from __future__ import annotations

import importlib.util

import torch

from rollout_engine.kernels.fp8 import E4M3_MAX, FP8


def to_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x (in the model's dtype) as the KV cache holds it."""
    if cache_dtype == FP8:
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return x.to(cache_dtype)


if importlib.util.find_spec("triton") is not None:  # module level: kernels in other modules call these
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except ImportError:  # older Triton
        from triton.language.extra.cuda import libdevice

    @triton.jit
    def e4m3_value(y, MAX: tl.constexpr):
        """fp32 y rounded to the nearest e4m3 value (ties to even), as fp32:
        normal magnitudes keep 3 mantissa bits (the integer form of
        round-to-nearest-even on the fp32 bits), those below 2^-6 become
        multiples of 2^-9 (rint: to nearest, ties to even), and magnitudes
        past MAX (448) saturate. The sign is y's, -0 included."""
        bits = y.to(tl.int32, bitcast=True)
        a = tl.abs(y)
        ab = a.to(tl.int32, bitcast=True)
        normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: ~0xFFFFF
        sub = libdevice.rint(a * 512.0) * 0.001953125  # multiples of 2^-9 (scalings by powers of two are exact)
        r = tl.minimum(tl.where(a < 0.015625, sub, normal), MAX)
        # y's sign bit onto r (bit 31; -r would be 0 - r, which is +0 for r = 0)
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def kv_value(x, dt: tl.constexpr, cache_ty: tl.constexpr):
        """x (any float type) as the KV cache of element type `cache_ty`
        holds it, `dt` being the model's dtype: `to_kv` in Triton."""
        x = x.to(dt)
        if cache_ty == tl.float8e4nv:
            return e4m3_value(x.to(tl.float32), 448.0).to(cache_ty)
        return x.to(cache_ty)
