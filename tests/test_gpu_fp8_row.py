"""The fp8 one-row product (kernels/fp8_row.py) against the unfused kernels
it replaces at batch 1: the quantize kernel and the fp8 batch product, the
RMSNorm kernel before them, the rotary kernel or SiLU * mul after."""
from __future__ import annotations

import pytest
import torch

from rollout_engine.kernels.fp8 import FP8, quantize_channels

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _weight(n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_channels(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5)


def _row(k, seed=1, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(1, k, device="cuda", generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4096, 14336, False), (4608, 3584, True),
                                     (1024, 1024, True), (96, 128, False), (2048, 8192, False)])
def test_plain_product_equals_quantize_then_batch_product(n, k, bias, split):
    """The row quantized inside the product: the same bits as the quantize
    kernel followed by the fp8 batch product at the same launch shape, with
    and without a split of K."""
    from rollout_engine.kernels.batch_gemm import fp8_batch_gemm, new_counters, use_counters
    from rollout_engine.kernels.fp8_quantize import quantize_rows_gpu
    from rollout_engine.kernels.fp8_row import config, fp8_one_row, fp8_row

    q, s = _weight(n, k)
    x = _row(k)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    assert fp8_one_row(x, q)
    with use_counters(new_counters(x.device) if split else None):
        launch = config(n, k)
        assert split or launch.split == 1
        y, res = fp8_row(x, q, s, b)
        qx, sx = quantize_rows_gpu(x)
        want = fp8_batch_gemm(qx, sx, q, s, b, torch.bfloat16, config=launch)
    assert res is x and y.shape == (1, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, want)


def test_a_row_holding_nan_gives_nan():
    """A non-finite activation is not hidden by the quantization inside the
    product (the multiplier becomes non-finite, as the quantize kernel's)."""
    from rollout_engine.kernels.fp8_row import fp8_row

    q, s = _weight(256, 512)
    x = _row(512)
    x[0, 7] = float("nan")
    assert torch.isnan(fp8_row(x, q, s)[0]).all()


@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (4608, 3584, True), (1536, 576, True)])
def test_norm_inside_equals_the_norm_kernel_then_the_product(n, k, bias):
    """RMSNorm (with or without the residual add) inside: the residual stream
    is the norm kernel's bit for bit, the product that of the norm kernel's
    output (within one e4m3 step of a few activations: the norm's sum of
    squares may be added in another order)."""
    from rollout_engine.kernels.batch_gemm import new_counters, use_counters
    from rollout_engine.kernels.fp8 import dequantize_channels, dequantize_rows, quantize_rows
    from rollout_engine.kernels.fp8_row import fp8_row
    from rollout_engine.kernels.rmsnorm import rmsnorm

    q, s = _weight(n, k)
    x, r = _row(k), _row(k, seed=2, scale=1.0)
    gw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    with use_counters(new_counters(x.device)):
        for residual in (None, r):
            y, new_residual = fp8_row(x, q, s, b, norm=(gw, 1e-6), residual=residual)
            h, want_residual = rmsnorm(x, gw, 1e-6, residual)
            assert new_residual is x if residual is None else torch.equal(new_residual, want_residual)
            unfused = fp8_row(h, q, s, b)[0]
            torch.testing.assert_close(y, unfused, atol=2e-2, rtol=2e-2)
            qh, sh = quantize_rows(h.float())
            ref = dequantize_rows(qh, sh) @ dequantize_channels(q, s).t() + (0 if b is None else b.float())
            torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=2e-2)
            assert (y != fp8_row(x, q, s, b)[0]).float().mean() > 0.9  # the norm did something


