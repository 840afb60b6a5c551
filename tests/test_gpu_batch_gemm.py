"""The small-batch matrix product (kernels/batch_gemm.py) against an fp32
reference, its split reduction replayed in CUDA graphs, and an engine whose
batched decode steps run it, against Hugging Face."""
from __future__ import annotations

import pytest
import torch

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu


def _ref(x, w, b):
    y = x.float() @ w.float().t()
    return y if b is None else y + b.float()


@pytest.mark.parametrize("m,n,k,bias", [(2, 1024, 2048, False), (8, 4096, 1024, True), (17, 1000, 3000, True),
                                        (32, 4608, 3584, True), (24, 128, 14336, False), (5, 6144, 1024, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_gemm_matches_the_fp32_product(m, n, k, bias, dtype):
    from rollout_engine.kernels.batch_gemm import batch_gemm, new_counters, pick, use_counters

    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    ref = _ref(x, w, b)
    counters = new_counters(torch.device("cuda"))
    with use_counters(counters):
        configs = [None, pick(m, n, k, True)._replace(split=8), pick(m, n, k, True)._replace(split=1, swap=False,
                                                                                               block_m=64)]
        for config in configs:
            y = batch_gemm(x, w, b, config)
            assert y.dtype == dtype and y.shape == (m, n)
            torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    assert not counters.any()  # every split launch set its tiles' counters back


def test_split_products_in_a_graph_give_the_same_bits_every_replay():
    from rollout_engine.kernels.batch_gemm import batch_gemm, new_counters, pick, use_counters

    torch.manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
          for n, k in ((3072, 1024), (1024, 3072), (2048, 1024), (1024, 2048))]
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    counters = new_counters(torch.device("cuda"))
    assert pick(16, 1024, 3072, True).split > 1 and pick(16, 1024, 2048, True).split > 1

    def chain():
        y = batch_gemm(x, ws[0])
        y = batch_gemm(y, ws[1])  # split: reads the product just before it
        y = batch_gemm(y, ws[2])
        return batch_gemm(y, ws[3])  # split

    with use_counters(counters):
        eager = chain()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert not counters.any()


def test_without_counters_a_product_is_not_split():
    from rollout_engine.kernels.batch_gemm import batch_gemm, pick

    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    assert pick(8, 1024, 2048, False).split == 1
    torch.testing.assert_close(batch_gemm(x, w).float(), _ref(x, w, None), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="counters"):
        batch_gemm(x, w, config=pick(8, 1024, 2048, True))


def _sampled_logprob_gap(folder, hf) -> float:
    """Eight samples of one prompt, decoded as a batch of 8 in a CUDA graph:
    the mean difference between the logprob each sampled token is reported
    with and Hugging Face's (fp32) for it, given the same sequence."""
    engine = RolloutEngine(folder, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                           max_total_tokens=8192)
    prompt = list(range(100, 140))
    outs = engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        n=8, max_new_tokens=48, temperature=1.0, seed=3, logprobs=True))
    engine.shutdown()
    assert len({tuple(o.output_token_ids) for o in outs}) > 1  # the samples differ: a real batch
    gaps = []
    for out in outs:
        seq = prompt + out.output_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([seq], device="cuda")).logits[0].float(), -1)
        ref = ref[len(prompt) - 1:-1].gather(-1, torch.tensor(out.output_token_ids, device="cuda")[:, None])
        gaps.append((torch.tensor(out.output_logprobs) - ref.squeeze(1).cpu()).abs().mean().item())
    return sum(gaps) / len(gaps)


def test_batched_decode_runs_the_small_batch_product_as_closely_as_cublas(tmp_path, monkeypatch):
    """The engine's batch-8 decode graphs run batch_gemm, and the logprobs
    its samples report are as close to Hugging Face's (fp32) as with cuBLAS's
    products instead (a wrong row or a lost partial sum would be far off)."""
    from rollout_engine.kernels import batch_gemm as bg, gemv

    monkeypatch.setattr(bg, "GATED_IN_PRODUCT", True)
    calls, gated = [], []
    real, real_gated = gemv.batch_gemm, gemv.gated_batch_gemm
    monkeypatch.setattr(gemv, "batch_gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(gemv, "gated_batch_gemm",
                        lambda *a, **kw: gated.append(a[0].shape[0]) or real_gated(*a, **kw))
    # head_dim 64: FlashInfer's kernels, so decode steps replay CUDA graphs
    hf = make_hf_model("qwen2", tie=False, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2)
    folder = save_model(hf, tmp_path)
    hf = hf.to("cuda")
    ours = _sampled_logprob_gap(folder, hf)
    assert 8 in calls and 8 in gated  # captured at the batch-8 bucket, gate_up with SiLU * mul in its launch
    calls.clear()
    gated.clear()
    monkeypatch.setattr(gemv, "small_batch", lambda x, w: False)
    cublas = _sampled_logprob_gap(folder, hf)
    assert not calls and not gated
    print(f"mean |logprob - HF fp32|: batch_gemm {ours:.4f}, cuBLAS {cublas:.4f}")
    assert ours < 1.5 * cublas + 1e-2


@pytest.mark.parametrize("m,n,k,bias", [(2, 1024, 2048, False), (17, 1000, 3000, True), (128, 1024, 2048, True),
                                        (200, 1024, 3072, False), (256, 4096, 1024, True)])
