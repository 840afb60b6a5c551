"""MoE routing and experts (kernels/moe.py): the torch references on the CPU;
the Triton kernels against them on the GPU and, at tiny sizes, under Triton's
interpreter on the CPU (run with TRITON_INTERPRET=1 where Triton is
installed; skipped otherwise; bf16 products are left to the GPU: the
interpreter gets them wrong). Triton 3.6's interpreter needs numpy < 2.4:
with 2.4 every loop over a kernel argument fails in the interpreter itself
("only 0-dimensional arrays can be converted to Python scalars")."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from rollout_engine.kernels import moe, moe_align, moe_route, moe_row
from rollout_engine.kernels.moe import MoeLaunch, Tiles
from moe_problems import check_align, problem, rel, row_problem, row_unfused

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def _naive(x, w13, w2, weights, ids):
    """Every (token, slot) on its own, in fp64."""
    inter = w2.shape[2]
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


# ---------------------------------------------------------------- references (CPU)

@pytest.mark.parametrize("renormalize", [True, False])
def test_route_ref_is_softmax_topk(renormalize):
    logits = torch.randn(9, 60)
    weights, ids = moe_route.route_ref(logits.bfloat16(), 4, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (9, 4)
    probs = torch.softmax(logits.bfloat16().float(), -1)
    top = probs.topk(4, -1)
    torch.testing.assert_close(torch.gather(probs, 1, ids.long()), top.values)
    assert (weights[:, :-1] >= weights[:, 1:]).all()
    expect = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    torch.testing.assert_close(weights, expect)


def test_route_ref_records_into_the_slots():
    logits = torch.randn(5, 12)
    buf = torch.zeros(20, 2, 3, dtype=torch.uint8)
    loc = torch.tensor([4, 0, 19, 7, 8])
    _, ids = moe_route.route(logits, 3, False, (buf[:, 1], loc))
    assert torch.equal(buf[loc, 1].long(), ids.long()) and not buf[:, 0].any()


def test_route_ref_breaks_ties_to_the_lower_expert_and_takes_no_tokens():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    _, ids = moe_route.route_ref(logits, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    weights, ids = moe_route.route_ref(torch.empty(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("invariant", [False, True])
def test_fused_moe_ref_matches_the_naive_sum(invariant):
    x, w13, w2, weights, ids = problem(6, 5, 3, 32, 24, torch.float32)
    ids[0] = torch.tensor([2, 2, 2])  # one expert in every slot of a token
    out = moe.fused_moe_ref(x, w13, w2, weights, ids, invariant=invariant)
    torch.testing.assert_close(out.double(), _naive(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert moe.fused_moe_ref(x[:0], w13, w2, weights[:0], ids[:0], invariant=invariant).shape == (0, 32)


def test_fused_moe_ref_invariant_rows_do_not_depend_on_the_batch():
    x, w13, w2, weights, ids = problem(12, 4, 2, 32, 16, torch.bfloat16)
    batch = moe.fused_moe_ref(x, w13, w2, weights, ids, invariant=True)
    for t in (0, 5, 11):
        alone = moe.fused_moe_ref(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], invariant=True)
        assert torch.equal(alone[0], batch[t])


def test_without_a_gpu_the_wrappers_are_the_references():
    x, w13, w2, weights, ids = problem(5, 6, 2, 32, 16, torch.float32)
    assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids), moe.fused_moe_ref(x, w13, w2, weights, ids))
    logits = torch.randn(5, 6)
    for a, b in zip(moe_route.route(logits, 2, True), moe_route.route_ref(logits, 2, True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pairs,experts,block_m", [(1, 4, 16), (64, 128, 16), (300, 8, 32), (2000, 60, 64)])
def test_align_ref(pairs, experts, block_m):
    ids = torch.randint(0, experts, (pairs,))
    check_align(ids, experts, block_m, moe_align.align_ref(ids, experts, block_m))


def test_pick_keeps_one_shape_when_invariant():
    assert moe.pick(8, 8, 128).block_m == 16
    assert moe.pick(4096, 8, 128).block_m > 16
    assert {moe.pick(t, 8, 128, invariant=True) for t in (1, 8, 300, 10_000)} == {moe.INVARIANT}


def test_only_the_large_blocks_run_short_tails_and_never_invariant():
    """An expert's last block runs fewer rows of products only at 128-pair
    blocks (a quarter of a smaller block would be under the 16 rows of a
    tensor-core product), and never with `invariant`, whose rows must not
    change with the batch."""
    assert moe.pick(2048, 8, 128).tails and moe.pick(2048, 8, 128).block_m == 128
    assert not moe.INVARIANT.tails
    assert all(not launch.tails for _, launch in moe.ROWS)


# ---------------------------------------------------------------- Triton's interpreter (CPU)

TINY = [MoeLaunch(16, Tiles(16, 16, 4, 2, group=1), Tiles(16, 16, 4, 2, group=1)),
        MoeLaunch(16, Tiles(16, 32, 4, 2, group=2), Tiles(32, 16, 4, 2, group=3)),
        MoeLaunch(32, Tiles(32, 16, 4, 2), Tiles(16, 32, 4, 2))]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_route(dtype):
    logits = torch.randn(11, 12).to(dtype)
    logits[0, 5] = logits[0, 7] = logits[0].max() + 1  # a tie at the top
    for renormalize in (True, False):
        w, i = moe_route._route_triton(logits, 3, renormalize)
        wr, ir = moe_route.route_ref(logits, 3, renormalize)
        assert torch.equal(i, ir)
        torch.testing.assert_close(w, wr, atol=1e-6, rtol=0)
    assert moe_route._route_triton(logits[:0], 3, True)[0].shape == (0, 3)


@interpreted
@pytest.mark.parametrize("pairs,experts,block_m", [(6, 4, 16), (100, 128, 16), (300, 8, 32), (700, 16, 64),
                                                    (9000, 16, 64)])  # 71 chunks
def test_interpreted_align(pairs, experts, block_m):
    ids = torch.randint(0, experts, (pairs,), dtype=torch.int32)
    aligned = moe_align._align(ids, experts, block_m)
    check_align(ids, experts, block_m, aligned)
    ref = moe_align.align_ref(ids, experts, block_m)
    assert aligned[0].shape == ref[0].shape and aligned[1].shape == ref[1].shape


@interpreted
@pytest.mark.parametrize("config", TINY, ids=["m16", "m16g2", "m32"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter",
                         [(3, 4, 2, 32, 24), (7, 8, 2, 40, 16), (20, 4, 3, 48, 40)])
def test_interpreted_fused_moe(config, tokens, experts, top_k, hidden, inter):
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x, w13, w2, weights, ids = problem(tokens, experts, top_k, hidden, inter, dtype)
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        out = moe._fused_moe_triton(x, w13, w2, weights, ids.long(), config)
        assert out.dtype == dtype and rel(out, ref32) < tol


@interpreted
@pytest.mark.parametrize("counts", [[5, 20, 40, 65, 94, 0, 16, 17, 33, 128], [1, 64, 129, 48]])
def test_interpreted_short_tails(counts):
    """Blocks of 64 pairs whose real pairs fill a quarter (16 rows), a half
    or more of them: each expert's pairs counted as given (one slot a
    token), in every branch of the tails, against the unshortened launch and
    the reference."""
    experts = len(counts)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])[torch.randperm(sum(counts))][:, None]
    x, w13, w2, _, _ = problem(ids.shape[0], experts, 1, 48, 40, torch.float32)
    weights = torch.rand(ids.shape)
    launch = MoeLaunch(64, Tiles(16, 16, 4, 2, group=3), Tiles(32, 16, 4, 2), tails=True)
    out = moe._fused_moe_triton(x, w13, w2, weights, ids, launch)
    full = moe._fused_moe_triton(x, w13, w2, weights, ids, launch._replace(tails=False))
    ref32 = moe.fused_moe_ref(x, w13, w2, weights, ids)
    assert rel(out, ref32) < 1e-5 and rel(out, full) < 1e-5


@interpreted
def test_interpreted_invariant_rows():
    x, w13, w2, weights, ids = problem(9, 4, 2, 32, 24, torch.float16)
    batch = moe._fused_moe_triton(x, w13, w2, weights, ids, TINY[0])
    for t in (0, 4, 8):
        alone = moe._fused_moe_triton(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], TINY[0])
        assert torch.equal(alone[0], batch[t])


@interpreted
@pytest.mark.parametrize("load", ["uniform", "hot"])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(8, 2, 32, 24), (16, 4, 64, 40), (4, 3, 48, 16)])
def test_interpreted_one_token(experts, top_k, hidden, inter, load):
    """The one-token path (one pair per block, no align), also with every
    slot on one expert and K or N not a multiple of the tiles."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x, w13, w2, weights, ids = problem(1, experts, top_k, hidden, inter, dtype, load=load)
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        out = moe._fused_moe_one(x, w13, w2, weights, ids.long(), TINY[1])
        assert out.dtype == dtype and out.shape == (1, hidden) and rel(out, ref32) < tol


