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
from rollout_engine.kernels.rmsnorm import rmsnorm_ref
from rollout_engine.kernels.moe import MoeLaunch, Tiles

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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


def _problem(tokens, experts, top_k, hidden, inter, dtype, device="cpu", load="uniform", seed=0):
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


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


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


def test_route_ref_breaks_ties_to_the_lower_expert_and_takes_no_tokens():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    _, ids = moe_route.route_ref(logits, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    weights, ids = moe_route.route_ref(torch.empty(0, 8), 2, True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("invariant", [False, True])
def test_fused_moe_ref_matches_the_naive_sum(invariant):
    x, w13, w2, weights, ids = _problem(6, 5, 3, 32, 24, torch.float32)
    ids[0] = torch.tensor([2, 2, 2])  # one expert in every slot of a token
    out = moe.fused_moe_ref(x, w13, w2, weights, ids, invariant=invariant)
    torch.testing.assert_close(out.double(), _naive(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert moe.fused_moe_ref(x[:0], w13, w2, weights[:0], ids[:0], invariant=invariant).shape == (0, 32)


def test_fused_moe_ref_invariant_rows_do_not_depend_on_the_batch():
    x, w13, w2, weights, ids = _problem(12, 4, 2, 32, 16, torch.bfloat16)
    batch = moe.fused_moe_ref(x, w13, w2, weights, ids, invariant=True)
    for t in (0, 5, 11):
        alone = moe.fused_moe_ref(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], invariant=True)
        assert torch.equal(alone[0], batch[t])


def test_without_a_gpu_the_wrappers_are_the_references():
    x, w13, w2, weights, ids = _problem(5, 6, 2, 32, 16, torch.float32)
    assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids), moe.fused_moe_ref(x, w13, w2, weights, ids))
    logits = torch.randn(5, 6)
    for a, b in zip(moe_route.route(logits, 2, True), moe_route.route_ref(logits, 2, True)):
        assert torch.equal(a, b)


def _check_align(ids, experts, block_m, aligned):
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


@pytest.mark.parametrize("pairs,experts,block_m", [(1, 4, 16), (64, 128, 16), (300, 8, 32), (2000, 60, 64)])
def test_align_ref(pairs, experts, block_m):
    ids = torch.randint(0, experts, (pairs,))
    _check_align(ids, experts, block_m, moe_align.align_ref(ids, experts, block_m))


def test_pick_keeps_one_shape_when_invariant():
    assert moe.pick(8, 8, 128).block_m == 16
    assert moe.pick(4096, 8, 128).block_m > 16
    assert {moe.pick(t, 8, 128, invariant=True) for t in (1, 8, 300, 10_000)} == {moe.INVARIANT}


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
    _check_align(ids, experts, block_m, aligned)
    ref = moe_align.align_ref(ids, experts, block_m)
    assert aligned[0].shape == ref[0].shape and aligned[1].shape == ref[1].shape


@interpreted
@pytest.mark.parametrize("config", TINY, ids=["m16", "m16g2", "m32"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter",
                         [(3, 4, 2, 32, 24), (7, 8, 2, 40, 16), (20, 4, 3, 48, 40)])
def test_interpreted_fused_moe(config, tokens, experts, top_k, hidden, inter):
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x, w13, w2, weights, ids = _problem(tokens, experts, top_k, hidden, inter, dtype)
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        out = moe._fused_moe_triton(x, w13, w2, weights, ids.long(), config)
        assert out.dtype == dtype and _rel(out, ref32) < tol


@interpreted
def test_interpreted_invariant_rows():
    x, w13, w2, weights, ids = _problem(9, 4, 2, 32, 24, torch.float16)
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
        x, w13, w2, weights, ids = _problem(1, experts, top_k, hidden, inter, dtype, load=load)
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        out = moe._fused_moe_one(x, w13, w2, weights, ids.long(), TINY[1])
        assert out.dtype == dtype and out.shape == (1, hidden) and _rel(out, ref32) < tol


def _row_problem(experts, top_k, hidden, inter, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x, w13, w2, _, _ = _problem(1, experts, top_k, hidden, inter, dtype, device, seed=seed)
    residual = torch.randn(1, hidden, generator=g).to(device, dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    router = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    return x, residual, norm_w, router, w13, w2


def _row_unfused(x, residual, norm_w, router, w13, w2, top_k, renormalize):
    """The one-token sparse MLP as the unfused launches compute it, in torch."""
    h, r = rmsnorm_ref(x, norm_w, 1e-6, residual)
    weights, ids = moe_route.route_ref(F.linear(h, router), top_k, renormalize)
    return moe.fused_moe_ref(h, w13, w2, weights, ids), r, ids


@interpreted
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(8, 2, 32, 24), (12, 4, 48, 40)])
def test_interpreted_moe_row(experts, top_k, hidden, inter, renormalize, monkeypatch):
    """The one-token sparse MLP in three launches (norm inside the router's
    product; routing, norm and gate/up; down with the slot sum): the unfused
    result, the new residual stream, and the routing record in its slot.
    The router's one-row product is the GPU's alone (its kernel is built
    inside a function, out of the interpreter's sight): torch's here."""
    def norm_product(h, residual, norm_w, eps, router):
        normed, r = rmsnorm_ref(h, norm_w, eps, residual)
        return F.linear(normed, router), r

    monkeypatch.setattr(moe_row, "norm_gemv", norm_product)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
        x, residual, norm_w, router, w13, w2 = _row_problem(experts, top_k, hidden, inter, dtype)
        ref, ref_r, ref_ids = _row_unfused(x, residual, norm_w, router, w13, w2, top_k, renormalize)
        dest = torch.full((10, 3, top_k), 99, dtype=torch.int16)
        loc = torch.tensor([6])
        out, r = moe_row.moe_row(x, residual, norm_w, 1e-6, router, w13, w2, top_k, renormalize,
                                 (dest[:, 1], loc), TINY[1])
        assert out.dtype == dtype and out.shape == (1, hidden) and _rel(out, ref) < tol
        assert torch.equal(r, ref_r)
        assert dest[6, 1].tolist() == ref_ids[0].tolist()
        untouched = torch.ones(dest.shape[:2], dtype=torch.bool)
        untouched[6, 1] = False
        assert (dest[untouched] == 99).all()


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("experts", [8, 60, 64, 128])
def test_route_matches_reference(experts, dtype):
    for top_k in (1, 2, 4, 8):
        for renormalize in (True, False):
            for tokens in (1, 37, 300):
                logits = torch.randn(tokens, experts, device="cuda").to(dtype)
                w, i = moe_route.route(logits, top_k, renormalize)
                wr, ir = moe_route.route_ref(logits, top_k, renormalize)
                assert torch.equal(i, ir), (top_k, renormalize, tokens)
                torch.testing.assert_close(w, wr, atol=1e-6, rtol=0)
    w, i = moe_route.route(torch.empty(0, experts, device="cuda", dtype=dtype), 2, True)
    assert w.shape == i.shape == (0, 2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("experts,dtype", [(60, torch.uint8), (512, torch.int16)])
def test_route_records_each_tokens_ids_in_its_slot(experts, dtype):
    """Routing capture: the ids also land in dest[loc[t]], a strided column
    of a [slots, layers, k] buffer, in its dtype; other slots untouched."""
    top_k, slots, layers = 8, 1000, 3
    for tokens in (1, 37, 300):
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        buf = torch.full((slots, layers, top_k), 7, dtype=dtype, device="cuda")
        loc = torch.randperm(slots, device="cuda")[:tokens]
        w, i = moe_route.route(logits, top_k, True, (buf[:, 1], loc))
        wr, ir = moe_route.route_ref(logits, top_k, True)
        assert torch.equal(i, ir)
        assert torch.equal(buf[loc, 1].long(), ir.long())
        rest = torch.ones(slots, dtype=torch.bool, device="cuda")
        rest[loc] = False
        assert (buf[rest] == 7).all() and (buf[:, 0] == 7).all() and (buf[:, 2] == 7).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("experts,block_m", [(8, 16), (60, 16), (128, 16), (128, 32), (64, 64), (512, 16)])
def test_align_kernel(experts, block_m):
    for pairs in (1, 64, 65, 1000, 16384):
        ids = torch.randint(0, experts, (pairs,), device="cuda", dtype=torch.int32)
        aligned = moe_align._align(ids, experts, block_m)
        _check_align(ids, experts, block_m, aligned)
        ref = moe_align.align_ref(ids, experts, block_m)
        total = int(ref[2])
        assert torch.equal(aligned[2], ref[2])
        assert torch.equal(aligned[0][:total], ref[0][:total])
        assert torch.equal(aligned[1][: total // block_m], ref[1][: total // block_m])


SHAPES = [(16, 64), (96, 2048), (768, 2048), (24, 64)]  # (I, H)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("load", ["uniform", "sparse", "hot"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 16, 64, 255, 512])
def test_fused_moe_matches_reference(tokens, load):
    for inter, hidden in SHAPES:
        x, w13, w2, weights, ids = _problem(tokens, 64, 8, hidden, inter, torch.bfloat16, "cuda", load, seed=tokens)
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
        out = moe.fused_moe(x, w13, w2, weights, ids.long() if tokens % 2 else ids)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        err, ref_err = _rel(out, ref32), _rel(ref, ref32)
        assert err < 1e-2 and err < 2 * ref_err + 1e-3, (inter, hidden, err, ref_err)
        inv = moe.fused_moe(x, w13, w2, weights, ids, invariant=True)
        assert _rel(inv, ref32) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("load", ["uniform", "hot"])
@pytest.mark.parametrize("experts,top_k,inter,hidden", [(128, 8, 768, 2048), (64, 8, 1024, 2048), (8, 2, 1792, 4096),
                                                        (128, 8, 384, 2048), (60, 4, 24, 64), (16, 4, 40, 200)])
def test_one_token_path_has_the_blocks_paths_bits(experts, top_k, inter, hidden, load, monkeypatch):
    """One token takes `_fused_moe_one` (no align launch; the slot sum in the
    down launch); its result is the blocks path's (align, 16-pair blocks,
    slot sum) bit for bit, at real expert shapes, a tensor-parallel slice
    (384) and sizes off the tiles (200), with ids as int32 or int64, in bf16
    and fp32."""
    for seed, dtype in ((0, torch.bfloat16), (1, torch.bfloat16), (2, torch.float32)):
        x, w13, w2, weights, ids = _problem(1, experts, top_k, hidden, inter, dtype, "cuda", load, seed=seed)
        blocks = moe._fused_moe_triton(x, w13, w2, weights, ids, moe.DECODE)
        with monkeypatch.context() as m:
            m.setattr(moe, "_align", None)  # the one-token path must not align
            out = moe.fused_moe(x, w13, w2, weights, ids.long() if seed % 2 else ids)
        assert torch.equal(out, blocks), (seed, _rel(out, blocks))
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        assert _rel(out, ref32) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@needs_cuda
def test_one_token_path_replays_after_the_router_in_a_graph():
    """The launches as a decode step runs them, captured in a CUDA graph and
    replayed with new inputs: the router's product, the routing and the
    one-token launches: every replay gives the eager result."""
    from rollout_engine.kernels.gemv import linear

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    x, w13, w2, _, _ = _problem(1, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5

    def layer():
        weights, ids = moe_route.route(linear(x, router), top_k, True)
        return moe.fused_moe(x, w13, w2, weights, ids)

    layer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    g = torch.Generator(device="cpu").manual_seed(3)
    for _ in range(20):
        x.copy_(torch.randn(1, hidden, generator=g).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, layer())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("experts,top_k,inter,hidden,renormalize",
                         [(128, 8, 768, 2048, True), (64, 8, 1024, 2048, False), (8, 2, 1792, 4096, True),
                          (128, 8, 384, 2048, True), (60, 4, 24, 64, True), (16, 4, 40, 200, False)])
def test_moe_row_matches_the_unfused_launches(experts, top_k, inter, hidden, renormalize):
    """The one-token sparse MLP in three launches against the launches it
    replaces: the residual stream bit for bit, the routing the routing
    kernel gives on the same logits (recorded in the token's slot), and the
    experts' sum within the rounding of the norm's sum of squares."""
    from rollout_engine.kernels.gemv import norm_gemv
    from rollout_engine.kernels.rmsnorm import rmsnorm

    for seed in range(3):
        x, residual, norm_w, router, w13, w2 = _row_problem(experts, top_k, hidden, inter, torch.bfloat16, "cuda",
                                                            seed)
        logits, r = norm_gemv(x, residual, norm_w, 1e-6, router)
        weights, ids = moe_route.route(logits, top_k, renormalize)
        h, _ = rmsnorm(x, norm_w, 1e-6, residual)
        unfused = moe.fused_moe(h, w13, w2, weights, ids)
        dest = torch.full((5, 2, top_k), 99, dtype=torch.int16, device="cuda")
        loc = torch.tensor([3], device="cuda")
        out, r_row = moe_row.moe_row(x, residual, norm_w, 1e-6, router, w13, w2, top_k, renormalize,
                                     (dest[:, 0], loc))
        assert torch.equal(r_row, r)
        assert dest[3, 0].tolist() == ids[0].tolist()
        untouched = torch.ones(dest.shape[:2], dtype=torch.bool, device="cuda")
        untouched[3, 0] = False
        assert (dest[untouched] == 99).all()
        ref32 = _row_unfused(x.float(), residual.float(), norm_w.float(), router.float(), w13.float(), w2.float(),
                             top_k, renormalize)[0]
        assert _rel(out, unfused) < 2e-3 and _rel(out, ref32) < 1e-2, (seed, _rel(out, unfused), _rel(out, ref32))


@pytest.mark.gpu
@needs_cuda
def test_moe_row_replays_in_a_graph_with_new_tokens():
    """moe_row captured in a CUDA graph (with the routing record) and
    replayed with new rows: each replay equals the eager call, its record
    included (the tile counters start from zero at every call)."""
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    x, residual, norm_w, router, w13, w2 = _row_problem(experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    dest = torch.zeros((4, 1, top_k), dtype=torch.int16, device="cuda")
    loc = torch.tensor([2], device="cuda")

    def call():
        return moe_row.moe_row(x, residual, norm_w, 1e-6, router, w13, w2, top_k, True, (dest[:, 0], loc))

    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, r = call()
    g = torch.Generator(device="cpu").manual_seed(5)
    for _ in range(20):
        x.copy_(torch.randn(1, hidden, generator=g).to(x))
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone(), r.clone(), dest.clone()
        want = call()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], dest)


@pytest.mark.gpu
@needs_cuda
def test_fused_moe_in_fp32_and_without_tokens():
    x, w13, w2, weights, ids = _problem(33, 16, 4, 256, 96, torch.float32, "cuda")
    ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
    assert _rel(moe.fused_moe(x, w13, w2, weights, ids), ref) < 1e-5
    empty = moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 256)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [8, 300])
def test_fused_moe_replays_in_a_cuda_graph_with_new_ids(tokens):
    x, w13, w2, weights, ids = _problem(tokens, 128, 8, 512, 96, torch.bfloat16, "cuda")
    moe.fused_moe(x, w13, w2, weights, ids)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):
        _, _, _, new_w, new_ids = _problem(tokens, 128, 8, 512, 96, torch.bfloat16, "cuda", seed=seed)
        if seed == 2:
            new_ids[: tokens // 2] = torch.arange(8, device="cuda", dtype=torch.int32)  # a crowded expert 0..7
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe.fused_moe(x, w13, w2, weights, ids))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("inter,hidden", [(96, 512), (768, 2048)])
def test_invariant_rows_do_not_depend_on_the_batch(inter, hidden):
    experts, top_k = 64, 8
    x, w13, w2, weights, ids = _problem(1, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    alone = moe.fused_moe(x, w13, w2, weights, ids, invariant=True)
    g = torch.Generator(device="cpu").manual_seed(7)
    for others in (1, 2, 5, 31, 64, 200, 512):
        ox = torch.randn(others, hidden, generator=g).to("cuda", torch.bfloat16)
        logits = torch.randn(others, experts, generator=g)
        logits[:, ids[0].long().cpu()] += 2  # the others crowd the token's experts
        ow, oi = moe_route.route_ref(logits, top_k, True)
        at = int(torch.randint(0, others + 1, (1,), generator=g))
        bx = torch.cat([ox[:at], x, ox[at:]])
        bw = torch.cat([ow[:at].cuda(), weights, ow[at:].cuda()])
        bi = torch.cat([oi[:at].cuda(), ids, oi[at:].cuda()])
        batch = moe.fused_moe(bx, w13, w2, bw, bi, invariant=True)
        assert torch.equal(batch[at], alone[0]), others


def test_route_ref_records_into_the_slots():
    logits = torch.randn(5, 12)
    buf = torch.zeros(20, 2, 3, dtype=torch.uint8)
    loc = torch.tensor([4, 0, 19, 7, 8])
    _, ids = moe_route.route(logits, 3, False, (buf[:, 1], loc))
    assert torch.equal(buf[loc, 1].long(), ids.long()) and not buf[:, 0].any()
