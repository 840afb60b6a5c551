"""Per-row fp8 quantization on the GPU in one launch: each program takes one
row, finds its largest magnitude (or takes the one given: a tensor-parallel
slice scaled over its whole row) and writes the row in e4m3 with its fp32
multiplier. Activations (one scale per token) and weights (one per output
row) both take it. The result equals `kernels.fp8.quantize_rows` /
`quantize_channels` bit for bit: the multiplier is amax * fp32(1 / 448),
each element the fp32 product of x and the multiplier's reciprocal (taken
once per row), rounded to e4m3 to nearest-even here in fp32 arithmetic, as
torch's conversion rounds (the GPU's own conversion instruction differs from
it on rare ties between subnormals), with the reference's clamp at +-448.
A row holding NaN or an infinity gets an infinite multiplier, so that a
finiteness check of the multipliers finds it. Torch's own ops take eight
launches for this, each a pass over the rows (with fp32 temporaries)."""
from __future__ import annotations

import functools

import torch

from rollout_engine.kernels._triton import next_pow2, pdl_args
from rollout_engine.kernels.fp8 import E4M3_MAX, FP32_TINY, FP8, INV_E4M3_MAX

ONE_PASS_MAX = 8192  # widest row held in registers once; wider rows are read twice (the second from L2)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    from rollout_engine.kernels.e4m3 import e4m3_value, libdevice

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, a_ptr, K, stride_x, stride_q, INV_MAX: tl.constexpr,
                             TINY: tl.constexpr, MAX: tl.constexpr, HAS_AMAX: tl.constexpr, BLOCK: tl.constexpr,
                             ONE_PASS: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the kernel that wrote x
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * stride_q
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        if HAS_AMAX:
            amax = tl.load(a_ptr + row).to(tl.float32)
        else:  # NaN counts as infinite: the row's multiplier is not finite
            amax = tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=0)
            if not ONE_PASS:
                for k0 in range(BLOCK, K, BLOCK):
                    xb = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.max(tl.where(xb == xb, tl.abs(xb), float("inf")), axis=0))
        s = tl.where(amax * INV_MAX >= TINY, amax * INV_MAX, 1.0)  # kernels/fp8.py: _scale_inv
        s = tl.where(amax == amax, s, amax)  # a given amax (HAS_AMAX) may be NaN: keep it non-finite
        r = libdevice.div_rn(s * 0.0 + 1.0, s)  # correctly rounded (Triton's own division is approximate)
        tl.store(q_row + cols, e4m3_value(x * r, MAX).to(tl.float8e4nv), mask=cols < K)
        if not ONE_PASS:
            for k0 in range(BLOCK, K, BLOCK):
                xb = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                tl.store(q_row + k0 + cols, e4m3_value(xb * r, MAX).to(tl.float8e4nv), mask=k0 + cols < K)
        tl.store(s_ptr + row, s)

    return quantize_rows_kernel


def quantize_rows_gpu(x: torch.Tensor, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                      amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit column stride, on a GPU with Triton) -> (q e4m3 [T, K],
    scale_inv fp32 [T, 1]), equal to `quantize_rows(x)` (and, for a weight,
    to `quantize_channels(x, amax=amax)`). `out` / `scale_out`: where to
    write them (rows with unit column stride; a contiguous [T, 1]);
    `amax` [T, 1]: the rows' largest magnitudes when they come from
    elsewhere (whole rows that x is a column slice of)."""
    t, k = x.shape
    q = torch.empty((t, k), dtype=FP8, device=x.device) if out is None else out
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device) if scale_out is None else scale_out
    if t:
        one_pass = k <= ONE_PASS_MAX
        block = next_pow2(k) if one_pass else 2048
        _kernel()[(t,)](x, q, s, amax if amax is not None else s, k, x.stride(0), q.stride(0), INV_MAX=INV_E4M3_MAX,
                        TINY=FP32_TINY, MAX=E4M3_MAX, HAS_AMAX=amax is not None, BLOCK=block, ONE_PASS=one_pass,
                        num_warps=8 if block >= 4096 else 4, **pdl_args(x))
    return q, s
