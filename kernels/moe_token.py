"""The fused MoE for one token (batch-1 decode) in two launches.

A token's k slots go to k distinct experts (the routing's top k), so the
align step of kernels/moe.py has nothing to sort: block j is pair j alone,
its expert ids[j]. The gate/up launch is moe.moe_up_kernel with `ONE`; the
down launch (`moe_token_down_kernel`) takes every slot of the token for one
column tile of H and adds their weighted products in slot order, so the slot
sum needs no launch of its own. Both are launched with programmatic
dependent launch (kernels/_triton.py).

Each pair's products are the blocks path's (the same BLOCK_K slices in the
same order, one real row per block) and a slot's weighted product is rounded
to the model dtype before the fp32 slot sum, as moe._down and moe._sum_slots
round it, so the result has the blocks path's bits at the same BLOCK_K
(a GPU test holds it). Not for the batch-invariant mode, whose one launch
shape serves every T."""
from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from rollout_engine.kernels._triton import cdiv, pdl_args
from rollout_engine.kernels.moe import Tiles, _fit, _unit_last, _up


class TokenLaunch(NamedTuple):
    """The launch constants of the one-token path (BLOCK_M: rows per block,
    one of them real)."""
    block_m: int
    up: Tiles
    down: Tiles


# The products' BLOCK_K as moe.DECODE's (the same bits); narrower column
# tiles than its 64, so k * I / BLOCK_N and H / BLOCK_N programs spread the
# weight read over the GPU.
TOKEN = TokenLaunch(16, Tiles(32, 256, 4, 3, group=1), Tiles(16, 256, 4, 3, group=1))


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the kernels
    import triton
    import triton.language as tl

    from rollout_engine.kernels.moe import _mma

    @triton.jit
    def moe_token_down_kernel(act_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, H, I, stride_we, stride_wn,
                              TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                              IEEE: tl.constexpr, PDL: tl.constexpr):
        """One column tile of H for every slot j of the token: act[j] @
        w2[ids[j]]^T, times the slot's routing weight, rounded to the output
        dtype, added in slot order in fp32. The slots' K slices run in one
        pipelined loop (a slot's accumulator joins the total at its last
        slice), so the next slot's weights are read while one finishes."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < H
        m_ok = tl.arange(0, BLOCK_M) == 0
        rk = tl.arange(0, BLOCK_K)
        rows = rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        dt = out_ptr.dtype.element_ty
        slices = tl.cdiv(I, BLOCK_K)
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for it in range(0, TOPK * slices):
            j = it // slices
            k0 = (it - j * slices) * BLOCK_K
            e = tl.load(ids_ptr + j).to(tl.int64)
            a_ptrs = act_ptr + j * I + k0 + rk[None, :] + 0 * m_ok[:, None]
            w_ptrs = w_ptr + e * stride_we + k0 + rows
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                if EVEN_N:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + rk < I)[None, :]
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
            acc = _mma(a, w, acc, IEEE=IEEE)
            if k0 + BLOCK_K >= I:  # the slot's last slice
                total += (acc * tl.load(rw_ptr + j)).to(dt).to(tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        tl.store(out_ptr + rn[None, :] + 0 * m_ok[:, None], total.to(dt), mask=m_ok[:, None] & n_ok[None, :])


def fused_moe_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, launch: TokenLaunch = TOKEN) -> torch.Tensor:
    """moe.fused_moe's result for x [1, H] (ids [1, k] distinct, as the
    routing gives them) in two launches."""
    hidden = x.shape[1]
    top_k = ids.shape[1]
    x, w13, w2 = _unit_last(x), _unit_last(w13), _unit_last(w2)
    flat = ids.reshape(-1)
    rw = weights.reshape(-1)
    if rw.dtype != torch.float32:
        rw = rw.float()
    act = _up(x, w13, (flat, flat, flat), top_k, top_k, launch.block_m, launch.up, one=True)
    inter = act.shape[1]
    t = _fit(launch.down, act.dtype)
    out = torch.empty((1, hidden), dtype=x.dtype, device=x.device)
    moe_token_down_kernel[(cdiv(hidden, t.block_n),)](
        act, w2, out, rw, flat, hidden, inter, w2.stride(0), w2.stride(1), TOPK=top_k, BLOCK_M=launch.block_m,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=inter % t.block_k == 0, EVEN_N=hidden % t.block_n == 0,
        IEEE=act.dtype == torch.float32, num_warps=t.warps, num_stages=t.stages, **pdl_args(x))
    return out
