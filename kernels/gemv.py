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

from rollout_engine.kernels._triton import pdl_args, use_kernel


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
    def _tile(w_ptr, x_ptr, rows, n_mask, k0, K, stride_w, BLOCK_K: tl.constexpr):
        """One [rows, BLOCK_K] block of the weight times the same block of x, in fp32."""
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(w_ptr + rows[:, None] * stride_w + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        return w.to(tl.float32) * x.to(tl.float32)[None, :]

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """y = x W^T (+ b). PDL: the first weight block is read before waiting
        for the kernel before (no kernel writes weights); x only after."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        first = 0
        if PDL:
            k = tl.arange(0, BLOCK_K)
            w0 = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n_mask[:, None] & (k < K)[None, :],
                         other=0.0)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
            acc += w0.to(tl.float32) * tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            first = BLOCK_K
        for k0 in range(first, K, BLOCK_K):
            acc += _tile(w_ptr, x_ptr, n, n_mask, k0, K, stride_w, BLOCK_K)
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
    n, k = weight.shape
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    bn, bk, warps, *stages = config or _config(n, k)
    _kernel()[(-(-n // bn),)](x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
                              HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **pdl_args(x),
                              **({"num_stages": stages[0]} if stages else {}))
    return y


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
