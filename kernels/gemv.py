"""Matrix-vector product for one-token steps (batch-1 decode): y = x W^T (+ b)
for x [1, K], W [N, K]. At one row the GEMM libraries pick tiles built for
more rows (and split-K reductions); a plain streaming kernel reads the weight
closer to the memory bandwidth (BENCHMARKS.md). 2-32 rows take
`kernels.batch_gemm`, other shapes F.linear.

`logits` is the LM head's product with an fp32 result written by the product
itself (the accumulator, not a bf16 copy widened by a second kernel: the
sampler reads fp32 logits). `norm_gemv` takes the RMSNorm before the product
inside it and, with each program computing its rows in pairs, the rotary
embedding and K/V store after a qkv product or SiLU * mul after a gate_up
product: at batch 1 a decoder layer is five launches. On Hopper the kernel is
launched with programmatic dependent launch (`_triton.PDL_ENABLED`): its first
weight block is read while the kernel before it finishes."""
from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rollout_engine.kernels._triton import half_rows_on_gpu, next_pow2, pdl_args
from rollout_engine.kernels import batch_gemm as _batch_gemm
from rollout_engine.kernels.batch_gemm import batch_gemm, gated_batch_gemm, small_batch, wide_batch


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


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the kernel
    import triton
    import triton.language as tl

    from rollout_engine.kernels.row_parts import finish_rows, paired_rows, row_input, row_inv_rms

    @triton.jit
    def _weight_block(w_ptr, n, n_mask, stride_w, k0, K, BLOCK_K: tl.constexpr):
        """Columns [k0, k0 + BLOCK_K) of the program's weight rows (zeros past K)."""
        kb = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w_ptr + n[:, None] * stride_w + kb[None, :], mask=n_mask[:, None] & (kb < K)[None, :],
                       other=0.0)

    @triton.jit
    def _add_block(acc, w, x_ptr, r_ptr, g_ptr, kb, K, inv, NORM: tl.constexpr, HAS_RES: tl.constexpr):
        """acc + w * the input's columns kb in one fused multiply-add (one
        rounding: what the compiler made of the product and the sum before,
        and the same under Triton's interpreter whichever block it is)."""
        return tl.fma(w.to(tl.float32), row_input(x_ptr, r_ptr, g_ptr, kb, kb < K, inv, NORM, HAS_RES)[None, :], acc)

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, g_ptr, r_out_ptr, N, K, stride_w, eps,
                    pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr, vc_ptr,
                    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, K_P2: tl.constexpr,
                    GATED: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, NQ: tl.constexpr,
                    NK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr,
                    PDL: tl.constexpr):
        """y = x W^T (+ b). NORM: y = RMSNorm(x (+ r)) W^T (+ b), the norm's
        weight at g; with HAS_RES, x + r is the new residual stream, written
        to r_out by the first program. GATED / ROPE: `row_parts.finish_rows`.
        PDL: the first PRE weight blocks (1-4) are read before waiting for the
        kernel before (no kernel writes weights); x and r only after."""
        pid = tl.program_id(0)
        n = paired_rows(pid, BLOCK_N, ROPE or GATED, HALF)
        n_mask = n < N
        k = tl.arange(0, BLOCK_K)
        w0 = _weight_block(w_ptr, n, n_mask, stride_w, 0, K, BLOCK_K)
        w1, w2, w3 = w0, w0, w0  # blocks 1-3, read here too where PRE says
        if PRE > 1:
            w1 = _weight_block(w_ptr, n, n_mask, stride_w, BLOCK_K, K, BLOCK_K)
        if PRE > 2:
            w2 = _weight_block(w_ptr, n, n_mask, stride_w, 2 * BLOCK_K, K, BLOCK_K)
        if PRE > 3:
            w3 = _weight_block(w_ptr, n, n_mask, stride_w, 3 * BLOCK_K, K, BLOCK_K)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        inv = 1.0
        if NORM:  # the whole row once, for its root mean square
            inv = row_inv_rms(x_ptr, r_ptr, r_out_ptr, K, eps, pid, HAS_RES, K_P2)
        acc = w0.to(tl.float32) * row_input(x_ptr, r_ptr, g_ptr, k, k < K, inv, NORM, HAS_RES)[None, :]
        if PRE > 1:  # the blocks read early, added in the loop's order
            acc = _add_block(acc, w1, x_ptr, r_ptr, g_ptr, BLOCK_K + k, K, inv, NORM, HAS_RES)
        if PRE > 2:
            acc = _add_block(acc, w2, x_ptr, r_ptr, g_ptr, 2 * BLOCK_K + k, K, inv, NORM, HAS_RES)
        if PRE > 3:
            acc = _add_block(acc, w3, x_ptr, r_ptr, g_ptr, 3 * BLOCK_K + k, K, inv, NORM, HAS_RES)
        for k0 in range(PRE * BLOCK_K, K, BLOCK_K):
            w = _weight_block(w_ptr, n, n_mask, stride_w, k0, K, BLOCK_K)
            acc = _add_block(acc, w, x_ptr, r_ptr, g_ptr, k0 + k, K, inv, NORM, HAS_RES)
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        finish_rows(y, pid, n, n_mask, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr, vc_ptr,
                    GATED, ROPE, HALF, NQ, NK, BLOCK_N)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x: [1, K] contiguous; weight: [N, K] with unit column stride. The
    result is in `out_dtype` (default: x's). `config` overrides the launch
    shape, (BLOCK_N, BLOCK_K, warps[, stages]) (benchmarks/gemv_configs.py)."""
    return _launch(x, weight, bias, out_dtype, config)[0]


class RopeStore(NamedTuple):
    """Where a one-row qkv product puts q, k and v after the rotary embedding
    (neox layout, `kernels.rope`): q into the product's result, k and v into
    the layer's caches at the token's slot."""
    positions: torch.Tensor  # [1]
    cos: torch.Tensor  # [max_position, head_dim] fp32 tables
    sin: torch.Tensor
    k_cache: torch.Tensor  # [slots, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor
    loc: torch.Tensor  # [1]: the token's slot
    num_q_heads: int
    num_kv_heads: int


# Weight blocks each program reads before its dependent-launch wait (1-4), where
# they fit PRELOAD_PER_THREAD weight elements a thread: read while the kernel
# before runs, which at batch 1 (attention above all) leaves the memory idle.
PRELOAD_BLOCKS = 1
PRELOAD_PER_THREAD = 128


def preload_blocks(k: int, block_n: int, block_k: int, warps: int) -> int:
    """How many of a program's weight blocks the launch reads before its
    wait: PRELOAD_BLOCKS (1 to 4), at most the blocks K has and what fits."""
    if not 1 <= PRELOAD_BLOCKS <= 4:
        raise ValueError(f"gemv.PRELOAD_BLOCKS: 1 to 4 weight blocks read before the wait, got {PRELOAD_BLOCKS}")
    fits = PRELOAD_PER_THREAD * 32 * warps // (block_n * block_k)
    return max(1, min(PRELOAD_BLOCKS, -(-k // block_k), fits))


def _launch(x, weight, bias=None, out_dtype=None, config=None, norm=None, residual=None, gated=False, rope=None):
    n, k = weight.shape
    bn, bk, warps, *stages = config or _config(n, k)
    r_out = torch.empty_like(x) if residual is not None else x
    g, eps = norm if norm is not None else (weight, 0.0)
    ep = epilogue(weight, rope, gated, bn)
    y = torch.empty((1, ep.n_out), dtype=out_dtype or x.dtype, device=x.device)
    gemv_kernel[(-(-n // bn),)](x, weight, bias if bias is not None else weight, y,
                            residual if residual is not None else x, g, r_out, n, k, weight.stride(0), eps,
                            *ep.pointers, HAS_BIAS=bias is not None, NORM=norm is not None,
                            HAS_RES=residual is not None, K_P2=next_pow2(k) if norm is not None else 1,
                            GATED=gated, ROPE=rope is not None, HALF=ep.half, NQ=ep.nq, NK=ep.nk, BLOCK_N=bn,
                            BLOCK_K=bk, PRE=preload_blocks(k, bn, bk, warps), num_warps=warps, **pdl_args(x),
                            **({"num_stages": stages[0]} if stages else {}))
    return y, r_out


class Epilogue(NamedTuple):
    """What a one-row product does with its finished rows (`row_parts.finish_rows`)."""
    n_out: int  # columns of the product's result
    half: int
    nq: int
    nk: int
    pointers: tuple  # positions, slot, cos, sin, cos row stride, k cache, v cache (placeholders without rope)


def epilogue(weight: torch.Tensor, rope: "RopeStore | None", gated: bool, block_n: int) -> Epilogue:
    """The epilogue constants of a one-row product of `weight` [n, k] whose
    programs take `block_n` rows each: ValueError where `rope` or `gated`
    cannot pair its rows (`rows_pair`)."""
    n = weight.shape[0]
    placeholders = (weight, weight, weight, weight, 0, weight, weight)
    if rope is not None:
        nq, nk, half = rope.num_q_heads, rope.num_kv_heads, rope.k_cache.shape[-1] // 2
        if not (rows_pair(block_n, n, 2 * half) and n == (nq + 2 * nk) * 2 * half and rope.k_cache.is_contiguous()
                and rope.v_cache.is_contiguous()):
            raise ValueError(f"rope: a qkv product of {nq} + 2 x {nk} heads of {2 * half} cannot take "
                             f"a weight of shape {tuple(weight.shape)}")
        return Epilogue(nq * 2 * half, half, nq, nk,
                        (rope.positions, rope.loc, rope.cos, rope.sin, rope.cos.stride(0), rope.k_cache, rope.v_cache))
    if gated:
        if not rows_pair(block_n, n, n):
            raise ValueError(f"gated: a gate_up weight of shape {tuple(weight.shape)} does not split in pairs")
        return Epilogue(n // 2, n // 2, 1, 1, placeholders)
    return Epilogue(n, 1, 1, 1, placeholders)


NORM_MAX_K = 8192  # widest input normalised inside the product (the row is held in registers once)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, rope: RopeStore | None = None,
              gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) W^T (+ b) for one row in one launch (the norm
    rounded as `kernels.rmsnorm` rounds it, its sum of squares possibly added
    in another order; then the product as `gemv`). Returns
    (product, new residual stream: x + residual, or x when residual is None).
    For `one_row` inputs of at most NORM_MAX_K columns. Each program can
    compute pairs of rows and finish them (`pairs_fit`): with `rope` (a qkv
    product) the result is q after the rotary embedding, and k and v are
    written to the caches, as `kernels.rope.rope_and_store` does; `gated` (a
    gate_up product) gives SiLU(gate) * up, as `kernels.activation.silu_and_mul`."""
    return _launch(x, weight, bias, norm=(norm_weight, eps), residual=residual, gated=gated, rope=rope)


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                rope: RopeStore | None = None, gated: bool = False) -> torch.Tensor:
    """`norm_gemv` without the norm (x normalised already): x W^T (+ b) for
    one row, finished by `rope` or `gated` as there."""
    return _launch(x, weight, bias, rope=rope, gated=gated)[0]


