"""Each Triton kernel against its torch reference."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _close(a, b, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_with_and_without_residual(dtype):
    from rollout_engine.kernels.rmsnorm import rmsnorm, rmsnorm_ref

    x = torch.randn(37, 1000, device="cuda", dtype=dtype) * 3
    res = torch.randn(37, 1000, device="cuda", dtype=dtype)
    w = torch.randn(1000, device="cuda", dtype=dtype)
    out, _ = rmsnorm(x, w, 1e-6)
    _close(out, rmsnorm_ref(x, w, 1e-6)[0], dtype)
    out, new_res = rmsnorm(x, w, 1e-6, res)
    ref_out, ref_res = rmsnorm_ref(x, w, 1e-6, res)
    _close(out, ref_out, dtype)
    assert torch.equal(new_res, ref_res)  # the add is rounded exactly like the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_per_head_on_a_strided_view(dtype):
    from rollout_engine.kernels.rmsnorm import rmsnorm, rmsnorm_ref

    qkv = torch.randn(9, 6 * 64, device="cuda", dtype=dtype)
    q = qkv[:, : 4 * 64].view(9, 4, 64)  # row stride 384: not contiguous
    w = torch.randn(64, device="cuda", dtype=dtype)
    out, _ = rmsnorm(q, w, 1e-6)
    _close(out, rmsnorm_ref(q, w, 1e-6)[0], dtype)


@pytest.mark.parametrize("two_programs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_reference(dtype, two_programs, monkeypatch):
    from rollout_engine.kernels import rope as rope_module
    from rollout_engine.kernels.rope import rope, rope_ref
    from rollout_engine.layers.rotary import RotaryEmbedding
    from rollout_engine.models.config import RopeConfig

    monkeypatch.setattr(rope_module, "TWO_PROGRAMS_PER_TOKEN", two_programs)
    rot = RotaryEmbedding(128, 4096, RopeConfig(theta=1e6)).cuda()
    qkv = torch.randn(50, (12 + 2 * 4) * 128, device="cuda", dtype=dtype)
    q = qkv[:, : 12 * 128].view(50, 12, 128)
    k = qkv[:, 12 * 128: 16 * 128].view(50, 4, 128)
    pos = torch.randint(0, 4096, (50,), device="cuda")
    qo, ko = rope(pos, q, k, rot.cos, rot.sin)
    qr, kr = rope_ref(pos, q, k, rot.cos, rot.sin)
    assert qo.is_contiguous() and ko.is_contiguous()
    _close(qo, qr, dtype)
    _close(ko, kr, dtype)


@pytest.mark.parametrize("two_programs", [True, False])  # per token: q | k, v, or both in one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_writes_the_cache_slots(dtype, two_programs, monkeypatch):
    from rollout_engine.kernels import rope as rope_module
    from rollout_engine.kernels.rope import rope_and_store, rope_and_store_ref
    from rollout_engine.layers.rotary import RotaryEmbedding
    from rollout_engine.models.config import RopeConfig

    monkeypatch.setattr(rope_module, "TWO_PROGRAMS_PER_TOKEN", two_programs)
    rot = RotaryEmbedding(64, 4096, RopeConfig(theta=1e4)).cuda()
    qkv = torch.randn(23, (8 + 2 * 2) * 64, device="cuda", dtype=dtype)
    q, k, v = (t.view(23, -1, 64) for t in qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1))
    pos = torch.randint(0, 4096, (23,), device="cuda")
    loc = torch.randperm(100, device="cuda")[:23]
    caches = [torch.full((100, 2, 64), 7.0, device="cuda", dtype=dtype) for _ in range(4)]
    qo = rope_and_store(pos, q, k, v, rot.cos, rot.sin, caches[0], caches[1], loc)
    qr = rope_and_store_ref(pos, q, k, v, rot.cos, rot.sin, caches[2], caches[3], loc)
    assert qo.is_contiguous()
    _close(qo, qr, dtype)
    _close(caches[0], caches[2], dtype)
    assert torch.equal(caches[1], caches[3])  # v is copied as is
    untouched = torch.ones(100, dtype=torch.bool, device="cuda")
    untouched[loc] = False
    assert (caches[0][untouched] == 7).all() and (caches[1][untouched] == 7).all()


@pytest.mark.parametrize("two_programs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_with_qk_norm_matches_the_norms_then_the_rotation(dtype, two_programs, monkeypatch):
    """Qwen3's per-head q/k RMSNorm inside the rotary kernel: the same values
    as the reference norm + rotation, and as the separate GPU norm kernel
    followed by the rotary kernel."""
    from rollout_engine.kernels import rope as rope_module
    from rollout_engine.kernels.rmsnorm import rmsnorm
    from rollout_engine.kernels.rope import rope_and_store, rope_and_store_ref
    from rollout_engine.layers.rotary import RotaryEmbedding
    from rollout_engine.models.config import RopeConfig

    monkeypatch.setattr(rope_module, "TWO_PROGRAMS_PER_TOKEN", two_programs)
    rot = RotaryEmbedding(128, 4096, RopeConfig(theta=1e6)).cuda()
    qkv = torch.randn(31, (16 + 2 * 8) * 128, device="cuda", dtype=dtype) * 4
    q, k, v = (t.view(31, -1, 128) for t in qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1))
    qw = torch.rand(128, device="cuda", dtype=dtype) + 0.5
    kw = torch.rand(128, device="cuda", dtype=dtype) + 0.5
    pos = torch.randint(0, 4096, (31,), device="cuda")
    loc = torch.randperm(64, device="cuda")[:31]
    caches = [torch.zeros((64, 8, 128), device="cuda", dtype=dtype) for _ in range(6)]
    fused = rope_and_store(pos, q, k, v, rot.cos, rot.sin, caches[0], caches[1], loc, (qw, kw, 1e-6))
    ref = rope_and_store_ref(pos, q, k, v, rot.cos, rot.sin, caches[2], caches[3], loc, (qw, kw, 1e-6))
    apart = rope_and_store(pos, rmsnorm(q, qw, 1e-6)[0], rmsnorm(k, kw, 1e-6)[0], v, rot.cos, rot.sin,
                           caches[4], caches[5], loc)
    unnormed = rope_and_store_ref(pos, q, k, v, rot.cos, rot.sin, caches[4].clone(), caches[5].clone(), loc)
    for got, want in ((fused, ref), (caches[0], caches[2]), (fused, apart), (caches[0], caches[4])):
        _close(got, want, dtype)
    assert torch.equal(caches[1], caches[3])
    assert not torch.allclose(fused, unnormed, atol=1e-1)  # the norm did something


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    from rollout_engine.kernels.activation import silu_and_mul, silu_and_mul_ref

    x = torch.randn(33, 2 * 3000, device="cuda", dtype=dtype)
    _close(silu_and_mul(x), silu_and_mul_ref(x), dtype)


def test_argmax_logsumexp_matches_reference():
    from rollout_engine.kernels.greedy import argmax_logsumexp, argmax_logsumexp_ref

    x = torch.randn(7, 151936, device="cuda") * 4
    x[1, 5000] = x[1, 70000] = x[1].max() + 1  # a tie: the first index wins, as torch.argmax
    x[2, :100000] = float("-inf")  # whole partial chunks masked out
    x[3, 151935] = 100.0  # the very last column
    tok, mx, lse = argmax_logsumexp(x)
    rtok, rmx, rlse = argmax_logsumexp_ref(x)
    assert torch.equal(tok, rtok) and tok[1] == 5000 and tok[3] == 151935
    assert torch.equal(mx, rmx)
    torch.testing.assert_close(lse, rlse, atol=1e-4, rtol=1e-5)
    small = torch.randn(3, 50, device="cuda")  # fewer columns than splits
    assert torch.equal(argmax_logsumexp(small)[0], small.argmax(-1))


@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4096, 14336, False), (1000, 1000, True), (28672, 4096, True),
                                     (3584, 3584, False), (3584, 18944, False), (1000, 2500, True)])
def test_gemv_matches_linear(n, k, bias):
    import torch.nn.functional as F

    from rollout_engine.kernels.gemv import gemv, linear

    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(gemv(x, w, b).float(), ref, atol=3e-2, rtol=2e-2)
    two = torch.randn(2, k, device="cuda", dtype=torch.bfloat16)  # a small batch: kernels/batch_gemm.py
    torch.testing.assert_close(linear(two, w, b).float(), F.linear(two.float(), w.float(), None if b is None
                                                                    else b.float()), atol=3e-2, rtol=2e-2)
    many = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)  # more rows: the library path
    torch.testing.assert_close(linear(many, w, b), F.linear(many, w, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4608, 3584, True), (28672, 4096, False), (1000, 1000, True),
                                     (3584, 3584, False), (1000, 2500, True)])
def test_norm_gemv_is_the_norm_then_the_product(dtype, n, k, bias):
    """RMSNorm (with or without the residual add) computed inside the one-row
    product: the residual stream is the norm kernel's bit for bit, the
    product matches the norm kernel followed by the product."""
    import torch.nn.functional as F

    from rollout_engine.kernels.gemv import gemv, norm_gemv
    from rollout_engine.kernels.rmsnorm import rmsnorm

    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=dtype) * 3
    r = torch.randn(1, k, device="cuda", dtype=dtype)
    g = torch.rand(k, device="cuda", dtype=dtype) + 0.5
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    for residual in (None, r):
        y, new_residual = norm_gemv(x, residual, g, 1e-6, w, b)
        h, want_residual = rmsnorm(x, g, 1e-6, residual)
        if residual is None:
            assert new_residual is x
        else:
            assert torch.equal(new_residual, want_residual)
        assert y.shape == (1, n) and y.dtype == dtype
        torch.testing.assert_close(y, gemv(h, w, b), atol=2e-2, rtol=2e-2)
        ref = F.linear(h.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=2e-2)
        assert (y != gemv(x, w, b)).float().mean() > 0.9  # the norm did something


@pytest.mark.parametrize("n,k", [(28672, 4096), (37888, 3584), (6144, 1024), (2000, 1000)])
def test_gated_norm_gemv_is_the_product_then_the_activation(n, k):
    """SiLU(gate) * up computed by the one-row gate_up product itself gives
    the bits of the product followed by the activation kernel."""
    from rollout_engine.kernels.activation import silu_and_mul
    from rollout_engine.kernels.gemv import gemv, norm_gemv, pairs_fit, row_product

    torch.manual_seed(0)
    assert pairs_fit(n, k, n)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) * 3
    r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    for residual in (None, r):
        act, res = norm_gemv(x, residual, g, 1e-6, w, gated=True)
        gate_up, res_ref = norm_gemv(x, residual, g, 1e-6, w)
        assert act.shape == (1, n // 2) and torch.equal(act, silu_and_mul(gate_up)) and torch.equal(res, res_ref)
    # without the norm (the rows normalised already, by the all-reduce that took it: TPComm.all_reduce_norm)
    assert torch.equal(row_product(x, w, gated=True), silu_and_mul(gemv(x, w)))
    with pytest.raises(ValueError, match="gated"):  # an odd number of rows per half
        norm_gemv(x, None, g, 1e-6, w[: n - 2], gated=True)


@pytest.mark.parametrize("n,k", [(2048, 4096), (5120, 2048), (6144, 4096), (4096, 14336), (128, 2048), (1000, 2500)])
def test_weight_blocks_read_before_the_wait_keep_the_bits(n, k, monkeypatch):
    """`gemv.PRELOAD_BLOCKS = 4` (up to four weight blocks read before the
    dependent-launch wait) gives the bits of one block read early, with the
    norm and residual inside and without, eager and replayed in a graph."""
    from rollout_engine.kernels import gemv

    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) * 3
    r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5

    def both():
        return gemv.gemv(x, w), *gemv.norm_gemv(x, r, g, 1e-6, w)

    monkeypatch.setattr(gemv, "PRELOAD_BLOCKS", 1)
    want = both()
    monkeypatch.setattr(gemv, "PRELOAD_BLOCKS", 4)
    for got, ref in zip(both(), want):
        assert torch.equal(got, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        held = both()
    x.copy_(x.flip(-1))
    graph.replay()
    monkeypatch.setattr(gemv, "PRELOAD_BLOCKS", 1)
    for got, ref in zip(held, both()):
        assert torch.equal(got, ref)


def _rope_tables(d: int, positions: int = 1000):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(torch.arange(positions, device="cuda").float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nq,nk,d,k,bias", [(32, 8, 128, 4096, False), (28, 4, 128, 3584, True),
                                            (8, 2, 64, 256, True), (14, 2, 64, 896, True)])
def test_rope_and_kv_store_inside_the_qkv_product(dtype, nq, nk, d, k, bias):
    """The one-row qkv product with the rotary embedding and the K/V store
    inside: q, the caches and the residual stream are bit for bit those of
    the product followed by the rotary kernel; only the token's slot is written."""
    from rollout_engine.kernels.gemv import RopeStore, gemv, norm_gemv, pairs_fit, row_product
    from rollout_engine.kernels.rope import rope_and_store

    torch.manual_seed(0)
    n = (nq + 2 * nk) * d
    assert pairs_fit(n, k, d)
    x = torch.randn(1, k, device="cuda", dtype=dtype) * 3
    r = torch.randn(1, k, device="cuda", dtype=dtype)
    g = torch.rand(k, device="cuda", dtype=dtype) + 0.5
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    cos, sin = _rope_tables(d)
    pos, slot = torch.tensor([777], device="cuda"), torch.tensor([5], device="cuda")
    k_cache = torch.randn(16, nk, d, device="cuda", dtype=dtype)
    v_cache = torch.randn(16, nk, d, device="cuda", dtype=dtype)
    for residual in (None, r):
        kc, vc, kc_ref, vc_ref = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        q, res = norm_gemv(x, residual, g, 1e-6, w, b, rope=RopeStore(pos, cos, sin, kc, vc, slot, nq, nk))
        qkv, res_ref = norm_gemv(x, residual, g, 1e-6, w, b)
        qs, ks, vs = qkv.split([nq * d, nk * d, nk * d], dim=-1)
        q_ref = rope_and_store(pos, qs.view(1, nq, d), ks.view(1, nk, d), vs.view(1, nk, d), cos, sin, kc_ref,
                               vc_ref, slot)
        assert q.shape == (1, nq * d) and torch.equal(q, q_ref.view(1, -1))
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref) and torch.equal(res, res_ref)
        assert not torch.equal(kc[5], k_cache[5]) and not torch.equal(q, qs)  # written, and rotated
    # without the norm (TPComm.all_reduce_norm normalised the row): the plain product, rotated and stored
    kc, vc, kc_ref, vc_ref = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    q = row_product(x, w, b, rope=RopeStore(pos, cos, sin, kc, vc, slot, nq, nk))
    qs, ks, vs = gemv(x, w, b).split([nq * d, nk * d, nk * d], dim=-1)
    q_ref = rope_and_store(pos, qs.view(1, nq, d), ks.view(1, nk, d), vs.view(1, nk, d), cos, sin, kc_ref, vc_ref,
                           slot)
    assert torch.equal(q, q_ref.view(1, -1)) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    with pytest.raises(ValueError, match="rope"):  # heads that do not add up to the weight
        norm_gemv(x, None, g, 1e-6, w, b, rope=RopeStore(pos, cos, sin, k_cache, v_cache, slot, nq + 1, nk))