@interpreted
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(8, 2, 32, 24), (12, 4, 48, 40)])
def test_interpreted_moe_row(experts, top_k, hidden, inter, renormalize, monkeypatch):
    """The one-token sparse MLP in three launches (norm inside the router's
    product; routing, norm and gate/up; down with the slot sum): the unfused
    result, the new residual stream, and the routing record in its slot;
    the same with the down launch's first weight block read before its
    wait (EARLY_DOWN), its experts from the router's logits."""
    for early in (False, True):
        monkeypatch.setattr(moe, "EARLY_DOWN", early)
        _check_moe_row(experts, top_k, hidden, inter, renormalize)


def _check_moe_row(experts, top_k, hidden, inter, renormalize):
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
        x, residual, norm_w, router, w13, w2 = row_problem(experts, top_k, hidden, inter, dtype)
        ref, ref_r, ref_ids = row_unfused(x, residual, norm_w, router, w13, w2, top_k, renormalize)
        dest = torch.full((10, 3, top_k), 99, dtype=torch.int16)
        loc = torch.tensor([6])
        out, r = moe_row.moe_row(x, residual, norm_w, 1e-6, router, w13, w2, top_k, renormalize,
                                 (dest[:, 1], loc), TINY[1])
        assert out.dtype == dtype and out.shape == (1, hidden) and rel(out, ref) < tol
        assert torch.equal(r, ref_r)
        assert dest[6, 1].tolist() == ref_ids[0].tolist()
        untouched = torch.ones(dest.shape[:2], dtype=torch.bool)
        untouched[6, 1] = False
        assert (dest[untouched] == 99).all()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interpreted_tma_weights_equal_pointer_loads(dtype, monkeypatch):
    """The weight tiles read through tensor descriptors (TMA_WEIGHTS): the
    same products as the pointer loads, bit for bit, in every path that
    reads expert weights: blocks with and without short tails, a tile of
    I or H past the weights' end (a gate tile past I reads up rows, whose
    columns are not stored), one token, and the three-launch sparse MLP."""
    def both(fn):
        monkeypatch.setattr(moe, "TMA_WEIGHTS", False)
        before = fn()
        monkeypatch.setattr(moe, "TMA_WEIGHTS", True)
        return before, fn()

    x, w13, w2, weights, ids = problem(20, 4, 3, 48, 40, dtype)
    monkeypatch.setattr(moe, "TMA_WEIGHTS", True)
    assert moe.weight_tiles(w13, TINY[1].up)[1]  # the descriptor path is the one taken
    for config in TINY:
        off, on = both(lambda: moe._fused_moe_triton(x, w13, w2, weights, ids.long(), config))
        assert torch.equal(off, on)
        off, on = both(lambda: moe._fused_moe_one(x[:1], w13, w2, weights[:1], ids[:1].long(), config))
        assert torch.equal(off, on)
    counts = [5, 20, 40, 65, 0, 17]
    tail_ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])[torch.randperm(sum(counts))][:, None]
    tx, tw13, tw2, _, _ = problem(tail_ids.shape[0], len(counts), 1, 48, 40, dtype)
    launch = MoeLaunch(64, Tiles(16, 16, 4, 2, group=3), Tiles(32, 16, 4, 2), tails=True)
    tail_weights = torch.rand(tail_ids.shape)
    off, on = both(lambda: moe._fused_moe_triton(tx, tw13, tw2, tail_weights, tail_ids, launch))
    assert torch.equal(off, on)

    rx, residual, norm_w, router, rw13, rw2 = row_problem(8, 2, 32, 24, dtype)
    off, on = both(lambda: moe_row.moe_row(rx, residual, norm_w, 1e-6, router, rw13, rw2, 2, True, None, TINY[1]))
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])


