"""The fp8 product of one row (batch-1 decode with quantization="fp8") in
one launch: the row is quantized to e4m3 inside the product, and the
RMSNorm before it, the rotary embedding and K/V store after a qkv product
or SiLU * mul after a gate_up product run inside it too, as `kernels.gemv`
does for bf16 weights. Unfused, a decoder layer at one row is thirteen
launches (two norms, four quantizations, four products, rotary, SiLU * mul,
attention); fused, five.

Each program takes BLOCK_N weight rows (in pairs for the rotary embedding
and SiLU * mul: `row_parts.paired_rows`) and one slice of K, and multiplies
them on the tensor cores as `kernels.batch_gemm` does at one row (W x^T, the
row padded with zeros to 16). The quantization is `kernels.fp8_quantize`'s,
bit for bit: every program finds the row's largest magnitude itself (the
row is read from L2; no program waits for another), takes the same
multiplier and rounds its slice of the row to e4m3. The split reduction over
K, its counters and the order its partial sums are added in are
`kernels.batch_gemm`'s, so with the same launch shape the sums equal the
unfused product's. The last program of a tile scales the sums (row, then
weight multiplier), adds the bias and finishes the rows
(`row_parts.finish_rows`). On Hopper the kernel is launched with
programmatic dependent launch, its first weight block read before the wait."""
from __future__ import annotations

import importlib.util

import torch

from rollout_engine.kernels._triton import cdiv, next_pow2, pdl_args, use_kernel
from rollout_engine.kernels.batch_gemm import SMS, GemmConfig, current_counters
from rollout_engine.kernels.fp8 import E4M3_MAX, FP32_TINY, FP8, INV_E4M3_MAX
from rollout_engine.kernels.gemv import NORM_MAX_K, RopeStore, epilogue, rows_pair