def _chain(x, weights, norm_weight, rotary):
    """Kernels that each read the one before: products, RMSNorm with the
    residual add (alone and inside a product), rotary (alone and inside a
    qkv product that stores K/V), silu_and_mul (alone and inside a product),
    and torch kernels between some of them."""
    from rollout_engine.kernels.activation import silu_and_mul
    from rollout_engine.kernels.gemv import RopeStore, gemv, norm_gemv
    from rollout_engine.kernels.rmsnorm import rmsnorm
    from rollout_engine.kernels.rope import rope

    big, square, gate_up, qkv = weights
    positions, cos, sin, k_cache, v_cache, slot = rotary
    h = gemv(x, big)[:, : x.shape[1]].contiguous()  # a long product first: the next kernel must wait for it
    h, res = rmsnorm(h, norm_weight, 1e-6, residual=x)
    h = gemv(h, square)
    h, res = norm_gemv(h, res, norm_weight, 1e-6, square)  # reads the product before it and the norm's residual
    heads = h.view(1, -1, 128)
    q, k = rope(positions, heads, heads, cos, sin)
    h = gemv((q + k).view(1, -1), square)
    h = silu_and_mul(gemv(h, gate_up))
    h = silu_and_mul(torch.cat([h, h], dim=1))
    q, res = norm_gemv(h, res, norm_weight, 1e-6, qkv, rope=RopeStore(positions, cos, sin, k_cache, v_cache, slot,
                                                                      q.shape[1], k_cache.shape[1]))
    kv = k_cache[1].view(1, -1)  # the slot the product before wrote, read by the next kernel
    h = q + gemv(kv, big[: x.shape[1], : kv.shape[1]]) + v_cache[1].view(1, -1).repeat(1, x.shape[1] // kv.shape[1])
    h, res = norm_gemv(h, res, norm_weight, 1e-6, gate_up, gated=True)
    return gemv(h, square) + res


@pytest.mark.parametrize("graph", [False, True])
def test_dependent_launch_keeps_each_kernel_after_the_one_it_reads(graph, monkeypatch):
    """With programmatic dependent launch a kernel may start while the one
    before runs: each must still read its input only once written. A chain
    of dependent kernels (eager and replayed in a CUDA graph) gives the same
    bits with it on and off."""
    from rollout_engine.kernels import _triton

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    torch.manual_seed(0)
    k = 2048
    weights = (torch.randn(64 * k, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5,
               torch.randn(k, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5,
               torch.randn(2 * k, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5,
               torch.randn(3 * k // 2, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)  # 16 + 2 x 4 heads
    norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    angles = torch.arange(8, device="cuda", dtype=torch.float32)[:, None] * torch.linspace(0, 1, 128, device="cuda")
    caches = [torch.zeros(2, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    rotary = (torch.tensor([5], device="cuda"), angles.cos(), angles.sin(), *caches,  # position 5; cos, sin tables
              torch.tensor([1], device="cuda"))  # the K/V slot
    inputs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(seed))
              for seed in range(5)]
    outs = {}
    for pdl in (False, True):
        monkeypatch.setattr(_triton, "PDL_ENABLED", pdl)
        assert _triton.use_pdl(norm_weight) == pdl
        if not graph:
            outs[pdl] = [_chain(x, weights, norm_weight, rotary) for x in inputs]
            continue
        static = torch.zeros_like(inputs[0])
        _chain(static, weights, norm_weight, rotary)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _chain(static, weights, norm_weight, rotary)
        results = []
        for x in inputs:  # a new input before every replay: a kernel reading early would see the last one's
            static.copy_(x)
            g.replay()
            results.append(out.clone())
        outs[pdl] = results
    torch.cuda.synchronize()
    for off, on in zip(outs[False], outs[True]):
        assert torch.equal(off, on)
    assert not torch.equal(outs[True][0], outs[True][1])


@pytest.mark.parametrize("rows", [1, 3, 64, 256])
def test_logits_are_the_fp32_accumulator(rows):
    """The LM head's product writes fp32 itself: no bf16 rounding on the way
    (a bf16 product widened afterwards is ~1e-2 off at these magnitudes)."""
    from rollout_engine.kernels.gemv import logits

    torch.manual_seed(0)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(50_000, 1024, device="cuda", dtype=torch.bfloat16)
    got = logits(x, w)
    ref = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, 50_000)
    assert (got.double() - ref).abs().max() < 1e-3 < (x @ w.t()).float().double().sub(ref).abs().max()


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                 (torch.float32, torch.float16)])
def test_copy_and_check_matches_reference(src_dtype, dst_dtype):
    from rollout_engine.kernels.copy_check import copy_and_check, copy_and_check_ref

    src = torch.randn(3, 100_003, device="cuda", dtype=src_dtype)
    for bad in (None, float("nan"), float("inf"), float("-inf"), 1e6):
        if bad is not None:
            src[2, 99_999] = bad  # near the end of the last block
        got, ref = torch.empty_like(src, dtype=dst_dtype), torch.empty_like(src, dtype=dst_dtype)
        flag, ref_flag = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32,
                                                                                      device="cuda")
        copy_and_check(got, src, flag)
        copy_and_check_ref(ref, src, ref_flag)
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())
        assert bool(flag) == bool(ref_flag), (bad, dst_dtype)
        # 1e6 is finite in bf16 but overflows fp16: only the stored value counts.
        assert bool(flag) == (bad is not None and not (bad == 1e6 and dst_dtype == torch.bfloat16))
        # The read-only check (an all-or-nothing update's pre-pass) agrees, and writes nothing.
        from rollout_engine.kernels.copy_check import check_finite, check_finite_ref

        before = src.clone()
        only, only_ref = torch.zeros_like(flag), torch.zeros_like(flag)
        check_finite(src, dst_dtype, only)
        check_finite_ref(src, dst_dtype, only_ref)
        assert bool(only) == bool(only_ref) == bool(flag) and torch.equal(src.nan_to_num(), before.nan_to_num())
        src[2, 99_999] = 0.0
