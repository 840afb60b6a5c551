"""Shared by the MoE kernel tests (CPU, interpreter and GPU): random
problems for the experts and the one-token sparse MLP, the align's checks,
and the unfused one-token reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_engine.kernels import moe, moe_route
from rollout_engine.kernels.rmsnorm import rmsnorm_ref


def problem(tokens, experts, top_k, hidden, inter, dtype, device="cpu", load="uniform", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)  # the weights made where they live (fast on a GPU)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gd, device=device) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gd, device=device) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    if load == "sparse":  # most experts get nothing
        logits[:, 3:] -= 100
        logits[:, :3] += torch.randn(tokens, 3, generator=g)
    weights, ids = moe_route.route_ref(logits, top_k, True)
    if load == "hot":  # every pair on expert 3
        ids = torch.full_like(ids, 3)
    return x, w13, w2, weights.to(device), ids.to(device)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_align(ids, experts, block_m, aligned):
    """An align result: each expert's pairs in order, padded with the
    sentinel to a multiple of block_m, the blocks' experts and the total."""
    sorted_ids, block_expert, total = (t.cpu() for t in aligned)
    flat = ids.reshape(-1).long().cpu()
    pairs = flat.numel()
    total = int(total)
    assert total % block_m == 0 and sorted_ids.numel() >= total
    pos = 0
    for e in range(experts):
        mine = (flat == e).nonzero().flatten()
        if mine.numel() == 0:
            continue
        span = -(-mine.numel() // block_m) * block_m
        assert sorted_ids[pos: pos + mine.numel()].tolist() == mine.tolist()
        assert (sorted_ids[pos + mine.numel(): pos + span] == pairs).all()
        assert (block_expert[pos // block_m: (pos + span) // block_m] == e).all()
        pos += span
    assert pos == total


def row_problem(experts, top_k, hidden, inter, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x, w13, w2, _, _ = problem(1, experts, top_k, hidden, inter, dtype, device, seed=seed)
    residual = torch.randn(1, hidden, generator=g).to(device, dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    router = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    return x, residual, norm_w, router, w13, w2


def row_unfused(x, residual, norm_w, router, w13, w2, top_k, renormalize):
    """The one-token sparse MLP as the unfused launches compute it, in torch."""
    h, r = rmsnorm_ref(x, norm_w, 1e-6, residual)
    weights, ids = moe_route.route_ref(F.linear(h, router), top_k, renormalize)
    return moe.fused_moe_ref(h, w13, w2, weights, ids), r, ids


def fp8_experts(w13, w2):
    """The experts as an fp8 engine holds them: ((e4m3 w13, its scales [E,
    2I, 1]), (e4m3 w2, its scales [E, H, 1])), one scale a row of the last
    dimension (kernels/fp8.py: quantize_channels)."""
    from rollout_engine.kernels.fp8 import quantize_channels

    def one(w):
        q, s = quantize_channels(w.reshape(-1, w.shape[-1]).float())
        return q.view(w.shape).to(w.device), s.view(*w.shape[:-1], 1).to(w.device)

    return one(w13), one(w2)


def held(q, s):
    """The values e4m3 experts q [E, rows, K] with their multipliers s [E,
    rows, 1] hold, in fp32 (kernels/fp8.py: dequantize_channels, row by row)."""
    return q.float() * s