@interpreted
@pytest.mark.parametrize("tma", [False, True])
def test_interpreted_early_down_keeps_the_bits(tma, monkeypatch):
    """EARLY_DOWN: the one-token down launch's first weight block read before
    its wait, its expert from the routing's ids (`_fused_moe_one`) or from
    the router's logits (`moe_row`): the bits of the launch without it,
    through pointer loads and the copy engine, K a multiple of the tile and
    not, every slot on one expert."""
    def both(fn):
        monkeypatch.setattr(moe, "EARLY_DOWN", False)
        before = fn()
        monkeypatch.setattr(moe, "EARLY_DOWN", True)
        return before, fn()

    monkeypatch.setattr(moe, "TMA_WEIGHTS", tma)
    for inter, load in ((40, "uniform"), (48, "hot"), (16, "uniform")):
        x, w13, w2, weights, ids = problem(1, 6, 3, 48, inter, torch.float32, load=load)
        for config in TINY:
            off, on = both(lambda: moe._fused_moe_one(x, w13, w2, weights, ids.long(), config))
            assert torch.equal(off, on)
    rx, residual, norm_w, router, rw13, rw2 = row_problem(12, 4, 48, 40, torch.float32)
    off, on = both(lambda: moe_row.moe_row(rx, residual, norm_w, 1e-6, router, rw13, rw2, 4, True, None, TINY[1]))
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])
    # an early guess of another expert (each slot told its neighbour's): the tile is read again after the wait
    down = moe._down

    def misled(*args, early=None, **kwargs):
        return down(*args, early=early._replace(source=early.source.roll(1)) if early else None, **kwargs)

    x, w13, w2, weights, ids = problem(1, 6, 3, 48, 40, torch.float32)
    off, _ = both(lambda: moe._fused_moe_one(x, w13, w2, weights, ids.long(), TINY[1]))
    monkeypatch.setattr(moe, "_down", misled)
    assert torch.equal(moe._fused_moe_one(x, w13, w2, weights, ids.long(), TINY[1]), off)


def test_tma_weights_only_where_the_copy_engine_can_read_them(monkeypatch):
    """Pointer loads (the weights themselves) with the switch off, off a
    GPU outside the interpreter, and where a row of the weights is not a
    multiple of 16 bytes."""
    w = torch.zeros(4, 32, 64, dtype=torch.float16)
    tiles = Tiles(16, 32, 4, 2)
    monkeypatch.setattr(moe, "TMA_WEIGHTS", False)
    assert moe.weight_tiles(w, tiles) == (w, False)
    monkeypatch.setattr(moe, "TMA_WEIGHTS", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert moe.weight_tiles(w, tiles) == (w, False)  # a CPU tensor, not interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    odd = torch.zeros(4, 32, 36, dtype=torch.float16)  # rows of 72 bytes
    assert moe.weight_tiles(odd, tiles) == (odd, False)
    if importlib.util.find_spec("triton") is not None:
        desc, on = moe.weight_tiles(w, tiles)
        assert on and list(desc.block_shape) == [1, 16, 32]