if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the kernel
    import triton
    import triton.language as tl

    from rollout_engine.kernels.e4m3 import e4m3_value, libdevice
    from rollout_engine.kernels.row_parts import finish_rows, paired_rows, row_input

    @triton.jit
    def _finish(y, sx, sw_ptr, b_ptr, tile, n, n_mask, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr,
                vc_ptr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
                NQ: tl.constexpr, NK: tl.constexpr, BLOCK_N: tl.constexpr):
        """A tile's sums times the row's and the weight rows' multipliers (in
        `batch_gemm`'s order), plus the bias, finished."""
        y = y * sx * tl.load(sw_ptr + n, mask=n_mask, other=1.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        finish_rows(y, tile, n, n_mask, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr, vc_ptr,
                    GATED, ROPE, HALF, NQ, NK, BLOCK_N)

    @triton.jit
    def _norm_and_amax(x_ptr, r_ptr, g_ptr, r_out_ptr, K, eps, pid, HAS_RES: tl.constexpr, K_P2: tl.constexpr):
        """(1 / rms of x (+ r), the largest magnitude of its RMSNorm) from one
        read of the row, the norm rounded as `row_parts.row_input` rounds it
        (NaN counts as infinite: a non-finite multiplier, as the quantize
        kernel gives); with HAS_RES program 0 writes x + r to r_out."""
        kk = tl.arange(0, K_P2)
        ok = kk < K
        row = tl.load(x_ptr + kk, mask=ok, other=0.0)
        dt = row.dtype
        if HAS_RES:
            row = (row.to(tl.float32) + tl.load(r_ptr + kk, mask=ok, other=0.0).to(tl.float32)).to(dt)
            if pid == 0:
                tl.store(r_out_ptr + kk, row, mask=ok)
        rf = row.to(tl.float32)
        inv = tl.rsqrt(tl.sum(rf * rf, axis=0) / K + eps)
        g = tl.load(g_ptr + kk, mask=ok, other=0.0).to(tl.float32)
        h = ((rf * inv).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)
        return inv, tl.max(tl.where(h == h, tl.abs(h), float("inf")), axis=0)

    @triton.jit
    def _row_block(x_ptr, r_ptr, g_ptr, k, K, inv, rec, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                   MAX: tl.constexpr):
        """Columns k of the quantized row (`rec`: 1 / its multiplier) as an
        e4m3 tile of 16 rows, the 15 after it zero (the tensor cores' shortest side)."""
        q = e4m3_value(row_input(x_ptr, r_ptr, g_ptr, k, k < K, inv, NORM, HAS_RES) * rec, MAX)
        bits = q.to(tl.float8e4nv).to(tl.int8, bitcast=True)  # exact: q is an e4m3 value; one cast per column
        return tl.where((tl.arange(0, 16) == 0)[:, None], bits[None, :], 0).to(tl.float8e4nv, bitcast=True)

    @triton.jit(do_not_specialize=["K_PER"])
    def fp8_row_kernel(x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, r_ptr, g_ptr, r_out_ptr, p_ptr, cnt_ptr, N, K, K_PER,
                       stride_w, eps, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride, kc_ptr, vc_ptr,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, K_P2: tl.constexpr,
                       AMAX_BLOCK: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
                       NQ: tl.constexpr, NK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, EVEN_K: tl.constexpr, INV_MAX: tl.constexpr, TINY: tl.constexpr,
                       MAX: tl.constexpr, PDL: tl.constexpr):
        """Program (tile, s): the tile's weight rows over K in [s * K_PER,
        (s + 1) * K_PER) (K_PER a multiple of BLOCK_K). y = q(x') W^T, x' = x
        or with NORM RMSNorm(x (+ r)) (x + r to r_out, `row_parts`), q the
        per-row e4m3 quantization; then `_finish`."""
        tile = tl.program_id(0)
        s = tl.program_id(1)
        n = paired_rows(tile, BLOCK_N, ROPE or GATED, HALF)
        n_mask = n < N
        k_lo = tl.multiple_of(s * K_PER, BLOCK_K)
        k_hi = tl.minimum(k_lo + K_PER, K)
        w_rows = w_ptr + n[:, None].to(tl.int64) * stride_w
        k = k_lo + tl.arange(0, BLOCK_K)
        # a slice ends at a multiple of BLOCK_K or at K: only K masks a block
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
        if PDL:  # the weights are nobody's output: their first block is read before the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if NORM:  # the row held once: its root mean square, then its largest normed magnitude
            inv, amax = _norm_and_amax(x_ptr, r_ptr, g_ptr, r_out_ptr, K, eps, tile + s, HAS_RES, K_P2)
        else:
            inv = 1.0
            amax = 0.0
            for a0 in range(0, K, AMAX_BLOCK):
                kk = a0 + tl.arange(0, AMAX_BLOCK)
                h = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.where(h == h, tl.abs(h), float("inf")), axis=0))
        sx = tl.where(amax * INV_MAX >= TINY, amax * INV_MAX, 1.0)  # kernels/fp8.py: _scale_inv
        sx = tl.where(amax == amax, sx, amax)
        rec = libdevice.div_rn(sx * 0.0 + 1.0, sx)
        # the tensor cores keep fewer bits in their own sums; every 128 products go to acc in fp32
        acc = tl.dot(w, tl.trans(_row_block(x_ptr, r_ptr, g_ptr, k, K, inv, rec, NORM, HAS_RES, MAX)),
                     tl.zeros([BLOCK_N, 16], tl.float32), max_num_imprecise_acc=128)
        for i in range(1, tl.cdiv(k_hi - k_lo, BLOCK_K)):
            k = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
            else:
                w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
            a = _row_block(x_ptr, r_ptr, g_ptr, k, K, inv, rec, NORM, HAS_RES, MAX)
            acc = tl.dot(w, tl.trans(a), acc, max_num_imprecise_acc=128)
        y = tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :], acc, 0.0), axis=1)
        if SPLIT > 1:
            base = p_ptr + tile * (SPLIT * BLOCK_N)
            i = tl.arange(0, BLOCK_N)
            tl.store(base + s * BLOCK_N + i, y)
            tl.debug_barrier()  # every thread's partials stored before the count
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:  # the last program of the tile adds the slices in order
                y = tl.zeros([BLOCK_N], tl.float32)
                for j in range(SPLIT):
                    y += tl.load(base + j * BLOCK_N + i, cache_modifier=".cg")
                tl.store(cnt_ptr + tile, 0)
                _finish(y, sx, sw_ptr, b_ptr, tile, n, n_mask, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride,
                        kc_ptr, vc_ptr, HAS_BIAS, GATED, ROPE, HALF, NQ, NK, BLOCK_N)
        else:
            _finish(y, sx, sw_ptr, b_ptr, tile, n, n_mask, y_ptr, pos_ptr, loc_ptr, cos_ptr, sin_ptr, cs_stride,
                    kc_ptr, vc_ptr, HAS_BIAS, GATED, ROPE, HALF, NQ, NK, BLOCK_N)


