"""fp8 MoE experts on the GPU (e4m3 weights, one multiplier a row, the
activations in bf16): the fused MoE against the torch reference over batch
sizes 1-2,048 and expert loads from empty to one hot expert; one token with
the blocks path's bits; the three-launch sparse MLP; replays in CUDA graphs;
and an fp8 MoE engine against the fp32 oracle of what it holds, over a
sequence of calls."""
from __future__ import annotations

import pytest
import torch

from moe_problems import fp8_experts, held, problem, rel, row_problem, row_unfused
from rollout_engine.kernels import moe, moe_route, moe_row

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [(16, 64), (768, 2048), (24, 64), (384, 2048)]  # (I, H): toy, Qwen3-30B-A3B, off the tiles, a TP slice


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("load", ["uniform", "sparse", "hot"])
@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 255, 2048])
def test_fp8_fused_moe_matches_the_reference(tokens, load):
    """Every launch shape `pick` gives: within bf16 rounding of the fp32
    products of the held weights, as near as the bf16 reference on them."""
    for inter, hidden in SHAPES:
        x, w13, w2, weights, ids = problem(tokens, 64, 8, hidden, inter, torch.bfloat16, "cuda", load, seed=tokens)
        (q13, s13), (q2, s2) = fp8_experts(w13, w2)
        ref32 = moe.fused_moe_ref(x.float(), held(q13, s13), held(q2, s2), weights, ids)
        ref = moe.fused_moe_ref(x, q13, q2, weights, ids, scales=(s13, s2))
        out = moe.fused_moe(x, q13, q2, weights, ids, scales=(s13, s2))
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        err, ref_err = rel(out, ref32), rel(ref, ref32)
        assert err < 1e-2 and err < 2 * ref_err + 1e-3, (inter, hidden, err, ref_err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("experts,top_k,inter,hidden", [(128, 8, 768, 2048), (8, 2, 1792, 4096), (16, 4, 40, 200)])
def test_fp8_one_token_has_the_blocks_paths_bits(experts, top_k, inter, hidden, early, monkeypatch):
    """One token (no align, the slot sum in the down launch): the blocks
    path's bits. With its first weight block read before the wait
    (EARLY_DOWN, off by default) that block's e4m3 tile is converted out of
    the loop, where the compiler may take another tensor-core instruction
    (another order of the fp32 sums inside it): seen 9e-5 relative on an
    H100 at 768 x 2048, one bf16 step in a few elements; held to 1e-3."""
    monkeypatch.setattr(moe, "EARLY_DOWN", early)
    for seed in range(2):
        x, w13, w2, weights, ids = problem(1, experts, top_k, hidden, inter, torch.bfloat16, "cuda", seed=seed)
        (q13, s13), (q2, s2) = fp8_experts(w13, w2)
        blocks = moe._fused_moe_triton(x, q13, q2, weights, ids, moe.DECODE, (s13, s2))
        out = moe.fused_moe(x, q13, q2, weights, ids, scales=(s13, s2))
        if early:
            assert rel(out, blocks) < 1e-3, (seed, rel(out, blocks))
        else:
            assert torch.equal(out, blocks), (seed, rel(out, blocks))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("experts,top_k,inter,hidden", [(128, 8, 768, 2048), (16, 4, 40, 200)])
def test_fp8_moe_row_matches_the_unfused_launches_and_replays(experts, top_k, inter, hidden):
    """The three-launch sparse MLP of one token with e4m3 experts: within
    bf16 rounding of the unfused launches; in a CUDA graph, every replay
    with a new token gives the eager result."""
    from rollout_engine.kernels.gemv import norm_gemv
    from rollout_engine.kernels.rmsnorm import rmsnorm

    x, residual, norm_w, router, w13, w2 = row_problem(experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    (q13, s13), (q2, s2) = fp8_experts(w13, w2)
    logits, r = norm_gemv(x, residual, norm_w, 1e-6, router)
    weights, ids = moe_route.route(logits, top_k, True)
    h, _ = rmsnorm(x, norm_w, 1e-6, residual)
    unfused = moe.fused_moe(h, q13, q2, weights, ids, scales=(s13, s2))
    out, r_row = moe_row.moe_row(x, residual, norm_w, 1e-6, router, q13, q2, top_k, True, scales=(s13, s2))
    assert torch.equal(r_row, r)
    ref32 = row_unfused(x.float(), residual.float(), norm_w.float(), router.float(), held(q13, s13),
                         held(q2, s2), top_k, True)[0]
    assert rel(out, unfused) < 2e-3 and rel(out, ref32) < 1e-2, (rel(out, unfused), rel(out, ref32))

    def step():
        return moe_row.moe_row(x, residual, norm_w, 1e-6, router, q13, q2, top_k, True, scales=(s13, s2))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        held = step()
    g = torch.Generator(device="cpu").manual_seed(4)
    for _ in range(10):
        x.copy_(torch.randn(x.shape, generator=g).to(x))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        assert torch.equal(held[0], want[0]) and torch.equal(held[1], want[1])


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """The MoE suite's peaked Qwen3-MoE (tests/test_gpu_moe.py), saved, and
    the fp32 oracle of what an fp8 engine holds (tests/differential.py)."""
    from differential import Reference, fp8_oracle
    from models import save_model
    from test_gpu_moe import _peaked

    hf = _peaked("qwen3_moe")
    return save_model(hf, tmp_path_factory.mktemp("fp8-moe")), Reference(fp8_oracle(hf), "cuda")


# fp32 engine, fp8 weights: the oracle computes the same arithmetic, so what is left is the fp32 order of
# sums, which can move a per-token activation quantization by one e4m3 step (up to 0.072 nats on the CPU's
# tiny models); another request's KV puts whole requests 10+ nats off.
FP32_MARGIN, FP32_TOL, FP32_MEAN = 0.5, 0.5, 0.1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,backend", [("float32", "torch"), ("bfloat16", "flashinfer")])
def test_fp8_moe_differential_stress(fp8_moe, dtype, backend):
    """A long-lived Qwen3-MoE engine with quantization="fp8" (experts and
    linear layers in e4m3; graphs, overlap, the prefix cache, retraction,
    aborts) against the fp8 oracle over random calls: in fp32 to the
    quantization's own flips, in bf16 to the MoE suite's bounds (a router
    near-tie rounded the other way; test_gpu_moe.py)."""
    from differential import WorkloadGenerator, stress
    from rollout_engine import RolloutEngine
    from rollout_engine.kernels.fp8 import FP8
    from test_gpu_moe import MOE_LOGPROB_TOL, MOE_MARGIN, MOE_MEAN_TOL, _check

    folder, reference = fp8_moe
    engine = RolloutEngine(folder, device="cuda", dtype=dtype, attention_backend=backend, page_size=16,
                           max_total_tokens=1280, max_prefill_tokens=256, cuda_graph_max_batch_size=32,
                           max_running_requests=96, quantization="fp8")
    params = dict(engine.core.parts.model.named_parameters())
    assert params["model.layers.0.mlp.experts.gate_up_proj"].dtype == FP8
    gen = WorkloadGenerator(seed=7, token_range=(0, 4096), max_prompt_len=96, max_new_tokens=48, max_batch=40)
    bounds = (FP32_MARGIN, FP32_TOL, FP32_MEAN) if dtype == "float32" else (MOE_MARGIN, MOE_LOGPROB_TOL, MOE_MEAN_TOL)
    report = stress(engine, reference, gen, 30, *bounds)
    _check(engine, report, f"fp8 {dtype} {backend}", retractions=False)


@pytest.mark.gpu
@needs_cuda
def test_an_fp8_moe_update_equals_a_fresh_engine(fp8_moe, tmp_path):
    """Fused expert tensors on the device quantized into the engine's e4m3
    experts: the checksums of a fresh fp8 engine on the new weights, and the
    trainer's side (fidelity.weights_checksum with quantization="fp8")."""
    from models import save_model
    from rollout_engine import RolloutEngine
    from rollout_engine.fidelity import weights_checksum
    from test_gpu_moe import _peaked

    folder, _ = fp8_moe
    new = _peaked("qwen3_moe", seed=9)
    fresh = RolloutEngine(save_model(new, tmp_path / "n"), device="cuda", dtype="bfloat16", quantization="fp8")
    want = fresh.weights_checksum()
    fresh.shutdown()
    engine = RolloutEngine(folder, device="cuda", dtype="bfloat16", quantization="fp8")
    state = {n: t.cuda() for n, t in new.state_dict().items()}
    engine.update_weights(state)
    assert engine.weights_checksum() == want
    theirs = weights_checksum(state, torch.bfloat16, quantization="fp8")
    assert want == {n: theirs[n] for n in want}
    engine.shutdown()
