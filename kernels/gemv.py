"""Matrix-vector product for one-token steps (batch-1 decode): y = x W^T (+ b)
for x [1, K], W [N, K]. At one row the GEMM libraries pick tiles built for
more rows (and split-K reductions); a plain streaming kernel reads the weight
closer to the memory bandwidth (BENCHMARKS.md). Other shapes use F.linear.

`logits` is the LM head's product with an fp32 result written by the product
itself (the accumulator, not a bf16 copy widened by a second kernel: the
sampler reads fp32 logits). On Hopper the kernel is launched with
programmatic dependent launch (`_triton.PDL_ENABLED`): its first weight block
is read while the kernel before it finishes."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rollout_engine.kernels._triton import next_pow2, pdl_args, use_kernel


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps), measured on H200 for 8B-sized layers
    (benchmarks/gemv_configs.py; llama-3.1-8b's qkv, 6144 x 4096, launched with
    programmatic dependent launch: 3.36 TB/s with 4 warps, 3.99 with 8)."""
    if k >= 8192:
        return 16, 1024, 8
    if n <= 4096:
        return 4, 1024, 4
    if n >= 16384:
        return 16, 256, 4
    return 16, 512, 8


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _input(x_ptr, r_ptr, g_ptr, k, k_mask, inv, NORM: tl.constexpr, HAS_RES: tl.constexpr):
        """A block of the product's input in fp32: x, or with NORM the RMSNorm of
        x (+ the residual), rounded as the RMSNorm kernel rounds (`inv`: 1 / rms)."""
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        if NORM:
            dt = x.dtype
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(r_ptr + k, mask=k_mask, other=0.0).to(tl.float32)).to(dt)
            g = tl.load(g_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * inv).to(dt).to(tl.float32) * g).to(dt)
        return x.to(tl.float32)

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, g_ptr, r_out_ptr, N, K, stride_w, eps,
                    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, K_P2: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """y = x W^T (+ b). NORM: y = RMSNorm(x (+ r)) W^T (+ b), the norm's
        weight at g; with HAS_RES, x + r is the new residual stream, written
        to r_out by the first program. PDL: the first weight block is read
        before waiting for the kernel before (no kernel writes weights); x
        and r only after."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        k = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        inv = 1.0
        if NORM:  # the whole row once, for its root mean square
            kk = tl.arange(0, K_P2)
            row = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
            if HAS_RES:
                row = (row.to(tl.float32) + tl.load(r_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)).to(row.dtype)
                if tl.program_id(0) == 0:
                    tl.store(r_out_ptr + kk, row, mask=kk < K)
            rf = row.to(tl.float32)
            inv = tl.rsqrt(tl.sum(rf * rf, axis=0) / K + eps)
        acc = w0.to(tl.float32) * _input(x_ptr, r_ptr, g_ptr, k, k < K, inv, NORM, HAS_RES)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kb = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + n[:, None] * stride_w + kb[None, :], mask=n_mask[:, None] & (kb < K)[None, :],
                        other=0.0)
            acc += w.to(tl.float32) * _input(x_ptr, r_ptr, g_ptr, kb, kb < K, inv, NORM, HAS_RES)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_mask)

    return gemv_kernel


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x: [1, K] contiguous; weight: [N, K] with unit column stride. The
    result is in `out_dtype` (default: x's). `config` overrides the launch
    shape, (BLOCK_N, BLOCK_K, warps[, stages]) (benchmarks/gemv_configs.py)."""
    return _launch(x, weight, bias, out_dtype, config)[0]


def _launch(x, weight, bias=None, out_dtype=None, config=None, norm=None, residual=None):
    n, k = weight.shape
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    r_out = torch.empty_like(x) if residual is not None else x
    g, eps = norm if norm is not None else (weight, 0.0)
    bn, bk, warps, *stages = config or _config(n, k)
    _kernel()[(-(-n // bn),)](x, weight, bias if bias is not None else weight, y,
                              residual if residual is not None else x, g, r_out, n, k, weight.stride(0), eps,
                              HAS_BIAS=bias is not None, NORM=norm is not None, HAS_RES=residual is not None,
                              K_P2=next_pow2(k) if norm is not None else 1, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                              **pdl_args(x), **({"num_stages": stages[0]} if stages else {}))
    return y, r_out


NORM_MAX_K = 8192  # widest input normalised inside the product (the row is held in registers once)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) W^T (+ b) for one row in one launch (the norm
    rounded as `kernels.rmsnorm` rounds it, its sum of squares possibly added
    in another order; then the product as `gemv`). Returns
    (product, new residual stream: x + residual, or x when residual is None).
    For `one_row` inputs of at most NORM_MAX_K columns."""
    return _launch(x, weight, bias, norm=(norm_weight, eps), residual=residual)


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x W^T takes the gemv kernel: one contiguous half-precision row, on the GPU."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16) and use_kernel(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the one-row GPU case in `gemv`."""
    if one_row(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


# torch.mm(..., out_dtype=torch.float32): the `mm.dtype` overload, absent from older torch builds
_MM_FP32_OUT = hasattr(torch.ops.aten.mm, "dtype")


def logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in fp32 for x [T, K] and a bf16/fp16 weight [N, K]: the GEMM (or
    the one-row gemv) writes its fp32 accumulator directly."""
    if one_row(x, weight):
        return gemv(x, weight, out_dtype=torch.float32)
    if _MM_FP32_OUT and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x, weight).float()
