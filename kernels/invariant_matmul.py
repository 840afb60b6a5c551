"""Batch-invariant matrix product (deterministic mode on the GPU):
y = x W^T (+ b) whose every row has the same bits whatever the number of rows.

A GEMM library picks its tiles and its split of the reduction by the shape,
so one row can round differently in a batch of 1 and of 300. Here the
reduction order of an output element depends only on (N, K): K is cut into
fixed chunks (`chunk_k(N, K)`, never M), each chunk is accumulated over
BLOCK_K slices in order from zero, and the chunk sums are added in order,
in fp32, before the bias and the one rounding. Two launch shapes compute
exactly that:

- one program per output tile walks the chunks itself (enough tiles to fill
  the GPU: prompts, large batches);
- one program per (tile, chunk) writes fp32 partial sums that a second
  launch adds in chunk order (few rows: decode, where the weight read must
  be spread over the whole GPU).

Both run the same code per BLOCK_K slice and add the same chunks in the same
order, so they give the same bits, and the choice between them may depend on
M; so may the tile sizes (`Tiles`): small tiles for decode, large ones read
through TMA for prompts."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from rollout_engine.kernels._triton import cdiv


@dataclass(frozen=True)
class Tiles:
    """Launch constants of one kernel shape. The bits of a result depend
    only on BLOCK_K and the chunks (`chunk_k`, from the weight's shape), not
    on the tile or warp counts: configurations that agree on block_k give
    the same bits (measured, and checked by the GPU tests), so the tiles may
    change with the number of rows."""
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    warps: int = 4
    stages: int = 3
    tma: bool = False  # load tiles through tensor descriptors (Hopper's TMA)
    flat: bool = False  # tiled launch: all chunks in one pipelined loop (same sums) instead of a loop per chunk


# The first launch constants (H200, benchmarks/invariant_matmul.py): small
# tiles with plain loads for decode, 128x256 tiles through TMA for prompts.
# Kept as the reference configurations of the tests; `pick_tiles` chooses.
DECODE_TILES = Tiles()
PREFILL_TILES = Tiles(block_m=128, block_n=256, block_k=64, warps=8, stages=3, tma=True)
DECODE_MAX_ROWS = 256  # CUDA-graph decode batches go up to this many rows
WIDE_N = 16384  # products at least this wide (gate_up, the LM head) fill the GPU with output tiles alone
# (most rows, tiles for narrower products, tiles for wide ones), measured on
# an H100 over qwen2.5-7b's products in CUDA graphs (`--small --flat` and
# `--flat`): the narrow products (qkv, o, down) have few output tiles and
# several chunks, and run fastest with small tiles and the chunks in one
# loop; the wide ones with larger tiles as rows grow. Every entry has
# BLOCK_K 64: the same bits as DECODE_TILES.
ROW_PICKS = (
    (64, Tiles(64, 128, 64, 4, 3, flat=True), Tiles(64, 64, 64, 4, 4, flat=True)),
    (128, Tiles(64, 64, 64, 4, 4, flat=True), Tiles(64, 128, 64, 4, 3, flat=True)),
    (DECODE_MAX_ROWS, Tiles(64, 64, 64, 4, 4, flat=True), Tiles(128, 128, 64, 8, 4, tma=True)),
    (768, Tiles(64, 128, 64, 4, 3, tma=True, flat=True), PREFILL_TILES),
    (1536, Tiles(128, 128, 64, 4, 4, tma=True), PREFILL_TILES),
    (None, Tiles(128, 256, 64, 8, 3, tma=True, flat=True), PREFILL_TILES),
)
CHUNK_BASIS_N = 128  # chunk_k counts output tiles of this width, whatever the launch's tiles
MIN_CHUNK_BLOCKS = 4  # a chunk spans at least this many BLOCK_K slices


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (tests on the CPU): an H100's count
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def chunk_k(n: int, k: int, sms: int, block_k: int) -> int:
    """The reduction's chunk length: from (N, K), BLOCK_K and the GPU only.
    Enough chunks that a row block of 128-wide tiles, split by chunk, fills
    the GPU twice."""
    want = max(1, cdiv(2 * sms, cdiv(n, CHUNK_BASIS_N)))
    chunk = cdiv(cdiv(k, want), block_k) * block_k
    return min(max(chunk, MIN_CHUNK_BLOCKS * block_k), cdiv(k, block_k) * block_k)


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the helpers
    import triton
    import triton.language as tl

    @triton.jit
    def load_pair(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, rm, rn, k0, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
        """The [BLOCK_M, BLOCK_K] slice of x and the [BLOCK_N, BLOCK_K] slice
        of w at column k0 (out of range: zeros)."""
        if TMA:
            a = x_ptr.load([tl.min(rm, axis=0), k0])
            b = w_ptr.load([tl.min(rn, axis=0), k0])
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm < M)[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=(rn < N)[:, None] & k_ok[None, :],
                        other=0.0)
        return a, b

    @triton.jit
    def dot_into(a, b, acc, IEEE: tl.constexpr):
        """acc + a b^T (fp32 inputs: IEEE products, not TF32)."""
        if IEEE:
            return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def chunk_sum(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, rm, rn, k_start,
                  CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
        """fp32 sum over k in [k_start, k_start + CHUNK) of x[rm, k] * w[rn, k].
        With TMA, x_ptr and w_ptr are tensor descriptors (out-of-range
        elements read as zero, as the masked loads give)."""
        acc = tl.zeros([rm.shape[0], rn.shape[0]], tl.float32)
        for kk in range(0, CHUNK, BLOCK_K):
            a, b = load_pair(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, rm, rn, k_start + kk,
                             BLOCK_K=BLOCK_K, TMA=TMA)
            acc = dot_into(a, b, acc, IEEE=IEEE)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def tile_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, NUM_CHUNKS,
                    HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, FLAT: tl.constexpr = False):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if not FLAT:
            for c in range(0, NUM_CHUNKS):
                total += chunk_sum(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, rm, rn, c * CHUNK,
                                   CHUNK=CHUNK, BLOCK_K=BLOCK_K, IEEE=IEEE, TMA=TMA)
        else:
            # The same sums in one pipelined loop: a chunk's accumulator starts
            # from zero and joins the total at the chunk's last slice.
            PER_CHUNK: tl.constexpr = CHUNK // BLOCK_K
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for kb in range(0, NUM_CHUNKS * PER_CHUNK):
                a, b = load_pair(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, rm, rn, kb * BLOCK_K,
                                 BLOCK_K=BLOCK_K, TMA=TMA)
                acc = dot_into(a, b, acc, IEEE=IEEE)
                if kb % PER_CHUNK == PER_CHUNK - 1:
                    total += acc
                    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_BIAS:
            total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit(do_not_specialize=["M"])
    def split_kernel(x_ptr, w_ptr, p_ptr, M, N, K, stride_xm, stride_wn,
                     CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     IEEE: tl.constexpr, TMA: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        c = tl.program_id(2)
        acc = chunk_sum(x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, rm, rn, c * CHUNK,
                        CHUNK=CHUNK, BLOCK_K=BLOCK_K, IEEE=IEEE, TMA=TMA)
        tl.store(p_ptr + (c * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc,
                 mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit(do_not_specialize=["M"])
    def reduce_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_ym, NUM_CHUNKS, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < M * N
        row, col = (i // N).to(tl.int64), i % N
        total = tl.zeros([BLOCK], tl.float32)
        for c in range(0, NUM_CHUNKS):  # in chunk order, as tile_kernel adds them
            total += tl.load(p_ptr + c * M * N + i, mask=ok, other=0.0)
        if HAS_BIAS:
            total += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + col, total.to(y_ptr.dtype.element_ty), mask=ok)


def pick_tiles(m: int, n: int, k: int) -> Tiles:
    """The launch constants for an [m, k] x [n, k]^T product (ROW_PICKS).
    Speed only: the bits do not depend on them."""
    for most, narrow, wide in ROW_PICKS:
        if most is None or m <= most:
            return wide if n >= WIDE_N else narrow
    raise AssertionError("ROW_PICKS ends with an open bucket")


def _splits(m: int, n: int, k: int, tiles: Tiles, sms: int) -> bool:
    """The default launch shape: split when the tiles alone would leave most
    of the GPU idle and the reduction has chunks to spread."""
    chunks = cdiv(k, chunk_k(n, k, sms, tiles.block_k))
    return chunks > 1 and cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n) < sms


def launches_to_compile(n: int, k: int, device: torch.device) -> list[tuple[int, bool]]:
    """(rows, split) pairs that, run once each, compile every kernel an
    [m, k] x [n, k]^T product can launch by default, whatever m: each bucket
    of ROW_PICKS at its first row, with each launch shape its rows can take
    (fewer rows split, more run tiled)."""
    sms = _sm_count(device)
    out, lo = [], 1
    for most, narrow, wide in ROW_PICKS:
        tiles = wide if n >= WIDE_N else narrow
        shapes = {_splits(lo, n, k, tiles, sms), _splits(most or 1 << 30, n, k, tiles, sms)}
        out += [(lo, split) for split in sorted(shapes)]
        lo = (most or 0) + 1
    return out


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     split: bool | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]). `split` forces a launch
    shape (tests); by default the split one when the tiles alone would
    leave most of the GPU idle. `tiles`: other launch constants (benchmarks)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    device = x.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sms = _sm_count(device)
    if tiles is None:
        tiles = pick_tiles(m, n, k)
    chunk = chunk_k(n, k, sms, tiles.block_k)
    chunks = cdiv(k, chunk)
    tiles_m, tiles_n = cdiv(m, tiles.block_m), cdiv(n, tiles.block_n)
    if split is None:
        split = _splits(m, n, k, tiles, sms)
    consts = dict(CHUNK=chunk, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                  IEEE=x.dtype == torch.float32, TMA=tiles.tma, num_warps=tiles.warps, num_stages=tiles.stages)
    b = bias if bias is not None else y
    xa, wa = x2, w
    if tiles.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(x2, [tiles.block_m, tiles.block_k])
        wa = TensorDescriptor.from_tensor(w, [tiles.block_n, tiles.block_k])
    if split:
        partial = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device)
        split_kernel[(tiles_m, tiles_n, chunks)](xa, wa, partial, m, n, k, x2.stride(0), w.stride(0), **consts)
        block = 1024
        reduce_kernel[(cdiv(m * n, block),)](partial, b, y, m, n, y.stride(0), chunks, HAS_BIAS=bias is not None,
                                             BLOCK=block)
    else:
        tile_kernel[(tiles_m, tiles_n)](xa, wa, b, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0), chunks,
                                        HAS_BIAS=bias is not None, FLAT=tiles.flat, **consts)
    return y.reshape(*shape[:-1], n)
