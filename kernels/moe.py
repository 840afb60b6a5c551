"""Mixture-of-experts layer: the experts' SwiGLU MLPs of every (token, slot)
pair in a few launches, on the device alone.

The routing is kernels/moe_route.py, the products' kernels
kernels/moe_tiles.py. `fused_moe`, for ids [T, k] (pair p = t * k + j is
slot j of token t):
1. align (kernels/moe_align.py): the pairs sorted by expert, each expert's
   run padded to a multiple of BLOCK_M, on the device (programs past the
   padded total return at once). One token needs none: its slots are
   distinct experts, each slot a block (`_fused_moe_one`).
2. up: per block and tile of the intermediate size I, the gate and up rows
   of w13[e] in one program; writes silu(gate) * up, rounded as
   `silu_and_mul` rounds it, to act [T*k, I].
3. down: act @ w2[e]^T per block, times the pair's routing weight, to
   y [T, k, H] in x's dtype. With 128-pair blocks (`MoeLaunch.tails`) the
   last block of an expert runs a half or a quarter of its rows in both
   products where its real pairs fit there.
4. sum: y over the slots in order (0, 1, ...) in fp32, into [T, H].

Every pair's row is reduced over K by one program whatever its neighbours,
so with one launch shape (`invariant=True`: INVARIANT) a token's output has
the same bits in any batch. Otherwise the shape follows the rows per expert
(`pick`). I need not be a power of two nor a multiple of the tiles (a
tensor-parallel slice of the intermediate size)."""
from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rollout_engine.kernels._triton import cdiv, next_pow2, pdl_args, tile_reader, use_kernel
from rollout_engine.kernels.moe_align import _align


class Tiles(NamedTuple):
    """One product's launch constants (BLOCK_M is the config's)."""
    block_n: int
    block_k: int
    warps: int
    stages: int
    group: int = 8  # blocks that take each column tile in turn (a weight tile read once for them all)


class MoeLaunch(NamedTuple):
    """A fused_moe call's launch shape."""
    block_m: int  # pairs per block, all of one expert
    up: Tiles  # gate/up product: N over I, K over H
    down: Tiles  # down product: N over H, K over I
    # A block whose real pairs fit a half or a quarter of it runs that many
    # rows of products (an expert's last block: 129 pairs take 128 + 32 rows
    # of products, not 256). Not with `invariant`: the rows a product runs
    # could change a row's bits.
    tails: bool = False


# By the mean pairs per expert: 16-pair blocks up to 12 (reading the weights
# is all the cost), 32 up to 24, 64 up to 48, then 128 with short tails.
# First swept on an H100 (benchmarks/moe_kernel.py --sweep, results in
# benchmarks/results/moe/) at the shapes of Qwen3-30B-A3B, OLMoE and Mixtral;
# the 128-pair blocks moved down from 96 pairs once they ran short tails: on
# an H200 the whole call at 24-48 pairs ties the 64-pair blocks, at 64 takes
# 355 us against 398 (Qwen3) and 235 against 269 (OLMoE), at 96 392 against
# 517 and 252 against 342 (moe-pick-tails-h200.json).
# INVARIANT, one shape for every T, is LARGE: on the H100 1-6% slower than
# `pick`'s shape from 8 to 256 tokens, 1.15x (Qwen3) to 1.5x its time at
# 2,048; on the H200 with short tails 1.09x at 8 tokens and 1.33-1.46x at
# 2,048 (Qwen3, moe-kernel-tails-h200.json).
DECODE = MoeLaunch(16, Tiles(64, 256, 4, 3), Tiles(64, 256, 4, 3))
MID = MoeLaunch(32, Tiles(64, 128, 4, 4), Tiles(64, 256, 4, 3))
LARGE = MoeLaunch(64, Tiles(64, 128, 4, 4), Tiles(128, 64, 8, 3))
PREFILL = MoeLaunch(128, Tiles(128, 64, 8, 4), Tiles(128, 64, 8, 3), tails=True)
INVARIANT = LARGE
ROWS = ((12, DECODE), (24, MID), (48, LARGE))  # (mean pairs per expert up to, launch); PREFILL above


