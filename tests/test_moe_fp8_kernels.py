"""fp8 MoE experts (quantization="fp8"): e4m3 weights with one multiplier a
row, the activations as they are. The torch reference against the products
of the weights read back through their scales, and the Triton kernels
against the reference under Triton's interpreter on the CPU (run with
TRITON_INTERPRET=1; skipped otherwise), in every path that reads expert
weights: blocks with and without short tails, one token, the three-launch sparse MLP (with its early read), and
weight tiles through tensor descriptors."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from moe_problems import fp8_experts, held, problem, rel, row_problem, row_unfused
from rollout_engine.kernels import moe, moe_row
from rollout_engine.kernels.fp8 import FP8
from rollout_engine.kernels.moe import MoeLaunch, Tiles

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

TINY = [MoeLaunch(16, Tiles(16, 16, 4, 2, group=1), Tiles(16, 16, 4, 2, group=1)),
        MoeLaunch(16, Tiles(16, 32, 4, 2, group=2), Tiles(32, 16, 4, 2, group=3)),
        MoeLaunch(32, Tiles(32, 16, 4, 2), Tiles(16, 32, 4, 2))]
TAILS = MoeLaunch(64, Tiles(16, 16, 4, 2, group=3), Tiles(32, 16, 4, 2), tails=True)


@pytest.mark.parametrize("invariant", [False, True])
def test_the_reference_multiplies_by_the_held_weights(invariant):
    """fused_moe_ref with e4m3 experts and their scales: the products of the
    values they hold (to fp32 rounding), the experts in e4m3 throughout."""
    x, w13, w2, weights, ids = problem(9, 6, 2, 32, 24, torch.float32)
    (q13, s13), (q2, s2) = fp8_experts(w13, w2)
    assert q13.dtype == FP8 and s13.shape == (6, 48, 1) and s2.shape == (6, 32, 1)
    out = moe.fused_moe_ref(x, q13, q2, weights, ids, invariant, scales=(s13, s2))
    on_held = moe.fused_moe_ref(x, held(q13, s13), held(q2, s2), weights, ids, invariant)
    assert rel(out, on_held) < 1e-6
    assert rel(out, moe.fused_moe_ref(x, w13, w2, weights, ids)) > 1e-3  # fp8 moved it: not the bf16 weights
    assert torch.equal(moe.fused_moe(x, q13, q2, weights, ids, invariant, scales=(s13, s2)), out)  # the CPU's path


def _fp8_problem(tokens, experts, top_k, hidden, inter, dtype, load="uniform"):
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, inter, dtype, load=load)
    (q13, s13), (q2, s2) = fp8_experts(w13, w2)
    return x, q13, q2, weights, ids.long(), (s13, s2)


def _ref32(x, q13, q2, weights, ids, scales):
    return moe.fused_moe_ref(x.float(), q13, q2, weights, ids, scales=scales)


@interpreted
@pytest.mark.parametrize("config", TINY + [TAILS], ids=["m16", "m16g2", "m32", "tails"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,load",
                         [(3, 4, 2, 32, 24, "uniform"), (20, 4, 3, 48, 40, "uniform"), (7, 8, 2, 40, 16, "hot")])
def test_interpreted_fp8_blocks(config, tokens, experts, top_k, hidden, inter, load):
    """The blocks path with e4m3 experts against the reference; H and I
    not multiples of the tiles."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x, q13, q2, weights, ids, scales = _fp8_problem(tokens, experts, top_k, hidden, inter, dtype, load)
        out = moe._fused_moe_triton(x, q13, q2, weights, ids, config, scales)
        assert out.dtype == dtype and rel(out, _ref32(x, q13, q2, weights, ids, scales)) < tol, dtype


@interpreted
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("load", ["uniform", "hot"])
def test_interpreted_fp8_one_token(early, load, monkeypatch):
    """One token (no align; the slot sum in the down launch) with e4m3
    experts, with and without the down launch's early weight read: the
    reference, and the blocks path's bits."""
    monkeypatch.setattr(moe, "EARLY_DOWN", early)
    for experts, top_k, hidden, inter in ((8, 2, 32, 24), (6, 3, 48, 40)):
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            x, q13, q2, weights, ids, scales = _fp8_problem(1, experts, top_k, hidden, inter, dtype, load)
            out = moe._fused_moe_one(x, q13, q2, weights, ids, TINY[1], scales)
            assert rel(out, _ref32(x, q13, q2, weights, ids, scales)) < tol
            if dtype == torch.float32:
                blocks = moe._fused_moe_triton(x, q13, q2, weights, ids, TINY[1], scales)
                assert torch.equal(out, blocks)


@interpreted
@pytest.mark.parametrize("early", [False, True])
def test_interpreted_fp8_moe_row(early, monkeypatch):
    """The three-launch sparse MLP of one token with e4m3 experts: the
    unfused result (norm, router, routing, then the experts), the residual
    stream and the routing record."""
    monkeypatch.setattr(moe, "EARLY_DOWN", early)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
        x, residual, norm_w, router, w13, w2 = row_problem(12, 4, 48, 40, dtype)
        (q13, s13), (q2, s2) = fp8_experts(w13, w2)
        ref, ref_r, ref_ids = row_unfused(x, residual, norm_w, router, held(q13, s13).to(dtype),
                                          held(q2, s2).to(dtype), 4, True)
        dest = torch.full((4, 1, 4), 99, dtype=torch.int16)
        out, r = moe_row.moe_row(x, residual, norm_w, 1e-6, router, q13, q2, 4, True, (dest[:, 0], torch.tensor([2])),
                                 TINY[1], scales=(s13, s2))
        assert rel(out, ref) < tol and torch.equal(r, ref_r)
        assert dest[2, 0].tolist() == ref_ids[0].tolist()


@interpreted
def test_interpreted_fp8_weight_tiles_through_descriptors(monkeypatch):
    """e4m3 weight tiles through tensor descriptors (TMA_WEIGHTS): the bits
    of the pointer loads, in the blocks (with tails), one-token and
    three-launch paths."""
    def both(fn):
        monkeypatch.setattr(moe, "TMA_WEIGHTS", False)
        before = fn()
        monkeypatch.setattr(moe, "TMA_WEIGHTS", True)
        return before, fn()

    x, q13, q2, weights, ids, scales = _fp8_problem(20, 4, 3, 48, 40, torch.float32)
    monkeypatch.setattr(moe, "TMA_WEIGHTS", True)
    assert moe.weight_tiles(q13, TINY[1].up)[1]  # 48 one-byte columns: rows of 48 bytes, readable
    for config in (TINY[1], TAILS):
        off, on = both(lambda: moe._fused_moe_triton(x, q13, q2, weights, ids, config, scales))
        assert torch.equal(off, on)
    off, on = both(lambda: moe._fused_moe_one(x[:1], q13, q2, weights[:1], ids[:1], TINY[1], scales))
    assert torch.equal(off, on)
    rx, residual, norm_w, router, w13, w2 = row_problem(8, 2, 32, 48, torch.float32)
    (r13, t13), (r2, t2) = fp8_experts(w13, w2)
    off, on = both(lambda: moe_row.moe_row(rx, residual, norm_w, 1e-6, router, r13, r2, 2, True, None, TINY[1],
                                           scales=(t13, t2)))
    assert torch.equal(off[0], on[0])
