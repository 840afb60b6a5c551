"""MoE routing and experts (kernels/moe.py, moe_align.py, moe_route.py,
moe_row.py) on the GPU, against the torch references: every batch size's
launch shape, expert loads from empty to one hot expert, the one-token
paths, replays in CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from moe_problems import check_align, problem, rel, row_problem, row_unfused
from rollout_engine.kernels import moe, moe_align, moe_route, moe_row

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
        check_align(ids, experts, block_m, aligned)
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
        x, w13, w2, weights, ids = problem(tokens, 64, 8, hidden, inter, torch.bfloat16, "cuda", load, seed=tokens)
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
        out = moe.fused_moe(x, w13, w2, weights, ids.long() if tokens % 2 else ids)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        err, ref_err = rel(out, ref32), rel(ref, ref32)
        assert err < 1e-2 and err < 2 * ref_err + 1e-3, (inter, hidden, err, ref_err)
        inv = moe.fused_moe(x, w13, w2, weights, ids, invariant=True)
        assert rel(inv, ref32) < 1e-2


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
        x, w13, w2, weights, ids = problem(1, experts, top_k, hidden, inter, dtype, "cuda", load, seed=seed)
        blocks = moe._fused_moe_triton(x, w13, w2, weights, ids, moe.DECODE)
        with monkeypatch.context() as m:
            m.setattr(moe, "_align", None)  # the one-token path must not align
            out = moe.fused_moe(x, w13, w2, weights, ids.long() if seed % 2 else ids)
        assert torch.equal(out, blocks), (seed, rel(out, blocks))
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        assert rel(out, ref32) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.gpu
@needs_cuda
def test_one_token_path_replays_after_the_router_in_a_graph():
    """The launches as a decode step runs them, captured in a CUDA graph and
    replayed with new inputs: the router's product, the routing and the
    one-token launches: every replay gives the eager result."""
    from rollout_engine.kernels.gemv import linear

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    x, w13, w2, _, _ = problem(1, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5

    def layer():
        weights, ids = moe_route.route(linear(x, router), top_k, True)
        return (moe.fused_moe(x, w13, w2, weights, ids),)

    _replays_as_eager(x, layer, layer, 20, seed=3)


def _replays_as_eager(x, captured, eager, replays, seed):
    """`captured()` in a CUDA graph, replayed over new rows of x: each
    replay's tensors equal `eager()`'s, bit for bit."""
    captured()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        held = captured()
    g = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(replays):
        x.copy_(torch.randn(x.shape, generator=g).to(x))
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in held]
        want = eager()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


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
        x, residual, norm_w, router, w13, w2 = row_problem(experts, top_k, hidden, inter, torch.bfloat16, "cuda",
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
        ref32 = row_unfused(x.float(), residual.float(), norm_w.float(), router.float(), w13.float(), w2.float(),
                             top_k, renormalize)[0]
        assert rel(out, unfused) < 2e-3 and rel(out, ref32) < 1e-2, (seed, rel(out, unfused), rel(out, ref32))


@pytest.mark.gpu
@needs_cuda
def test_moe_row_replays_in_a_graph_with_new_tokens():
    """moe_row captured in a CUDA graph (with the routing record) and
    replayed with new rows: each replay equals the eager call, its record
    included (the tile counters start from zero at every call)."""
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    x, residual, norm_w, router, w13, w2 = row_problem(experts, top_k, hidden, inter, torch.bfloat16, "cuda")
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
@pytest.mark.parametrize("experts,top_k,inter,hidden", [(128, 8, 768, 2048), (60, 4, 24, 64), (16, 4, 40, 200)])
def test_early_down_replays_with_the_bits_of_the_launch_without_it(experts, top_k, inter, hidden, monkeypatch):
    """EARLY_DOWN (the one-token down launch reads its first weight tile
    before its dependent-launch wait, its experts from what the launch two
    back wrote): the three-launch sparse MLP and the router + routing +
    one-token path, captured in graphs and replayed over new tokens, give
    the bits of eager calls without it."""
    from rollout_engine.kernels.gemv import linear

    x, residual, norm_w, router, w13, w2 = row_problem(experts, top_k, hidden, inter, torch.bfloat16, "cuda")

    def calls():
        row = moe_row.moe_row(x, residual, norm_w, 1e-6, router, w13, w2, top_k, True)
        weights, ids = moe_route.route(linear(x, router), top_k, True)
        return (*row, moe.fused_moe(x, w13, w2, weights, ids))

    def without():
        with monkeypatch.context() as m:
            m.setattr(moe, "EARLY_DOWN", False)
            return calls()

    monkeypatch.setattr(moe, "EARLY_DOWN", True)
    _replays_as_eager(x, calls, without, 12, seed=7)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("load", ["uniform", "counts", "hot"])
@pytest.mark.parametrize("inter,hidden", [(768, 2048), (96, 512), (40, 200)])
def test_large_blocks_with_short_tails_match_the_whole_blocks(load, inter, hidden):
    """128-pair blocks (PREFILL, from 96 pairs an expert) whose last block
    runs a quarter, a half or all of its rows: against the same launch with
    whole blocks and the fp32 reference. `counts` gives the experts 1, 31, 32,
    33, 64, 65, 127, 128, 129, 160, 200 and 300 pairs."""
    experts, top_k = 128, 8
    x, w13, w2, weights, ids = problem(2048, experts, top_k, hidden, inter, torch.bfloat16, "cuda", load, seed=3)
    if load == "counts":
        counts = [1, 31, 32, 33, 64, 65, 127, 128, 129, 160, 200, 300]
        flat = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
        flat = torch.cat([flat, 12 + torch.arange(ids.numel() - flat.numel()) % (experts - 12)])
        ids = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))].view(ids.shape)
        ids = ids.to("cuda", torch.int32)
    config = moe.pick(x.shape[0], top_k, experts)
    assert config.tails and config.block_m == 128
    out = moe.fused_moe(x, w13, w2, weights, ids)
    whole = moe._fused_moe_triton(x, w13, w2, weights, ids, config._replace(tails=False))
    ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
    err, ref_err = rel(out, ref32), rel(ref, ref32)
    assert err < 1e-2 and err < 2 * ref_err + 1e-3, (err, ref_err)
    rows = (out.float() - whole.float()).norm(dim=1) / whole.float().norm(dim=1)
    assert float(rows.max()) < 1e-2  # every token's row: a pair left out would move its token's by ~1/8


@pytest.mark.gpu
@needs_cuda
def test_fused_moe_in_fp32_and_without_tokens():
    x, w13, w2, weights, ids = problem(33, 16, 4, 256, 96, torch.float32, "cuda")
    ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
    assert rel(moe.fused_moe(x, w13, w2, weights, ids), ref) < 1e-5
    empty = moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 256)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [8, 300])
def test_fused_moe_replays_in_a_cuda_graph_with_new_ids(tokens):
    x, w13, w2, weights, ids = problem(tokens, 128, 8, 512, 96, torch.bfloat16, "cuda")
    moe.fused_moe(x, w13, w2, weights, ids)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, weights, ids)
    for seed in (1, 2):
        _, _, _, new_w, new_ids = problem(tokens, 128, 8, 512, 96, torch.bfloat16, "cuda", seed=seed)
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
    x, w13, w2, weights, ids = problem(1, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
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
