"""Matrix products at small decode batches (2 to MAX_ROWS rows):
y = x W^T (+ b) for x [M, K], W [N, K]. cuBLAS takes 5-8 us for any such
product of a small model (a 1,024-wide one at 16 rows: 32 output tiles of a
size built for more rows); here each tile is computed as W x^T (the weight's
rows on the tensor cores' long side, x's few rows on the short one), and the
reduction over K is split between programs when the tiles alone would leave
most of the GPU idle (`pick`, measured on H200: benchmarks/batch_gemm_configs.py).

Each program sums one slice of K for one output tile in fp32. With a split,
it writes its partial sums to a workspace and counts itself done on the
tile's counter; the program that finishes last adds the partials in slice
order (0, 1, ...: the same bits whichever program finishes last), adds the
bias, rounds once and sets the counter back to zero for the next launch (or
the next replay of a CUDA graph). The counters belong to whoever runs the
launches in order (an engine's model runner: `use_counters`); without them
a product is not split. On Hopper the kernel is launched with programmatic
dependent launch and touches nothing before the kernel before it is done."""
from __future__ import annotations

import contextlib
import importlib.util
import threading
from typing import Iterator, NamedTuple

import torch

from rollout_engine.kernels._triton import cdiv, half_rows_on_gpu, next_pow2, pdl_args, tile_reader


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int  # slices of K, each summed by its own program
    warps: int
    stages: int
    swap: bool = False  # tiles computed as W x^T
    tma: bool = False  # x and W tiles through tensor descriptors (the copy engine), where it can read them


