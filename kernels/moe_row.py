"""The sparse MLP of one token (batch-1 decode) from the attention's output
to the experts' sum, in three launches: the router's product with the
post-attention RMSNorm (and its residual add) inside it (`gemv.norm_gemv`);
the routing, the norm and the gate/up product in `moe_row_up_kernel`; the
down product with the slot sum inside it (`moe_tiles.moe_down_kernel`, one token).
Unfused that is five: the norm, the router, the routing, gate/up, down with
the slot sum (`moe.fused_moe` at one token; seven through the align).

Every gate/up program computes the token's top k from the router's logits
itself (`moe_route.top_k_rows`, the routing kernel's code, on one row where
the routing kernel takes four: the softmax's and the renormalisation's sums
may be added in another order, so a routing weight may differ from
`route`'s in its last bit; the ids do not) and takes its slot's expert;
program 0 also writes the routing weights and ids for the down launch (and
the routing record), and zeroes the down launch's tile counters. Each
program normalises the token's residual row itself (`row_parts`), rounded
as the norm kernel rounds it, its sum of squares possibly added in another
order."""
from __future__ import annotations

import importlib.util

import torch

from rollout_engine.kernels._triton import cdiv, next_pow2, pdl_args
from rollout_engine.kernels.gemv import norm_gemv
from rollout_engine.kernels.moe import DECODE, Early, MoeLaunch, Scales, _down, _fit, _split, _unit_last, weight_tiles

if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the kernels
    import triton
    import triton.language as tl

    from rollout_engine.kernels.moe_tiles import gate_up_tile
    from rollout_engine.kernels.moe_route import top_k_rows
    from rollout_engine.kernels.row_parts import row_inv_rms

    @triton.jit
    def moe_row_up_kernel(logits_ptr, r_ptr, g_ptr, eps, w_ptr, wd, s_ptr, act_ptr, rw_ptr, id_ptr, count_ptr, loc_ptr,
                          rec_ptr, E, H, I, stride_we, stride_wn, stride_rec, TOPK: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, RENORM: tl.constexpr,
                          RECORD: tl.constexpr, COUNTS: tl.constexpr, H_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          EVEN_N: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, SCALED: tl.constexpr,
                          PDL: tl.constexpr):
        """Slot j = pid // tiles, column tile pid % tiles of I: the token's
        top k from its logits, expert ids[j]'s gate and up rows times
        RMSNorm(r) (r: the residual stream after the attention). SCALED:
        e4m3 weights, their rows' multipliers at s_ptr (`gate_up_tile`)."""
        if PDL:  # launched early: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        tiles = tl.cdiv(I, BLOCK_N)
        j, nt = pid // tiles, pid % tiles
        ee = tl.arange(0, BLOCK_E)
        e_ok = ee < E
        x = tl.load(logits_ptr + ee, mask=e_ok, other=float("-inf")).to(tl.float32)
        vals, idx = top_k_rows(x[None, :], ee, e_ok, TOPK, BLOCK_J, RENORM)
        jj = tl.arange(0, BLOCK_J)
        vals, idx = tl.sum(vals, axis=0), tl.sum(idx, axis=0)  # the one row
        e = tl.sum(tl.where(jj == j, idx, 0), axis=0).to(tl.int64)
        if pid == 0:
            tl.store(rw_ptr + jj, vals, mask=jj < TOPK)
            tl.store(id_ptr + jj, idx, mask=jj < TOPK)
            tl.store(count_ptr + tl.arange(0, COUNTS), tl.zeros([COUNTS], tl.int32))
            if RECORD:
                slot = tl.load(loc_ptr).to(tl.int64)
                tl.store(rec_ptr + slot * stride_rec + jj, idx.to(rec_ptr.dtype.element_ty), mask=jj < TOPK)
        inv = row_inv_rms(r_ptr, r_ptr, r_ptr, H, eps, pid, False, H_P2)
        first = tl.arange(0, BLOCK_M) == 0
        pair = tl.where(first, j, TOPK).to(tl.int32)
        gate_up_tile(r_ptr, g_ptr, inv, w_ptr, wd, s_ptr, act_ptr, pair, first, e, nt, H, I, 0, stride_we, stride_wn,
                     TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, IEEE, True, TMA, SCALED)


Record = tuple[torch.Tensor, torch.Tensor]  # as moe_route.Record


def moe_row(h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool, record: Record | None = None,
            config: MoeLaunch = DECODE, scales: Scales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For one token: (the experts' sum for RMSNorm(h + residual), h +
    residual), as rmsnorm, the router's product, `moe_route.route` and
    `moe.fused_moe` give them. h, residual [1, H] contiguous (H at most
    gemv.NORM_MAX_K); router [E, H]; `record`: as `route`'s; `scales`: as
    `fused_moe`'s (fp8 experts)."""
    logits, r = norm_gemv(h, residual, norm_weight, eps, router)
    w13, w2 = _unit_last(w13), _unit_last(w2)
    s13, s2 = _split(scales)
    experts, hidden = router.shape
    inter = w13.shape[1] // 2
    dev = h.device
    rw = torch.empty(top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(top_k, dtype=torch.int32, device=dev)
    up, down = _fit(config.up, h.dtype), _fit(config.down, h.dtype)
    counts = torch.empty(next_pow2(cdiv(hidden, down.block_n)), dtype=torch.int32, device=dev)
    act = torch.empty((top_k, inter), dtype=h.dtype, device=dev)
    dest, loc = record if record is not None else (ids, ids)
    wd, tma = weight_tiles(w13, up)
    if record is not None:
        assert dest.stride(1) == 1 and dest.shape[1] == top_k, "the record's rows hold a token's k ids"
    moe_row_up_kernel[(top_k * cdiv(inter, up.block_n),)](
        logits, r, norm_weight, eps, w13, wd, s13 if s13 is not None else logits, act, rw, ids, counts, loc, dest,
        experts, hidden, inter, w13.stride(0), w13.stride(1), dest.stride(0), TOPK=top_k, BLOCK_E=next_pow2(experts),
        BLOCK_J=next_pow2(top_k),
        RENORM=renormalize, RECORD=record is not None, COUNTS=counts.numel(), H_P2=next_pow2(hidden),
        BLOCK_M=config.block_m, BLOCK_N=up.block_n, BLOCK_K=up.block_k, EVEN_K=hidden % up.block_k == 0,
        EVEN_N=inter % up.block_n == 0, IEEE=h.dtype == torch.float32, TMA=tma, SCALED=s13 is not None,
        num_warps=up.warps, num_stages=up.stages, **pdl_args(h))
    out = torch.empty((1, hidden), dtype=h.dtype, device=dev)
    _down(act, w2, rw, (ids, ids, counts), config.block_m, config.down, out=out, early=Early(logits, True, top_k),
          scale=s2)
    return out, r