def pick(tokens: int, top_k: int, experts: int, invariant: bool = False) -> MoeLaunch:
    """Launch shape by the mean pairs per expert (tokens * top_k / experts):
    16-pair blocks while most experts hold a few pairs (reading the weights
    is the cost), larger ones as the products grow. INVARIANT for
    `invariant`: one shape whatever the batch."""
    if invariant:
        return INVARIANT
    rows = tokens * top_k / experts
    return next((launch for most, launch in ROWS if rows <= most), PREFILL)


# ---------------------------------------------------------------- references

Scales = tuple[torch.Tensor, torch.Tensor]  # fp8 experts: w13's and w2's multipliers [E, rows, 1], fp32


def _product(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x w^T in x's dtype; an e4m3 w (`scale` its rows' multipliers [N, 1]):
    (x q^T) * scale in fp32 from x as it is, then rounded (weight-only fp8)."""
    if scale is None:
        return F.linear(x, w)
    return ((x.float() @ w.float().t()) * scale.t()).to(x.dtype)


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor | None = None,
                s2: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = _product(x, w13, s13).chunk(2, dim=-1)
    return _product(F.silu(gate) * up, w2, s2)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  invariant: bool = False, scales: Scales | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * w2[e] (silu(w13[e, :I] x[t]) * w13[e, I:] x[t]),
    e = ids[t, j], in x's dtype: the pairs grouped by expert, three products
    per expert, the weighted results added in fp32. With `invariant` every
    pair is computed alone (one-row products) and a token's slots added in
    order, so a token's result never depends on the other tokens. `scales`
    (fp8 experts: w13 and w2 in e4m3): their rows' multipliers (`_product`)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    w = weights.reshape(-1).float()
    s13, s2 = scales if scales is not None else (None, None)

    def mlp(rows: torch.Tensor, e: int) -> torch.Tensor:
        return _expert_mlp(rows, w13[e], w2[e], None if s13 is None else s13[e], None if s2 is None else s2[e])

    if invariant:
        y = torch.stack([mlp(x[p // top_k: p // top_k + 1], e)[0]
                         for p, e in enumerate(flat.tolist())]) if tokens else x.new_empty((0, hidden))
        y = (y.float() * w[:, None]).view(tokens, top_k, hidden)
        out = torch.zeros((tokens, hidden), dtype=torch.float32, device=x.device)
        for j in range(top_k):
            out += y[:, j]
        return out.to(x.dtype)
    out = torch.zeros((tokens, hidden), dtype=torch.float32, device=x.device)
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    for e, pairs in zip(experts.tolist(), order.split(counts.tolist())):
        t = token_of[pairs]
        out.index_add_(0, t, mlp(x[t], e).float() * w[pairs, None])
    return out.to(x.dtype)


# ---------------------------------------------------------------- kernels

if importlib.util.find_spec("triton") is not None:
    from rollout_engine.kernels.moe_tiles import moe_down_kernel, moe_sum_kernel, moe_up_kernel


# ---------------------------------------------------------------- wrappers

def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              invariant: bool = False, scales: Scales | None = None) -> torch.Tensor:
    """fused_moe_ref's result: on the GPU in five launches or fewer (the
    align's one or two, up, down, slot sum; two for one token:
    `_fused_moe_one`) that never wait for the host, so the call can be captured in a CUDA graph and
    replayed with new ids and weights of the same T; the reference elsewhere. `invariant`: one launch shape whatever
    T, so that a token's output has the same bits in any batch. `scales`:
    fp8 experts (w13, w2 in e4m3), as fused_moe_ref's; their products read
    the e4m3 tiles, take them in x's dtype and scale the fp32 sums."""
    if not use_kernel(x):
        return fused_moe_ref(x, w13, w2, weights, ids, invariant, scales)
    if x.shape[0] == 1 and not invariant:  # batch-1 decode: no align launch
        return _fused_moe_one(x, w13, w2, weights, ids, DECODE, scales)
    return _fused_moe_triton(x, w13, w2, weights, ids, pick(x.shape[0], ids.shape[1], w13.shape[0], invariant),
                             scales)


# The products read their weight tiles through tensor descriptors (Hopper's
# copy engine, staged in shared memory) instead of pointer loads. On an H100
# (alternated, benchmarks/results/moe/tma-weights-*): decode qwen3-30b-a3b
# batch 1 3.32 ms against 3.385 (-1.9%), batch 8 -0.9%; the layer alone 3%
# faster at one token, 0.3-1.3% from 8 to 2,048.
TMA_WEIGHTS = True