MAX_ROWS = 32  # from 64 rows on cuBLAS is as fast on some shapes, faster on others (batch_gemm_configs.py)
MAX_TILES = 4096  # counters of one owner: output tiles of one launch with a split
SMS = 132  # the split aims at about one program per SM of an H100 / H200


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the helpers
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled(acc, sx_ptr, sw_ptr, rm, rn, m_ok, n_ok):
        """An fp8 tile's sums times its rows' and columns' multipliers, in
        the reference's order ((sum * s_x) * s_w)."""
        sx = tl.load(sx_ptr + rm, mask=m_ok, other=1.0)
        sw = tl.load(sw_ptr + rn, mask=n_ok, other=1.0)
        return acc * sx[:, None] * sw[None, :]

    @triton.jit
    def _gated(g, u, dtype: tl.constexpr):
        """SiLU(g) * u from the fp32 sums of a gate and an up column, rounded
        where the unfused path rounds: each sum to `dtype` (the product's
        output), SiLU(g) once more (kernels.activation)."""
        g = g.to(dtype).to(tl.float32)
        a = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
        return a * u.to(dtype).to(tl.float32)

    @triton.jit
    def _finish(acc, acc_up, y_ptr, sx_ptr, sw_ptr, b_ptr, rm, rn, m_ok, n_ok, stride_ym, GATED: tl.constexpr,
                FP8: tl.constexpr, HAS_BIAS: tl.constexpr):
        """A tile's whole sums to y: SiLU(gate) * up, the fp8 multipliers,
        the bias, where the launch has them."""
        if GATED:
            acc = _gated(acc, acc_up, y_ptr.dtype.element_ty)
        if FP8:
            acc = _scaled(acc, sx_ptr, sw_ptr, rm, rn, m_ok, n_ok)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["M", "K_PER"])
    def batch_gemm_kernel(x_ptr, w_ptr, xd, wd, sx_ptr, sw_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, K_PER,
                          stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
                          EVEN_K: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr, GATED: tl.constexpr,
                          PDL: tl.constexpr):
        """Program (tile, s): output tile `tile` summed over K in
        [s * K_PER, (s + 1) * K_PER) (K_PER a multiple of BLOCK_K). FP8: x and
        W in e4m3, their fp32 multipliers per row at sx and sw; the sum is
        scaled by both before the bias (y = (q_x . q_w) s_x s_w + b). TMA:
        the x and W tiles through the tensor descriptors xd ([BLOCK_M,
        BLOCK_K] tiles of x) and wd ([BLOCK_N, BLOCK_K] of W), zeros past
        M, N and K. GATED: W is [2N, K], the gate's rows then the up's; the
        output is SiLU(x Wg^T) * (x Wu^T) [M, N], two sums per tile (a gate
        tile past N holds up rows, an up tile past 2N zeros: columns past N
        are not stored)."""
        tile = tl.program_id(0)
        s = tl.program_id(1)
        tiles_n = tl.cdiv(N, BLOCK_N)
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        k_lo = tl.multiple_of(s * K_PER, BLOCK_K)  # K_PER is a multiple of BLOCK_K: loads stay vectorised
        k_hi = tl.minimum(k_lo + K_PER, K)
        x_rows = x_ptr + rm[:, None] * stride_xm
        w_rows = w_ptr + rn[:, None] * stride_wn
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = acc  # GATED: the up rows' sums beside the gate's in acc
        up_rows = N * stride_wn  # GATED: the up half of W begins N rows down
        for i in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
            # a slice ends at a multiple of BLOCK_K or at K: only K masks a block
            k = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K)
            if TMA:
                a = xd.load([(tile // tiles_n) * BLOCK_M, k_lo + i * BLOCK_K])
                b = wd.load([(tile % tiles_n) * BLOCK_N, k_lo + i * BLOCK_K])
                if GATED:
                    b_up = wd.load([N + (tile % tiles_n) * BLOCK_N, k_lo + i * BLOCK_K])
            elif EVEN_K:
                a = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
                b = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
                if GATED:
                    b_up = tl.load(w_rows + up_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
                b = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
                if GATED:
                    b_up = tl.load(w_rows + up_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            # fp8: the tensor cores keep fewer bits in their own sums; every 128 products go to acc in fp32
            if SWAP:
                acc = tl.dot(b, tl.trans(a), acc, max_num_imprecise_acc=128 if FP8 else None)
                if GATED:
                    acc_up = tl.dot(b_up, tl.trans(a), acc_up)
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=128 if FP8 else None)
                if GATED:
                    acc_up = tl.dot(a, tl.trans(b_up), acc_up)
        if SWAP:
            acc = tl.trans(acc)
            if GATED:
                acc_up = tl.trans(acc_up)
        if SPLIT > 1:
            # partials of tile `tile`: [SPLIT, BLOCK_M, BLOCK_N] fp32, contiguous (GATED: [SPLIT, 2, ...], the
            # gate's then the up's)
            i = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            if GATED:
                part = 2 * BLOCK_M * BLOCK_N
            else:
                part = BLOCK_M * BLOCK_N
            base = p_ptr + tile * (SPLIT * part)
            tl.store(base + s * part + i, acc)
            if GATED:
                tl.store(base + s * part + BLOCK_M * BLOCK_N + i, acc_up)
            tl.debug_barrier()  # every thread's partials stored before the count
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:  # the last program of the tile adds the slices in order
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                if GATED:  # (not otherwise: acc_up keeps the swapped shape it began with, which this would change)
                    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for j in range(SPLIT):
                    acc += tl.load(base + j * part + i, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(base + j * part + BLOCK_M * BLOCK_N + i, cache_modifier=".cg")
                tl.store(cnt_ptr + tile, 0)
                _finish(acc, acc_up, y_ptr, sx_ptr, sw_ptr, b_ptr, rm, rn, m_ok, n_ok, stride_ym, GATED, FP8,
                        HAS_BIAS)
        else:
            _finish(acc, acc_up, y_ptr, sx_ptr, sw_ptr, b_ptr, rm, rn, m_ok, n_ok, stride_ym, GATED, FP8, HAS_BIAS)


_local = threading.local()


def new_counters(device: torch.device) -> torch.Tensor:
    """Counters for one owner's split launches (zero between launches).
    Allocate them outside any memory-saver region: a region's memory is not
    kept across a release."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


@contextlib.contextmanager
def use_counters(counters: torch.Tensor | None) -> Iterator[None]:
    """Products launched by this thread inside the block may split their
    reduction, counting on `counters` (launches in stream order only: two
    owners running at once on one GPU need two sets)."""
    prior = getattr(_local, "counters", None)
    _local.counters = counters
    try:
        yield
    finally:
        _local.counters = prior


def current_counters() -> torch.Tensor | None:
    """The counters this thread's launches may split on (`use_counters`), or None."""
    return getattr(_local, "counters", None)


class _SplitRule(NamedTuple):
    block_k: int
    few_tiles: int  # split K when the tiles are at most this many (or K is long) ...
    programs: int  # ... up to about this many programs ...
    min_slice: int  # ... and slices of at least this many columns of K


# bf16 / fp16: one program per SM; e4m3 (measured on H200, benchmarks/fp8_gemm_configs.py, qwen2.5-7b's
# layers at 1 to 64 rows): blocks of 256 columns, about two programs per SM.
_HALF_RULE = _SplitRule(128, SMS // 4, SMS, 256)
_FP8_RULE = _SplitRule(256, SMS // 2, 2 * SMS, 512)


def pick(m: int, n: int, k: int, can_split: bool, fp8: bool = False) -> GemmConfig:
    """The launch shape for x [m, K] W [n, K]^T, m <= MAX_ROWS (`fp8`: e4m3
    operands, m <= MAX_FP8_ROWS): W x^T tiles of 32 (narrow weights) or 64
    weight rows; K split in two to eight slices when the tiles are few or K
    is long, up to about one program per SM (fp8: two) and slices of at
    least 256 (fp8: 512)."""
    rule = _FP8_RULE if fp8 else _HALF_RULE
    bm = max(16, next_pow2(m))
    bn = 32 if n <= 2048 else 64
    tiles = cdiv(n, bn) * cdiv(m, bm)
    split = 1
    if can_split and (tiles <= rule.few_tiles or k >= 4096):
        while split < 8 and tiles * split * 2 <= rule.programs and k // (split * 2) >= rule.min_slice:
            split *= 2
    return GemmConfig(bm, bn, rule.block_k, split, 4, 4, swap=True)


MAX_FP8_ROWS = 64  # fp8 from 1 row to 64; more rows: cuBLAS's row-scaled fp8 products are as fast or faster

# Products of WIDE_ROWS[0] to WIDE_ROWS[1] rows whose weight shape (N, K) is listed here take `batch_gemm` with
# the listed launch shape (GemmConfig's fields in order) instead of cuBLAS: the shapes a sweep
# (benchmarks/batch_gemm_configs.py) measured faster than cuBLAS at those rows. Empty: cuBLAS for all of them.
# On an H100 at 128 rows the copy-engine tiles beat cuBLAS on llama-3.1-8b's qkv (1.11x) and down (1.07x), not
# on o or gate/up, and decode 8B at batch 128 takes 12.35 ms a step with this table against 12.51 ms without it
# (BENCHMARKS.md). At 256 rows of qwen2.5-7b and of qwen3-0.6b's o and down nothing beat cuBLAS.
WIDE: dict = {
    (6144, 4096): (128, 64, 128, 1, 4, 4, False, True),  # qkv of a 4,096-wide model with 8 KV heads of 128
    (4096, 14336): (128, 64, 128, 2, 4, 4, False, True),  # down of a 14,336-wide MLP
}
WIDE_ROWS = (128, 128)

# A gate_up projection's product at 2 to MAX_ROWS rows, or at GATED_WIDE's rows for a weight shape (2I, K) it
# lists, finishes SiLU(gate) * up in the same launch (`gated_batch_gemm`, `kernels.gemv.gated_linear`); False:
# the product, then kernels.activation's launch. Off until measured. GATED_WIDE's launch shapes size the gated
# launch (two weight tiles a program: more shared memory than the plain product's at the same shape), from
# `benchmarks/batch_gemm_configs.py --gated`. At 2-32 rows the switch keeps the bits (the same launch shape as
# the unfused product's); a shape GATED_WIDE lists changes them (cuBLAS's product unfused, this kernel's fused).
GATED_IN_PRODUCT = False
GATED_WIDE: dict = {}


def wide_pick(m: int, n: int, k: int, can_split: bool, table: dict | None = None) -> GemmConfig | None:
    """The launch shape `table` (default WIDE) lists for x [m, K] W [n, K]^T
    at WIDE_ROWS rows, or None (a split of K only with counters)."""
    table = WIDE if table is None else table
    listed = table.get((n, k)) if WIDE_ROWS[0] <= m <= WIDE_ROWS[1] else None
    if listed is None:
        return None
    config = GemmConfig(*listed)
    return config if can_split or config.split == 1 else None


def small_batch(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x W^T takes `batch_gemm`: 2 to MAX_ROWS contiguous
    half-precision rows on the GPU, a weight with unit column stride."""
    return half_rows_on_gpu(x, weight) and 2 <= x.shape[0] <= MAX_ROWS


def wide_batch(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> GemmConfig | None:
    """The launch shape `batch_gemm` (`gated`: `gated_batch_gemm`, from
    GATED_WIDE) takes x W^T with beyond MAX_ROWS rows (`wide_pick`), or
    None: cuBLAS's."""
    table = GATED_WIDE if gated else WIDE
    if not table or not half_rows_on_gpu(x, weight):
        return None
    return wide_pick(x.shape[0], weight.shape[0], x.shape[1], current_counters() is not None, table)


def batch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (unit column stride) @ weight [N, K]^T (+ bias [N]) in x's
    dtype, with the launch shape `config` (default: `pick`'s)."""
    return _launch(x, weight, bias, config, x.dtype)


def gated_batch_gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """SiLU(x Wg^T) * (x Wu^T) [M, I] for weight [2I, K] (the gate's rows,
    then the up's: a gate_up projection) in one launch: the bits of
    `kernels.activation.silu_and_mul(batch_gemm(x, weight, None, config))`,
    without the [M, 2I] product between them. `config` (default: `pick`'s
    for the whole product [M, 2I], so that the sums are added in the same
    order) sizes the output tiles; each reads two weight tiles."""
    if weight.shape[0] % 2:
        raise ValueError(f"gated_batch_gemm: a gate_up weight has an even row count, got {weight.shape[0]}")
    if config is None:
        config = pick(x.shape[0], weight.shape[0], x.shape[1], current_counters() is not None)
    return _launch(x, weight, None, config, x.dtype, gated=True)


def fp8_batch_gemm(q: torch.Tensor, scale_q: torch.Tensor, weight: torch.Tensor, scale_w: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """The fp8 product for 1 to MAX_FP8_ROWS rows: q [M, K] e4m3 (unit column
    stride) with fp32 multipliers scale_q [M, 1] (`kernels.fp8_quantize`),
    weight [N, K] e4m3 with scale_w [N, 1] -> [M, N] in `out_dtype`, the
    sums in fp32 (launch shape: `pick(..., fp8=True)`'s)."""
    return _launch(q, weight, bias, config, out_dtype, (scale_q, scale_w))


def _launch(x, weight, bias, config, out_dtype, scales=None, gated=False):
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"batch_gemm: x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    counters = current_counters()
    bm, bn, bk, split, warps, stages, swap, tma = config or pick(m, n, k, counters is not None,
                                                                 fp8=scales is not None)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    tiles = cdiv(m, bm) * cdiv(n, bn)
    if not tiles:
        return y
    k_per = cdiv(cdiv(k, split), bk) * bk
    split = cdiv(k, k_per)  # slices that hold any of K
    part = cnt = y
    if split > 1:
        if counters is None:
            raise ValueError("batch_gemm: a split of K needs counters (use_counters)")
        if tiles > MAX_TILES:
            raise ValueError(f"batch_gemm: {tiles} output tiles with a split of K, at most {MAX_TILES}")
        sums = 2 if gated else 1
        part, cnt = torch.empty(tiles * split * sums * bm * bn, dtype=torch.float32, device=x.device), counters
    sx, sw = scales if scales is not None else (y, y)
    xd, x_tiles = tile_reader(x, [bm, bk], tma)
    wd, w_tiles = tile_reader(weight, [bn, bk], tma)
    batch_gemm_kernel[(tiles, split)](x, weight, xd, wd, sx, sw, bias if bias is not None else y, y, part, cnt, m, n,
                                      k, k_per, x.stride(0), weight.stride(0), y.stride(0),
                                      HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                                      SWAP=swap, EVEN_K=k % bk == 0, FP8=scales is not None, TMA=x_tiles and w_tiles,
                                      GATED=gated, num_warps=warps, num_stages=stages, **pdl_args(y))
    return y