def test_copy_engine_tiles_match_the_fp32_product_and_the_pointer_loads(m, n, k, bias):
    from rollout_engine.kernels.batch_gemm import GemmConfig, batch_gemm, new_counters, use_counters

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    ref = _ref(x, w, b)
    counters = new_counters(torch.device("cuda"))
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    with use_counters(counters):
        for config in (GemmConfig(bm, 32, 128, 4, 4, 4, swap=True), GemmConfig(64, 64, 64, 2, 4, 4),
                       GemmConfig(64, 128, 64, 1, 8, 3)):
            pointer = batch_gemm(x, w, b, config)
            tiles = batch_gemm(x, w, b, config._replace(tma=True))
            torch.testing.assert_close(tiles.float(), ref, atol=2e-2, rtol=2e-2)
            # same sums in the same order: the copy engine moves the same tiles
            assert torch.equal(tiles, pointer), config
    assert not counters.any()


def test_wide_products_listed_by_a_sweep_take_the_kernel_and_others_cublas(monkeypatch):
    import torch.nn.functional as F

    from rollout_engine.kernels import batch_gemm as bg
    from rollout_engine.kernels.gemv import linear

    x = torch.randn(160, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 2048 ** -0.5
    cfg = (64, 32, 64, 2, 4, 4, False, True)
    monkeypatch.setattr(bg, "WIDE", {(1024, 2048): cfg})
    monkeypatch.setattr(bg, "WIDE_ROWS", (128, 256))
    with bg.use_counters(bg.new_counters(torch.device("cuda"))):
        got = linear(x, w)
        assert torch.equal(got, bg.batch_gemm(x, w, None, bg.GemmConfig(*cfg)))
        torch.testing.assert_close(got.float(), _ref(x, w, None), atol=2e-2, rtol=2e-2)
        assert torch.equal(linear(x[:100], w), F.linear(x[:100], w))  # below WIDE_ROWS: cuBLAS
    # without counters the split shape is not taken
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("m,i,k", [(2, 3072, 1024), (8, 14336, 4096), (17, 1000, 3000), (32, 18944, 3584),
                                   (128, 14336, 4096), (128, 500, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_product_has_the_bits_of_the_product_then_the_activation(m, i, k, dtype):
    """SiLU(gate) * up in the product's launch: the unfused path's bits (the
    product, then kernels.activation's launch) at the same launch shape, the
    default one included (the whole product's), split, swapped or not, with
    the copy engine's tiles, and in a CUDA graph's replays."""
    from rollout_engine.kernels._triton import next_pow2
    from rollout_engine.kernels.activation import silu_and_mul
    from rollout_engine.kernels.batch_gemm import GemmConfig, batch_gemm, gated_batch_gemm, new_counters, \
        use_counters

    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(2 * i, k, device="cuda", dtype=dtype) * k ** -0.5
    ref = _ref(x, w, None)
    ref = torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]
    counters = new_counters(torch.device("cuda"))
    bm = max(16, next_pow2(m))
    configs = [GemmConfig(bm, 64, 128, 4, 4, 3, swap=True), GemmConfig(bm, 32, 128, 1, 4, 4, swap=True, tma=True),
               GemmConfig(bm, 64, 128, 2, 4, 3, False, True), GemmConfig(bm, 64, 64, 1, 8, 3)]
    with use_counters(counters):
        if m <= 32:
            got = gated_batch_gemm(x, w)  # pick's shape for [m, 2i]
            assert torch.equal(got, silu_and_mul(batch_gemm(x, w)))
        for config in configs:
            got = gated_batch_gemm(x, w, config)
            assert torch.equal(got, silu_and_mul(batch_gemm(x, w, None, config))), config
            torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gated_batch_gemm(x, w, configs[0])
        first = None
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            first = out.clone() if first is None else first
            assert torch.equal(out, first)
        assert torch.equal(first, gated_batch_gemm(x, w, configs[0]))
    assert not counters.any()


def test_gated_linear_takes_the_gated_launch_at_small_batches_and_listed_shapes(monkeypatch):
    from rollout_engine.kernels import batch_gemm as bg
    from rollout_engine.kernels.activation import silu_and_mul
    from rollout_engine.kernels.gemv import gated_linear, linear

    monkeypatch.setattr(bg, "GATED_IN_PRODUCT", True)
    w = torch.randn(2 * 1408, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    monkeypatch.setattr(bg, "GATED_WIDE", {(2816, 2048): (128, 64, 128, 2, 4, 3, False, True)})
    with bg.use_counters(bg.new_counters(torch.device("cuda"))):
        for m in (1, 2, 7, 32, 33, 127, 128, 129):
            x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            got = gated_linear(x, w)
            if m == 1 or 32 < m != 128:  # one row: the one-row kernel's own gated path; else cuBLAS, then SiLU
                assert got is None, m
                continue
            unfused = silu_and_mul(bg.batch_gemm(x, w, None, bg.GemmConfig(128, 64, 128, 2, 4, 3, False, True))
                                   if m == 128 else linear(x, w))
            assert torch.equal(got, unfused), m
    monkeypatch.setattr(bg, "GATED_IN_PRODUCT", False)
    assert gated_linear(torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16), w) is None