def pairs_fit(n: int, k: int, segment: int) -> bool:
    """Whether the one-row product of a weight [n, k] can compute the rows of
    each segment of `segment` rows in pairs (row i with row i + segment / 2:
    rotary pairs of a head, a gate with its up), each program's rows all
    from one segment's halves."""
    return rows_pair(_config(n, k)[0], n, segment)


def rows_pair(block_n: int, n: int, segment: int) -> bool:
    """`pairs_fit` for programs of `block_n` rows."""
    pairs = block_n // 2
    return segment % 2 == 0 and n % segment == 0 and pairs > 0 and (segment // 2) % pairs == 0


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x W^T takes the gemv kernel: one contiguous half-precision row, on the GPU."""
    return half_rows_on_gpu(x, weight) and x.shape[0] == 1


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the one-row GPU case in `gemv` and small batches in
    `kernels.batch_gemm`."""
    if one_row(x, weight):
        return gemv(x, weight, bias)
    if small_batch(x, weight):
        return batch_gemm(x, weight, bias)
    wide = wide_batch(x, weight)
    if wide is not None:
        return batch_gemm(x, weight, bias, wide)
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up of x W^T for a gate_up weight [2I, K] in one launch
    where x W^T would take `kernels.batch_gemm` (`gated_batch_gemm`), else
    None: the caller takes the product and the activation apart."""
    if not _batch_gemm.GATED_IN_PRODUCT:
        return None
    if small_batch(x, weight):
        return gated_batch_gemm(x, weight)
    wide = wide_batch(x, weight, gated=True)
    return None if wide is None else gated_batch_gemm(x, weight, wide)


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