@pytest.mark.parametrize("n,k", [(28672, 4096), (37888, 3584), (3072, 576), (2048, 1024)])
def test_gated_inside_equals_the_product_then_the_activation(n, k):
    """SiLU(gate) * up computed by the gate_up product itself: the bits of
    the product followed by the activation kernel."""
    from rollout_engine.kernels.activation import silu_and_mul
    from rollout_engine.kernels.batch_gemm import new_counters, use_counters
    from rollout_engine.kernels.fp8_row import fp8_row, pairs_fit

    assert pairs_fit(n, k, n)
    q, s = _weight(n, k)
    x, r = _row(k), _row(k, seed=2, scale=1.0)
    gw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    with use_counters(new_counters(x.device)):
        for residual in (None, r):
            act, res = fp8_row(x, q, s, norm=(gw, 1e-6), residual=residual, gated=True)
            gate_up, res_ref = fp8_row(x, q, s, norm=(gw, 1e-6), residual=residual)
            assert act.shape == (1, n // 2) and torch.equal(act, silu_and_mul(gate_up)) and torch.equal(res, res_ref)
        with pytest.raises(ValueError, match="gated"):  # halves that do not split in pairs of the tiles
            fp8_row(x, q[: n - 2], s[: n - 2], norm=(gw, 1e-6), gated=True)


def _rope_tables(d: int, positions: int = 1000):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.outer(torch.arange(positions, device="cuda").float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("nq,nk,d,k,bias", [(32, 8, 128, 4096, False), (28, 4, 128, 3584, True),
                                            (9, 3, 64, 576, False)])
def test_rope_and_kv_store_inside_the_qkv_product(nq, nk, d, k, bias, cache_dtype):
    """The qkv product with the rotary embedding and the K/V store inside
    (a bf16 or an e4m3 cache): q, the caches and the residual stream are bit
    for bit those of the product followed by the rotary kernel; only the
    token's slot is written."""
    from rollout_engine.kernels.batch_gemm import new_counters, use_counters
    from rollout_engine.kernels.fp8_row import fp8_row, pairs_fit
    from rollout_engine.kernels.gemv import RopeStore
    from rollout_engine.kernels.rope import rope_and_store

    n = (nq + 2 * nk) * d
    assert pairs_fit(n, k, d)
    q, s = _weight(n, k)
    x, r = _row(k), _row(k, seed=2, scale=1.0)
    gw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    cos, sin = _rope_tables(d)
    pos, slot = torch.tensor([777], device="cuda"), torch.tensor([5], device="cuda")
    k_cache = torch.randn(16, nk, d, device="cuda").to(cache_dtype)
    v_cache = torch.randn(16, nk, d, device="cuda").to(cache_dtype)
    with use_counters(new_counters(x.device)):
        for residual in (None, r):
            kc, vc, kc_ref, vc_ref = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
            qr, res = fp8_row(x, q, s, b, norm=(gw, 1e-6), residual=residual,
                              rope=RopeStore(pos, cos, sin, kc, vc, slot, nq, nk))
            qkv, res_ref = fp8_row(x, q, s, b, norm=(gw, 1e-6), residual=residual)
            qs, ks, vs = qkv.split([nq * d, nk * d, nk * d], dim=-1)
            q_ref = rope_and_store(pos, qs.view(1, nq, d), ks.view(1, nk, d), vs.view(1, nk, d), cos, sin, kc_ref,
                                   vc_ref, slot)
            assert qr.shape == (1, nq * d) and torch.equal(qr, q_ref.view(1, -1))
            assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
            assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8)) and torch.equal(res, res_ref)
            assert not torch.equal(kc[5].view(torch.uint8), k_cache[5].view(torch.uint8))  # written
            assert torch.equal(kc[4].view(torch.uint8), k_cache[4].view(torch.uint8))  # and only the slot
            assert not torch.equal(qr, qs)  # rotated
        with pytest.raises(ValueError, match="rope"):  # heads that do not add up to the weight
            fp8_row(x, q, s, b, norm=(gw, 1e-6), rope=RopeStore(pos, cos, sin, k_cache, v_cache, slot, nq + 1, nk))


def test_a_split_product_replays_in_a_cuda_graph():
    """The split reduction's counters are set back by each launch: a graph
    replayed many times (with new inputs) keeps giving the eager result."""
    from rollout_engine.kernels.batch_gemm import new_counters, use_counters
    from rollout_engine.kernels.fp8_row import config, fp8_row

    q, s = _weight(4096, 14336)
    x = _row(14336)
    with use_counters(new_counters(x.device)):
        assert config(4096, 14336).split > 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fp8_row(x, q, s)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, _ = fp8_row(x, q, s)
        for seed in range(5):
            x.copy_(_row(14336, seed=10 + seed))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, fp8_row(x, q, s)[0])