def fp8_one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x W^T takes `fp8_row`: one contiguous bf16 row on a GPU with
    Triton, an e4m3 weight with unit column stride and both dimensions
    multiples of 16."""
    n, k = weight.shape
    return (x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and x.dtype == torch.bfloat16
            and weight.dtype == FP8 and weight.stride(1) == 1 and n % 16 == 0 and k % 16 == 0 and use_kernel(x))


def _block_n(n: int) -> int:
    return 32 if n <= 2048 else 64


def config(n: int, k: int) -> GemmConfig:
    """The launch shape, measured on H100 at llama-3.1-8b's products
    (benchmarks/fp8_gemm_configs.py --one-row): tiles of 64 weight rows (32
    for narrow weights) by 256 columns, four warps, three stages (four
    stages took up to 17% longer: fewer programs fit an SM), and K split in
    two to eight slices of at least 512 columns up to about four programs
    per SM, when there are counters to count on (`batch_gemm.use_counters`)."""
    bn = _block_n(n)
    tiles = cdiv(n, bn)
    split = 1
    if current_counters() is not None:
        while split < 8 and tiles * split * 2 <= 4 * SMS and k // (split * 2) >= 512:
            split *= 2
    return GemmConfig(16, bn, 256, split, 4, 3, swap=True)


def pairs_fit(n: int, k: int, segment: int) -> bool:
    """`kernels.gemv.pairs_fit` for this kernel's tiles."""
    return rows_pair(_block_n(n), n, segment)


def fp8_row(x: torch.Tensor, weight: torch.Tensor, scale_w: torch.Tensor, bias: torch.Tensor | None = None,
            norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
            gated: bool = False, rope: RopeStore | None = None,
            launch: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For `fp8_one_row` inputs: x [1, K] bf16, weight e4m3 [N, K] with
    scale_w fp32 [N, 1] -> (y, the residual stream). y = q(x') W^T (+ bias),
    x' = x, or with `norm` (weight, eps; K at most NORM_MAX_K)
    RMSNorm(x + residual); the residual stream is x + residual (x without
    one). `rope` / `gated`: as `kernels.gemv.norm_gemv`. `launch`: the launch
    shape (default `config`'s)."""
    n, k = weight.shape
    bm, bn, bk, split, warps, stages, *_ = launch or config(n, k)
    if norm is not None and k > NORM_MAX_K:
        raise ValueError(f"fp8_row: a norm inside the product takes rows of at most {NORM_MAX_K}, got {k}")
    ep = epilogue(weight, rope, gated, bn)
    r_out = torch.empty_like(x) if residual is not None else x
    g, eps = norm if norm is not None else (x, 0.0)
    y = torch.empty((1, ep.n_out), dtype=x.dtype, device=x.device)
    tiles = cdiv(n, bn)
    k_per = cdiv(cdiv(k, split), bk) * bk
    split = cdiv(k, k_per)  # slices that hold any of K
    part = cnt = y
    if split > 1:
        cnt = current_counters()
        if cnt is None:
            raise ValueError("fp8_row: a split of K needs counters (batch_gemm.use_counters)")
        part = torch.empty(tiles * split * bn, dtype=torch.float32, device=x.device)
    fp8_row_kernel[(tiles, split)](
        x, weight, scale_w, bias if bias is not None else y, y, residual if residual is not None else x, g, r_out,
        part, cnt, n, k, k_per, weight.stride(0), eps, *ep.pointers, HAS_BIAS=bias is not None,
        NORM=norm is not None, HAS_RES=residual is not None, K_P2=next_pow2(k) if norm is not None else 1,
        AMAX_BLOCK=next_pow2(k) if norm is not None else min(next_pow2(k), 4096), GATED=gated,
        ROPE=rope is not None, HALF=ep.half, NQ=ep.nq, NK=ep.nk, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
        EVEN_K=k % bk == 0, INV_MAX=INV_E4M3_MAX, TINY=FP32_TINY, MAX=E4M3_MAX, num_warps=warps, num_stages=stages,
        **pdl_args(y))
    return y, r_out