def weight_tiles(w: torch.Tensor, t: Tiles):
    """What a product's launch reads expert weights w [E, N, K] through: a
    tensor descriptor of (1, block_n, block_k) tiles where TMA_WEIGHTS is on
    and the copy engine can take w (Hopper on, 16-byte aligned rows; and
    under Triton's interpreter), else w itself (pointer loads). Returns
    (descriptor or w, whether it is a descriptor)."""
    return tile_reader(w, [1, t.block_n, t.block_k], TMA_WEIGHTS)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fit(t: Tiles, dtype: torch.dtype) -> Tiles:
    """fp32 operands: half the K slice, so the pipeline's stages still fit
    in shared memory."""
    return t._replace(block_k=max(16, t.block_k // 2)) if dtype == torch.float32 else t


def _up(x: torch.Tensor, w13: torch.Tensor, aligned, pairs: int, top_k: int, block_m: int, t: Tiles,
        one: bool = False, tails: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The gate/up launch. `one` (`_fused_moe_one`): `aligned` holds the
    token's ids [k] as its block experts, one block per pair, and the down
    launch's tile counters (a power of two of them) in place of the total.
    `tails`: MoeLaunch.tails. `scale`: w13's row multipliers (e4m3 w13)."""
    sorted_ids, block_expert, total = aligned
    hidden = x.shape[1]
    inter = w13.shape[1] // 2
    t = _fit(t, x.dtype)
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    blocks = block_expert.numel()
    wd, tma = weight_tiles(w13, t)
    moe_up_kernel[(blocks * cdiv(inter, t.block_n),)](
        x, w13, wd, scale if scale is not None else x, act, sorted_ids, block_expert, total, pairs, blocks, hidden,
        inter, x.stride(0), w13.stride(0), w13.stride(1), TOPK=top_k, GROUP=t.group, BLOCK_M=block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        EVEN_K=hidden % t.block_k == 0, EVEN_N=inter % t.block_n == 0, IEEE=x.dtype == torch.float32,
        num_warps=t.warps, num_stages=t.stages, ONE=one, COUNTS=total.numel() if one else 1, TAILS=tails,
        TMA=tma, SCALED=scale is not None, **pdl_args(x))
    return act


# One token: each down program reads its first weight block before the
# dependent-launch wait, its expert taken from what the launch two back wrote
# (the routing's ids, or the router's logits: `Early`), while the gate/up
# launch still runs.
EARLY_DOWN = False


class Early(NamedTuple):
    """Where a one-token down launch finds its slots' experts before its
    wait: the routing's ids [k] (`logits` False) or the router's logits [E]."""
    source: torch.Tensor
    logits: bool
    top_k: int


def _down(act: torch.Tensor, w2: torch.Tensor, rw: torch.Tensor, aligned, block_m: int, t: Tiles,
          out: torch.Tensor | None = None, tails: bool = False, early: Early | None = None,
          scale: torch.Tensor | None = None) -> torch.Tensor:
    """The down launch: y [pairs, H]. With `out` [1, H] (one token: `_up`'s
    `one`), the slot sum too, into out. `tails`: MoeLaunch.tails. `early`
    (one token, with EARLY_DOWN): `Early`. `scale`: w2's row multipliers
    (e4m3 w2)."""
    sorted_ids, block_expert, total = aligned
    pairs, inter = act.shape
    hidden = w2.shape[1]
    t = _fit(t, act.dtype)
    y = torch.empty((pairs, hidden), dtype=act.dtype, device=act.device)
    blocks = block_expert.numel()
    wd, tma = weight_tiles(w2, t)
    one = out is not None
    source, experts, reads = y, 1, {}  # the kernel's defaults: nothing read before the wait
    if one and EARLY_DOWN and early is not None:
        source, experts = early.source, early.source.numel()
        reads = dict(EARLY=1, FROM_LOGITS=early.logits, TOPK=early.top_k, BLOCK_J=next_pow2(early.top_k),
                     BLOCK_E=next_pow2(experts) if early.logits else 1)
    moe_down_kernel[(blocks * cdiv(hidden, t.block_n),)](
        act, w2, wd, scale if scale is not None else y, y, out if out is not None else y, rw, sorted_ids, block_expert,
        total, pairs, blocks, hidden, inter, w2.stride(0), w2.stride(1), source, experts,
        GROUP=t.group, BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=inter % t.block_k == 0,
        EVEN_N=hidden % t.block_n == 0, IEEE=act.dtype == torch.float32, num_warps=t.warps,
        num_stages=t.stages, ONE=one, TAILS=tails, TMA=tma, SCALED=scale is not None, **reads, **pdl_args(act))
    return y


def _sum_slots(y: torch.Tensor, tokens: int, top_k: int, block_h: int = 1024) -> torch.Tensor:
    hidden = y.shape[1]
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    block_h = min(block_h, next_pow2(hidden))
    moe_sum_kernel[(tokens, cdiv(hidden, block_h))](y, out, hidden, TOPK=top_k, BLOCK_H=block_h, num_warps=4,
                                                    **pdl_args(y))
    return out


def _prepare(x, w13, w2, weights):
    """Operands with unit last strides, and the routing weights flat in fp32."""
    rw = weights.reshape(-1)
    return _unit_last(x), _unit_last(w13), _unit_last(w2), rw if rw.dtype == torch.float32 else rw.float()


def _split(scales: Scales | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(w13's, w2's) row multipliers, contiguous, or (None, None)."""
    return (None, None) if scales is None else (scales[0].contiguous(), scales[1].contiguous())


def _fused_moe_one(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   config: MoeLaunch, scales: Scales | None = None) -> torch.Tensor:
    """One token (batch-1 decode) in two launches: no align, as its k slots
    are k blocks of one pair each, block j on expert ids[j] (distinct
    experts, as the routing gives them; a repeated one is read once per
    slot), and the slot sum inside the down launch. The products are the
    blocks path's with the same launch shape, row for row, and the sum adds
    the same rounded rows in the same order, so the result has its bits (a
    GPU test holds it)."""
    top_k = ids.shape[1]
    x, w13, w2, rw = _prepare(x, w13, w2, weights)
    s13, s2 = _split(scales)
    flat = ids.reshape(-1)
    tiles = cdiv(w2.shape[1], _fit(config.down, x.dtype).block_n)
    counts = torch.empty(next_pow2(tiles), dtype=torch.int32, device=x.device)  # zeroed by the gate/up launch
    blocks = (flat, flat, counts)  # block experts = the ids; no sorted ids
    act = _up(x, w13, blocks, top_k, top_k, config.block_m, config.up, one=True, scale=s13)
    out = torch.empty((1, w2.shape[1]), dtype=x.dtype, device=x.device)
    _down(act, w2, rw, blocks, config.block_m, config.down, out=out, early=Early(flat, False, top_k), scale=s2)
    return out


def _fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, config: MoeLaunch, scales: Scales | None = None) -> torch.Tensor:
    """The Triton path with the launch shape `config` (benchmarks, and tests
    under Triton's interpreter)."""
    tokens, hidden = x.shape
    if tokens == 0:
        return x.new_empty((0, hidden))
    x, w13, w2, rw = _prepare(x, w13, w2, weights)
    return _experts(x, w13, w2, rw, _align(ids, w13.shape[0], config.block_m), ids.shape[1], config, scales)


def _experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, rw: torch.Tensor, aligned, top_k: int,
             config: MoeLaunch, scales: Scales | None = None) -> torch.Tensor:
    """After the align: the gate/up and down launches and the slot sum,
    [T, H]. x, w13, w2, rw as `_prepare` gives them; `scales`: fused_moe's.
    (A slot sum inside the down launch, each token's last slot adding its
    rows there, kept the bits and saved the launch, but cost 2-3% of the
    layer at 8-256 tokens and 13% at 2,048 on an H100: BENCHMARKS.md.)"""
    tokens = x.shape[0]
    s13, s2 = _split(scales)
    act = _up(x, w13, aligned, tokens * top_k, top_k, config.block_m, config.up, tails=config.tails, scale=s13)
    y = _down(act, w2, rw, aligned, config.block_m, config.down, tails=config.tails, scale=s2)
    return _sum_slots(y, tokens, top_k)
