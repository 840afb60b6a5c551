"""The one-row (batch-1 decode) path on the GPU: each RMSNorm inside the
product after it, the rotary embedding and K/V store inside the qkv product,
SiLU * mul inside the gate_up product, at one GPU and two; its kernels
compiled before the first batch-1 step."""
from __future__ import annotations

import pytest
import torch

from gpu_parity import GPU_SHAPES, INIT_RANGE, gap_vs_hf
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140))]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    hf = make_hf_model("llama", False, initializer_range=INIT_RANGE, **GPU_SHAPES["llama"])
    return save_model(hf, tmp_path_factory.mktemp("llama"))


def _qwen2_with_random_norm_weights(tmp_path, **shape):
    """A qwen2 model whose norm weights differ per layer and per norm (the
    test models' are all ones), saved; returned on the GPU in bf16."""
    hf = make_hf_model("qwen2", True, initializer_range=INIT_RANGE, **shape)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    folder = save_model(hf, tmp_path)
    return hf.to("cuda", torch.bfloat16), folder


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_batch_1_decode_with_random_norm_weights_matches_hf(tmp_path, cuda_graph):
    """At one row each RMSNorm is computed inside the product after it (and
    the rotary embedding inside the qkv product, SiLU * mul inside the
    gate_up product): with norm weights that differ per layer and per norm (the test
    models' are all ones), a batch-1 decode still matches Hugging Face."""
    hf, folder = _qwen2_with_random_norm_weights(tmp_path, **GPU_SHAPES["qwen2"])
    engine = RolloutEngine(folder, device="cuda", attention_backend="flashinfer", cuda_graph=cuda_graph,
                           max_total_tokens=4096, cuda_graph_max_batch_size=8)
    layer = engine.core.parts.runner.model.model.layers[0]
    assert layer.norms_in_products(torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16), None)
    # no q/k norms: the rotary embedding and K/V store go inside the qkv product too
    assert layer.self_attn.rope_in_product and layer.mlp.gated_in_product
    gap, _ = gap_vs_hf(engine, hf, PROMPTS[1:2])
    engine.shutdown()
    reference = RolloutEngine(folder, device="cuda", attention_backend="torch", max_total_tokens=4096)
    ref_gap, _ = gap_vs_hf(reference, hf, PROMPTS[1:2])
    reference.shutdown()
    assert gap < 2 * ref_gap + 5e-3  # a norm weight used in the wrong place would be off by far more


@pytest.mark.multigpu
@pytest.mark.parametrize("allreduce", ["one-shot", "fused"])
def test_tp2_batch_1_decode_with_random_norm_weights_matches_hf(tmp_path, monkeypatch, allreduce):
    """At one row each rank runs the fused one-row products on its shard (the
    norm, rotary + K/V store and SiLU * mul inside; with
    ROLLOUT_ENGINE_ALLREDUCE=fused the norm inside the all-reduce before
    them instead): a batch-1 decode on two GPUs stays as close to Hugging
    Face as on one."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("ROLLOUT_ENGINE_ALLREDUCE", allreduce)
    hf, folder = _qwen2_with_random_norm_weights(tmp_path, hidden_size=512, intermediate_size=1024,
                                                 num_attention_heads=8, num_key_value_heads=2)
    gaps = {}
    for tp in (1, 2):
        engine = RolloutEngine(folder, device="cuda", attention_backend="flashinfer", tp_size=tp,
                               max_total_tokens=4096, cuda_graph_max_batch_size=8)
        gaps[tp], _ = gap_vs_hf(engine, hf, PROMPTS[1:2])
        engine.check_integrity()
        engine.shutdown()
    assert gaps[2] < 2 * gaps[1] + 5e-3


def _compiled_one_row_variants(clear: bool = False) -> tuple[int, int]:
    """Triton's compiled variants (per device) of the bf16 gemv and of the fp8 one-row kernel."""
    from rollout_engine.kernels.fp8_row import fp8_row_kernel
    from rollout_engine.kernels.gemv import gemv_kernel

    counts = []
    for kernel in (gemv_kernel, fp8_row_kernel):
        caches = [cache[0] for cache in kernel.device_caches.values()]
        if clear:  # forget what earlier tests compiled in this process
            for cache in caches:
                cache.clear()
        counts.append(sum(len(cache) for cache in caches))
    return counts[0], counts[1]


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_one_row_kernels_compiled_before_the_first_batch_1_step(llama_folder, cuda_graph, quantization):
    """A single request decoding (the end of every rollout) must not wait on
    Triton mid-run: the engine compiles the one-row products (fp8: with the
    norm, rotary embedding and activation inside), the LM head's fp32 one
    included, when it is built."""
    folder = llama_folder
    _compiled_one_row_variants(clear=True)
    engine = RolloutEngine(folder, device="cuda", max_total_tokens=4096, cuda_graph=cuda_graph,
                           cuda_graph_max_batch_size=8, dtype="bfloat16", quantization=quantization)
    before = _compiled_one_row_variants()
    out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].output_token_ids) == 4
    assert _compiled_one_row_variants() == before
    assert before[0] > 0 and (before[1] >= 3 if quantization else before[1] == 0)
    engine.shutdown()
