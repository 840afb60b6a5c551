"""FlashInfer backend, CUDA-graph decode and the GPU kernels."""
from __future__ import annotations

import pytest
import torch

from conftest import MODEL_KINDS
from gpu_parity import GPU_SHAPES, INIT_RANGE, gap_vs_hf, gaps_vs_hf
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140)), list(range(200, 300, 3)), [7] * 33]


def test_page_indices_kernel_matches_reference():
    from rollout_engine.kernels.kv_indices import build_page_indices, build_page_indices_ref

    for page_size in (1, 16):
        table = torch.randint(0, 1 << 20, (8, 4096), device="cuda", dtype=torch.int32) * page_size
        rows = torch.tensor([5, 0, 7, 2], device="cuda", dtype=torch.int32)
        most = 4096 // page_size  # pages that fit in a table row
        pages = torch.tensor([0, 3, most, 1, most // 4 + 1], device="cuda", dtype=torch.int32)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), pages[1:].cumsum(0).int()])
        got = build_page_indices(table, rows, indptr, page_size, int(indptr[-1]))
        assert torch.equal(got, build_page_indices_ref(table, rows, indptr, page_size))
        # a captured graph's padding sequences after them: one page each, page 0, in the same launch
        total, pad = int(indptr[-1]), 3
        padded = torch.cat([indptr, total + torch.arange(1, pad + 1, device="cuda", dtype=torch.int32)])
        out = torch.full((total + pad + 5,), -1, device="cuda", dtype=torch.int32)
        got = build_page_indices(table, rows, padded, page_size, total, out=out, pad=pad)
        assert torch.equal(got[:total], build_page_indices_ref(table, rows, indptr, page_size))
        assert got[total:].tolist() == [0] * pad and out[total + pad:].tolist() == [-1] * 5


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    out = {}
    for kind, tie in MODEL_KINDS:
        hf = make_hf_model(kind, tie, initializer_range=INIT_RANGE, **GPU_SHAPES[kind])
        folder = save_model(hf, tmp_path_factory.mktemp(kind))
        out[(kind, tie)] = (hf.to("cuda", torch.bfloat16), folder)
    return out


@pytest.mark.parametrize("kind,tie", MODEL_KINDS)
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_flashinfer_bf16_parity(gpu_models, kind, tie, cuda_graph):
    hf, folder = gpu_models[(kind, tie)]
    engine = RolloutEngine(folder, device="cuda", attention_backend="flashinfer", cuda_graph=cuda_graph,
                           max_total_tokens=8192, cuda_graph_max_batch_size=16)
    assert (engine.core.parts.runner.graphs is not None) == cuda_graph
    gap, _ = gap_vs_hf(engine, hf, PROMPTS)
    single, _ = gap_vs_hf(engine, hf, PROMPTS[1:2])  # batch-1 decode: the one-row matrix-vector kernel
    assert single < 2e-2
    reference = RolloutEngine(folder, device="cuda", attention_backend="torch", max_total_tokens=8192)
    ref_gap, _ = gap_vs_hf(reference, hf, PROMPTS)
    print(f"{kind} graphs={cuda_graph}: flashinfer gap {gap:.4f}, torch backend gap {ref_gap:.4f}")
    assert gap < 2e-2
    assert gap < 2 * ref_gap + 5e-3  # no worse than the reference implementation's bf16 noise
    engine.check_integrity()


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_flashinfer_large_decode_batch_of_a_two_head_group(gpu_models, cuda_graph):
    """Two query heads per KV head take the tensor-core decode kernel from
    TENSOR_CORE_MIN_BATCH rows on (eager and in the graph buckets): parity
    with HF holds there too."""
    from rollout_engine.attention.flashinfer_backend import TENSOR_CORE_MIN_BATCH

    hf, folder = gpu_models[("qwen2", True)]
    engine = RolloutEngine(folder, device="cuda", attention_backend="flashinfer", cuda_graph=cuda_graph,
                           max_total_tokens=65536, cuda_graph_max_batch_size=256)
    backend = engine.core.parts.runner.backend
    assert not backend.tensor_cores(TENSOR_CORE_MIN_BATCH - 1) and backend.tensor_cores(TENSOR_CORE_MIN_BATCH)
    prompts = [[(t + 13 * i) % 500 + 1 for t in p] for i in range(40) for p in PROMPTS]  # 160 requests
    gap, _ = gap_vs_hf(engine, hf, prompts)
    assert gap < 2e-2
    engine.check_integrity()


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_flashinfer_large_decode_batch_with_one_very_long_sequence(tmp_path, cuda_graph):
    """From NO_SPLIT_MIN_BATCH rows on the tensor-core decode kernel runs
    without split-KV: a 6000-token sequence among 80 short ones decodes as
    Hugging Face does, in the eager wrappers and in a replayed graph."""
    hf = make_hf_model("llama", False, initializer_range=INIT_RANGE, max_position_embeddings=8192,
                       **GPU_SHAPES["llama"])
    folder = save_model(hf, tmp_path)
    engine = RolloutEngine(folder, device="cuda", attention_backend="flashinfer", cuda_graph=cuda_graph,
                           max_total_tokens=65536, cuda_graph_max_batch_size=128)
    long = [(7 * t) % 500 + 1 for t in range(6000)]
    prompts = [long] + [[(t + 13 * i) % 500 + 1 for t in p] for i in range(20) for p in PROMPTS]
    hf = hf.to("cuda", torch.bfloat16)
    gaps, outs = gaps_vs_hf(engine, hf, prompts)
    reference = RolloutEngine(folder, device="cuda", attention_backend="torch", max_total_tokens=65536)
    ref_gaps, _ = gaps_vs_hf(reference, hf, prompts[:2])
    print(f"graphs={cuda_graph}: long {gaps[0]:.4f} (torch backend {ref_gaps[0]:.4f}), short at most "
          f"{max(gaps[1:]):.4f} (torch backend {ref_gaps[1]:.4f})")
    assert len(outs[0].output_token_ids) == 48
    assert max(gaps[1:]) < 2e-2
    assert gaps[0] < 2 * ref_gaps[0] + 5e-3  # bf16 over 6000 keys: no worse than the reference's noise
    engine.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_over_cached_prefixes(gpu_models, page_size):
    hf, folder = gpu_models[("qwen3", False)]
    engine = RolloutEngine(folder, device="cuda", attention_backend="flashinfer", page_size=page_size,
                           max_total_tokens=8192)
    system = list(range(300, 380))
    engine.generate(input_ids=[system], sampling_params=SamplingParams(max_new_tokens=4))
    prompts = [system + [i, i + 1, i + 2] for i in range(1, 40, 5)]
    gap, outs = gap_vs_hf(engine, hf, prompts)
    assert gap < 2e-2
    assert all(o.num_cached_tokens >= 80 - page_size for o in outs)
    params = SamplingParams(n=4, max_new_tokens=32, temperature=1.0, seed=3)
    grouped = engine.generate(input_ids=prompts[:2], sampling_params=params)
    assert sum(o.num_cached_tokens for o in grouped) >= 0.75 * sum(len(o.prompt_token_ids) for o in grouped)
    engine.check_integrity()


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_graph_replay_equals_eager(gpu_models, backend):
    hf, folder = gpu_models[("llama", False)]
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    prompts = PROMPTS * 4  # 16: a captured bucket, no padding difference
    kw = dict(device="cuda", attention_backend=backend, max_total_tokens=8192, cuda_graph_max_batch_size=16)
    eager = RolloutEngine(folder, cuda_graph=False, **kw).generate(input_ids=prompts, sampling_params=params)
    graph = RolloutEngine(folder, cuda_graph=True, **kw).generate(input_ids=prompts, sampling_params=params)
    assert [o.output_token_ids for o in graph] == [o.output_token_ids for o in eager]
    odd = RolloutEngine(folder, cuda_graph=True, **kw).generate(input_ids=prompts[:11], sampling_params=params)
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(odd, eager[:11]))
    assert same >= 10  # padded to the 16 bucket: bf16 rounding may flip a near-tie


def test_auto_backend_picks_flashinfer_on_gpu(gpu_models):
    _, folder = gpu_models[("llama", False)]
    engine = RolloutEngine(folder, device="cuda", max_total_tokens=4096, cuda_graph_max_batch_size=8)
    assert type(engine.core.parts.runner.backend).__name__ == "FlashInferAttentionBackend"
    assert engine.core.parts.runner.graphs is not None and engine.core.parts.runner.graphs.buckets == [1, 2, 4, 8]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_attention_kernels_match_reference(dtype):
    from rollout_engine.kernels.attention import decode_attention, extend_attention, paged_attention_ref

    torch.manual_seed(0)
    hq, hk, d, slots = 8, 2, 64, 4096
    k_cache = torch.randn(slots, hk, d, device="cuda", dtype=dtype)
    v_cache = torch.randn(slots, hk, d, device="cuda", dtype=dtype)
    table = torch.randperm(slots, device="cuda").int()[: 4 * 1000].view(4, 1000)
    rows, seq_lens, extend_lens = [2, 0, 3], [1, 517, 999], [1, 200, 64]
    scale = d ** -0.5
    dev = lambda x: torch.tensor(x, device="cuda", dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(extend_lens), hq, d, device="cuda", dtype=dtype)
    qo = torch.tensor([0] + extend_lens, device="cuda").cumsum(0).int()
    got = extend_attention(q, k_cache, v_cache, table, dev(rows), dev(seq_lens), qo, max(extend_lens), scale)
    ref = paged_attention_ref(q, k_cache, v_cache, table, rows, seq_lens, extend_lens, scale)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    qd = torch.randn(3, hq, d, device="cuda", dtype=dtype)
    got = decode_attention(qd, k_cache, v_cache, table, dev(rows), dev(seq_lens), scale)
    ref = paged_attention_ref(qd, k_cache, v_cache, table, rows, seq_lens, [1, 1, 1], scale)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind,tie", MODEL_KINDS)
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_triton_backend_bf16_parity(gpu_models, kind, tie, cuda_graph):
    hf, folder = gpu_models[(kind, tie)]
    engine = RolloutEngine(folder, device="cuda", attention_backend="triton", max_total_tokens=8192, page_size=4,
                           cuda_graph=cuda_graph, cuda_graph_max_batch_size=16)
    assert (engine.core.parts.runner.graphs is not None) == cuda_graph
    gap, _ = gap_vs_hf(engine, hf, PROMPTS)
    assert gap < 2e-2
    system = list(range(300, 380))
    engine.generate(input_ids=[system], sampling_params=SamplingParams(max_new_tokens=4))
    gap, outs = gap_vs_hf(engine, hf, [system + [5, 6, 7], system + [9]])
    assert gap < 2e-2 and all(o.num_cached_tokens >= 76 for o in outs)
    engine.check_integrity()


def test_graphs_stay_valid_after_a_weight_update(gpu_models, tmp_path):
    _, folder_a = gpu_models[("llama", False)]
    hf_b = make_hf_model("llama", False, seed=5, initializer_range=INIT_RANGE, **GPU_SHAPES["llama"])
    folder_b = save_model(hf_b, tmp_path / "b")
    kw = dict(device="cuda", attention_backend="flashinfer", max_total_tokens=8192, cuda_graph_max_batch_size=16)
    params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    prompts = PROMPTS * 4  # 16 sequences: a captured bucket
    graphed = RolloutEngine(folder_a, cuda_graph=True, **kw)
    graphed.generate(input_ids=prompts, sampling_params=params)  # graphs used with the old weights
    graphed.update_weights(hf_b.state_dict())
    after = graphed.generate(input_ids=prompts, sampling_params=params)
    eager = RolloutEngine(folder_b, cuda_graph=False, **kw).generate(input_ids=prompts, sampling_params=params)
    assert [o.output_token_ids for o in after] == [o.output_token_ids for o in eager]


def test_graph_capture_waits_for_device_wide_work_on_other_threads(gpu_models):
    """Each engine captures on its own loop thread while other engines'
    threads go on: one shut down frees memory, others synchronise. Those
    calls wait for the capture (runner/device_lock.py) instead of breaking
    it, and their own calls succeed."""
    import threading

    from rollout_engine.runner.device_lock import DEVICE_WIDE

    _, folder = gpu_models[("qwen3", False)]
    kw = dict(device="cuda", max_total_tokens=8192, cuda_graph_max_batch_size=16)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    done, errors = threading.Event(), []

    def hammer() -> None:  # device-wide work, as the engine's own threads do it
        while not done.is_set():
            try:
                with DEVICE_WIDE:
                    torch.cuda.synchronize()
                    torch.empty(1 << 20, device="cuda")
                    torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    old = RolloutEngine(folder, cuda_graph=True, **kw)
    expected = old.generate(input_ids=PROMPTS, sampling_params=params)
    others = [threading.Thread(target=hammer, daemon=True), threading.Thread(target=old.shutdown, daemon=True)]
    for t in others:
        t.start()
    try:
        engines = [RolloutEngine(folder, cuda_graph=True, **kw) for _ in range(2)]
    finally:
        done.set()
        for t in others:
            t.join(60)
    assert not errors, errors
    for engine in engines:
        got = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
        engine.shutdown()


def test_a_dropped_engine_collected_during_the_next_capture_does_not_break_it(gpu_models):
    """An engine dropped without shutdown() lives on in reference cycles until
    Python's collector runs, on whatever thread allocates next: here the next
    engine's loop thread, in the middle of its capture (thresholds of 1 make
    it run at nearly every allocation). Its graphs must not be destroyed
    while that capture is under way."""
    import gc

    _, folder = gpu_models[("qwen3", False)]
    kw = dict(device="cuda", max_total_tokens=8192, cuda_graph_max_batch_size=16)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    dropped = RolloutEngine(folder, cuda_graph=True, **kw)
    expected = dropped.generate(input_ids=PROMPTS, sampling_params=params)
    dropped.cycle = dropped  # only the collector frees it
    del dropped
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        engine = RolloutEngine(folder, cuda_graph=True, **kw)
    finally:
        gc.set_threshold(*thresholds)
    got = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
    engine.shutdown()


def test_an_engine_dropped_without_shutdown_leaves_its_memory_to_the_next(gpu_models):
    """The KV cache is sized from the GPU's free memory. A dropped engine's
    memory, once collected, sits in this process's allocator cache, which
    the driver counts as taken: the next engine gives it back first, so it
    gets the same room (it found room for no KV tokens before)."""
    _, folder = gpu_models[("qwen3", False)]
    kw = dict(device="cuda", cuda_graph=False)  # the default mem_fraction: most of the GPU
    first = RolloutEngine(folder, **kw)
    capacity = first.limits.kv_capacity
    first.cycle = first  # only the collector frees it: the next build collects it and waits for its loop
    del first
    second = RolloutEngine(folder, **kw)
    try:
        assert second.limits.kv_capacity >= 0.95 * capacity, (second.limits.kv_capacity, capacity)
    finally:
        second.shutdown()


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_tails_sample_as_the_sampler_over_a_run(gpu_models, monkeypatch, page_size):
    """Decode steps whose rows sample plainly take the LM head and sampling
    inside the graphs (a tail per bucket): over a run whose batch shrinks
    through the buckets, with greedy, tempered, raw and processed rows, each
    tail gives the sampler's bits on the same hidden states, and the engine
    returns those tokens and logprobs; steps with a filter or top logprobs
    sample after the replay as before."""
    from rollout_engine.runner.cuda_graph import CudaGraphRunner
    from rollout_engine.runner.sampler import SamplingBatch, sample

    _, folder = gpu_models[("qwen3", False)]
    drawn = {}  # (seed, position) -> (token, logprob) of each row a tail sampled
    tails = []
    replay_sampled = CudaGraphRunner.replay_sampled

    def checked(self, plan, input_ids=None):
        out, bucket = replay_sampled(self, plan, input_ids)
        bs = plan.batch_size
        logits = self.model.compute_logits(self.outputs[bucket])[:bs]  # the tail's product shape
        ref = sample(logits, SamplingBatch.build(plan.sampling, self.device))
        assert torch.equal(out.tokens[:bs], ref.tokens) and torch.equal(out.logprobs[:bs], ref.logprobs)
        for seed, pos, tok, lp in zip(plan.sampling.seeds, plan.sampling.positions, out.tokens[:bs].tolist(),
                                      out.logprobs[:bs].double().tolist()):
            drawn[(int(seed), int(pos))] = (tok, lp)
        tails.append(bs)
        return out, bucket

    monkeypatch.setattr(CudaGraphRunner, "replay_sampled", checked)
    engine = RolloutEngine(folder, device="cuda", attention_backend="flashinfer", max_total_tokens=8192,
                           cuda_graph_max_batch_size=16, page_size=page_size)
    prompts = [PROMPTS[i % 4] + [i] for i in range(13)]
    params = [SamplingParams(max_new_tokens=6 + 5 * i, temperature=[0.0, 0.7, 1.0][i % 3], seed=100 + i,
                             logprob_mode=["processed", "raw"][i % 2], ignore_eos=True) for i in range(13)]
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert {b for b in tails} >= {13, 8, 4, 1}  # the batch went down through the buckets
    for i, (p, o) in enumerate(zip(prompts, outs)):
        returned = list(zip(o.output_token_ids, o.output_logprobs))
        # The j-th output sampled at position len(p) + j (the plan's count of the sequence, with the
        # token being drawn); only the prefill's token, and one drawn past the end, are not both there.
        pairs = [(drawn.get((100 + i, len(p) + j)), r) for j, r in enumerate(returned)]
        assert sum(d is not None for d, _ in pairs) >= len(returned) - 1, (i, sorted(k for k in drawn if k[0] == 100 + i))
        assert all(d == r for d, r in pairs if d is not None)
    tails.clear()
    filtered = [SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True),
                SamplingParams(max_new_tokens=8, temperature=0.0, top_logprobs=2, ignore_eos=True)]
    for sp in filtered:
        out = engine.generate(input_ids=prompts[:3], sampling_params=sp)
        assert all(len(o.output_token_ids) == 8 for o in out)
    assert not tails
    engine.check_integrity()
