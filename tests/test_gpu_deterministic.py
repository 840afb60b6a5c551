"""Deterministic (batch-invariant) mode on the GPU, bf16, CUDA graphs on: a
seeded sampled request gives bitwise the same tokens and logprobs alone,
among 255 others, with chunked prefill, with part of its prompt from the
prefix cache and after retraction; fidelity.score equals the engine's
logprobs bitwise. The kernels underneath are checked row by row first."""
from __future__ import annotations

import random

import pytest
import torch

from models import make_hf_model, save_model
from test_deterministic import _same, first_output
from rollout_engine import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu

TARGET = SamplingParams(max_new_tokens=48, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True, logprobs=True,
                        top_logprobs=3)
# Three GQA groupings (8 query heads over 1, 2 and 8 KV heads: groups of 8, 4 and 1), a bias (qwen2), and
# two MoE models.
SHAPES = {"llama": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1376),
          "qwen2": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=1, intermediate_size=1376),
          "qwen3": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                        intermediate_size=1376),
          # MoE: experts shared by many tokens of a batch, a dense layer, a shared expert (qwen2_moe)
          "qwen3_moe": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            intermediate_size=1376, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                            mlp_only_layers=[1]),
          "qwen2_moe": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1376,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                            shared_expert_intermediate_size=384, decoder_sparse_step=1)}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def folder(request, tmp_path_factory):
    hf = make_hf_model(request.param, seed=1, num_hidden_layers=3, vocab_size=1000, initializer_range=0.06,
                       max_position_embeddings=1024,
                       **SHAPES[request.param])
    return save_model(hf, tmp_path_factory.mktemp(f"gdet-{request.param}"))


def test_matmul_rows_do_not_depend_on_the_batch():
    """Every launch shape and tile configuration gives the same bits per row:
    each bucket of the engine's picks (decode tiles up to 256 rows, prompt
    tiles through TMA above, chunks in one loop or a loop each), split or
    tiled, narrow products and wide ones (WIDE_N)."""
    from rollout_engine.kernels.invariant_matmul import DECODE_TILES, PREFILL_TILES, ROW_PICKS, invariant_matmul

    torch.manual_seed(0)
    configs = {DECODE_TILES, PREFILL_TILES} | {t for _, narrow, wide in ROW_PICKS for t in (narrow, wide)}
    for n, k, bias in [(1376, 512, False), (512, 1376, True), (151936 // 8, 1024, False), (3072, 4096, True)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        x = torch.randn(1600, k, device="cuda", dtype=torch.bfloat16)
        full = invariant_matmul(x, w, b)  # 1,600 rows: the last bucket's prompt tiles
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(full.float(), ref, atol=3e-2, rtol=3e-2)
        for m in (1, 3, 64, 65, 128, 129, 200, 256, 257, 300, 768, 769, 1536):
            assert torch.equal(invariant_matmul(x[:m], w, b), full[:m]), (n, k, m)
        for m in (1, 65, 257, 300):
            for tiles in configs:
                for split in (True, False):
                    assert torch.equal(invariant_matmul(x[:m], w, b, split=split, tiles=tiles), full[:m]), \
                        (n, k, m, tiles, split)
        assert torch.equal(invariant_matmul(x[17:18], w, b)[0], full[17])


def test_cublas_at_fixed_rows_rows_do_not_depend_on_the_batch():
    """The products deterministic mode runs through cuBLAS (`fixed_rows`):
    the check passes at the shapes of small and 7B-sized models, and a row
    has the same bits alone, in a short batch, at a call's edge and in a
    batch of several calls."""
    from rollout_engine.layers import fixed_rows

    torch.manual_seed(0)
    rows = fixed_rows.ROWS
    for n, k, bias in [(1376, 512, False), (512, 1376, True), (151936 // 8, 1024, False), (4608, 3584, True),
                       (3584, 18944, False), (37888, 3584, False)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        assert fixed_rows.verify(w, b), (n, k, bias)
        x = torch.randn(3 * rows + 40, k, device="cuda", dtype=torch.bfloat16)
        full = fixed_rows.linear(x, w, b)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        torch.testing.assert_close(full.float(), ref, atol=3e-2, rtol=3e-2)
        for m in (1, 3, rows - 1, rows, rows + 1, 2 * rows + 5):
            assert torch.equal(fixed_rows.linear(x[:m], w, b), full[:m]), (n, k, m)
        assert torch.equal(fixed_rows.linear(x[rows + 17: rows + 18], w, b)[0], full[rows + 17])


def test_the_fixed_rows_check_captures_while_another_thread_allocates(monkeypatch):
    """The check's CUDA graph is captured thread-locally, as the engine's
    own: another thread (a trainer, a second engine starting) allocating on
    the GPU meanwhile neither fails nor fails the check."""
    import threading

    from rollout_engine.layers import fixed_rows

    monkeypatch.setattr(fixed_rows, "_CHECKED", {})  # shapes checked before would not capture again
    stop, errors = threading.Event(), []

    def allocate():
        # No random numbers here: while any thread captures a CUDA graph,
        # PyTorch refuses the default CUDA generator to every other thread
        # ("Offset increment outside graph capture"), for any capture.
        try:
            while not stop.is_set():
                torch.ones(1 << 20, device="cuda").add_(1).sum().item()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    other = threading.Thread(target=allocate)
    other.start()
    try:
        answers = [fixed_rows.verify(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5, None)
                   for n, k in [(1376, 512), (512, 1376), (2048, 1024), (1024, 2048), (768, 256), (256, 768)]]
    finally:
        stop.set()
        other.join(timeout=60)
    assert not other.is_alive() and errors == [] and all(answers), (errors, answers)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_the_engine_runs_every_product_through_cublas_at_fixed_rows(tmp_path, kind):
    """A deterministic engine checks each product shape at start and sends
    them all to cuBLAS at fixed rows (the Triton kernels are the fallback):
    an MoE model's router and dense layer too (its experts keep their fused
    batch-invariant kernel)."""
    from rollout_engine.layers import fixed_rows

    hf = make_hf_model(kind, seed=1, num_hidden_layers=2, vocab_size=1000, initializer_range=0.06,
                       max_position_embeddings=1024, **SHAPES[kind])
    engine = _engine(save_model(hf, tmp_path))
    try:
        model = engine.core.parts.model
        weights = {name: m for name, m in model.named_modules() if getattr(m, "batch_invariant", False)
                   and getattr(m, "weight", None) is not None and m.weight.dim() == 2}
        elsewhere = [n for n, m in weights.items() if not fixed_rows.takes(m.weight, getattr(m, "bias", None))]
        assert weights and elsewhere == []
        if kind == "qwen3_moe":
            assert any(name.endswith("mlp.gate") for name in weights), sorted(weights)  # the router among them
    finally:
        engine.shutdown()


def test_draw_from_weights_is_per_row_and_inverts_the_cdf():
    """The deterministic sampler's draw over a processed table: a row's token
    is the same alone and in any batch, has positive weight, and is where
    the float64 running sum passes u * total (to float32 rounding)."""
    from rollout_engine.kernels.draw import draw_from_weights

    torch.manual_seed(0)
    vocab = 151936
    logits = torch.randn(300, vocab, device="cuda") * 3
    probs = torch.softmax(logits, dim=-1)
    probs[::3] *= probs[::3] > 1e-6  # filtered rows: zeros, as top-k / top-p / min-p leave them
    probs[1, :] = 0
    probs[1, 17] = 1.0  # one token left
    uniforms = torch.rand(300, device="cuda", dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    greedy = probs.argmax(dim=-1)
    tokens = draw_from_weights(probs, uniforms, greedy)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 64), slice(100, 300)):
        assert torch.equal(draw_from_weights(probs[rows].contiguous(), uniforms[rows], greedy[rows]), tokens[rows])
    assert int(tokens[1]) == 17
    assert bool((probs.gather(-1, tokens[:, None]) > 0).all())
    cdf = probs.double().cumsum(-1)
    target = uniforms * cdf[:, -1]
    before = torch.where(tokens > 0, cdf.gather(-1, (tokens - 1).clamp(min=0)[:, None]).squeeze(1),
                         torch.zeros_like(target))
    after = cdf.gather(-1, tokens[:, None]).squeeze(1)
    slack = 1e-5 * cdf[:, -1]
    assert bool(((before <= target + slack) & (target <= after + slack)).all())


def test_row_scan_and_attention_rows_do_not_depend_on_the_batch():
    from rollout_engine.kernels.attention import invariant_attention, paged_attention_ref
    from rollout_engine.kernels.row_scan import row_cumsum

    torch.manual_seed(0)
    p = torch.rand(256, 151936, device="cuda")
    full = row_cumsum(p, torch.float64)
    assert torch.equal(row_cumsum(p[7:8], torch.float64)[0], full[7])
    torch.testing.assert_close(full, p.double().cumsum(-1))
    hq, hk, d, slots = 28, 4, 128, 8192  # groups of 7: padded to 8 rows
    kc = torch.randn(slots, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(slots, hk, d, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(slots, device="cuda").int()[: 4 * 2000].view(4, 2000)
    i32 = lambda x: torch.tensor(x, device="cuda", dtype=torch.int32)  # noqa: E731
    rows, lens, ext = [2, 0, 3], [1, 1500, 700], [1, 300, 64]
    q = torch.randn(sum(ext), hq, d, device="cuda", dtype=torch.bfloat16)
    qo = torch.tensor([0] + ext, device="cuda").cumsum(0).int()
    got = invariant_attention(q, kc, vc, table, i32(rows), i32(lens), qo, max(ext), d ** -0.5)
    ref = paged_attention_ref(q, kc, vc, table, rows, lens, ext, d ** -0.5)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    # The last prompt token of sequence 1, as a decode step among others.
    last = 1 + 300 - 1
    dec = invariant_attention(torch.cat([q[last: last + 1], q[:1]]), kc, vc, table, i32([0, 2]), i32([1500, 1]),
                              i32([0, 1, 2]), 1, d ** -0.5)
    assert torch.equal(dec[0], got[last])


def _prompts(count: int, seed: int = 0):
    rng = random.Random(seed)
    target = [rng.randrange(1, 1000) for _ in range(60)]
    others = [[rng.randrange(1, 1000) for _ in range(rng.randint(3, 300))] for _ in range(count)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 64), temperature=rng.choice([0, 0.7, 1.0]),
                             top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(1000),
                             ignore_eos=True) for _ in others]
    return target, others, params


def _engine(folder, **kw):
    return RolloutEngine(folder, device="cuda", dtype="bfloat16", deterministic=True, cuda_graph=True,
                         **{"max_total_tokens": 65536, "cuda_graph_max_batch_size": 256, **kw})


def _target_output(folder, batch, params, **kw):
    return first_output(_engine(folder, **kw), batch, params)


def assert_alone_crowded_chunked_cached_retracted_equal(folder, **kw):
    """The target request alone, among 255 others, chunked by 7, after a
    cached prefix and after retraction: the same bits in all (`kw`: more
    engine options for every engine). Returns its output alone."""
    target, others, params = _prompts(255)
    alone, _ = _target_output(folder, [target], [TARGET], **kw)
    crowded, _ = _target_output(folder, [target] + others, [TARGET] + params, **kw)
    _same(alone, crowded)
    chunked, _ = _target_output(folder, [target] + others[:32], [TARGET] + params[:32], max_prefill_tokens=7, **kw)
    _same(alone, chunked)
    engine = _engine(folder, **kw)
    try:
        engine.generate(input_ids=[target[:41]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
        cached = engine.generate(input_ids=[target] + others[:64], sampling_params=[TARGET] + params[:64])[0]
    finally:
        engine.shutdown()
    assert cached.num_cached_tokens >= 40
    _same(alone, cached)
    long = [SamplingParams(max_new_tokens=200, temperature=1.0, seed=i, ignore_eos=True) for i in range(32)]
    squeezed, stats = _target_output(folder, [target] + others[:32], [TARGET] + long, max_total_tokens=2500, **kw)
    assert stats["retractions"] > 0
    _same(alone, squeezed)
    return alone


def test_alone_crowded_chunked_cached_retracted_all_equal(folder):
    assert_alone_crowded_chunked_cached_retracted_equal(folder)


@pytest.mark.parametrize("target", [SamplingParams(max_new_tokens=32, temperature=1.0, seed=7, top_logprobs=3,
                                                   ignore_eos=True),
                                    SamplingParams(max_new_tokens=32, temperature=0, top_logprobs=3, ignore_eos=True)])
def test_a_request_without_filters_ignores_its_neighbours_filters(folder, target):
    """A request with no top-k/top-p/min-p (sampled, or greedy) alone and
    among 63 others that filter: bitwise the same (the batched sampler
    neither renormalises nor re-derives its row)."""
    prompt, others, params = _prompts(63, seed=11)
    alone, _ = _target_output(folder, [prompt], [target])
    crowded, _ = _target_output(folder, [prompt] + others, [target] + params)
    _same(alone, crowded)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_fidelity_score_equals_the_engines_logprobs_bitwise(folder, mode):
    from rollout_engine import fidelity

    target, others, _ = _prompts(63, seed=3)
    params = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.9, seed=5, n=2, ignore_eos=True,
                            logprob_mode=mode)
    engine = _engine(folder)
    try:
        outs = engine.generate(input_ids=[target] + others, sampling_params=params)
        scores = fidelity.score(engine, outs, params)
    finally:
        engine.shutdown()
    assert scores == [o.output_logprobs for o in outs]  # bitwise
    if mode == "raw":  # Hugging Face's forward gives raw logprobs
        gap = fidelity.hf_gap(folder, outs[:8], scores[:8], dtype=torch.bfloat16, device="cuda")
        # an MoE router near-tie rounded the other way moves the tokens after it further
        assert gap["mean_abs"] < (5e-2 if "moe" in folder else 3e-2)


@pytest.mark.multigpu
def test_tp2_one_long_lived_engine_alone_crowded_cached_retracted_all_equal(tmp_path):
    """Two GPUs, fewer KV heads than ranks (qwen2, one KV head): on one TP=2
    engine, the seeded request alone, then among 127 others with its whole
    prompt from the cache, then after a flush with 40 tokens of it cached;
    on a tight TP=2 engine, after retraction. All bitwise equal. This also
    checks the prefix cache under TP on real GPUs: in default mode a cache
    hit may legitimately flip an exact tie of random weights, here nothing
    may change."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    hf = make_hf_model("qwen2", seed=1, num_hidden_layers=3, vocab_size=1000, initializer_range=0.06,
                       max_position_embeddings=1024, **SHAPES["qwen2"])
    folder = save_model(hf, tmp_path)
    target, others, params = _prompts(127)
    engine = _engine(folder, tp_size=2)
    try:
        alone = engine.generate(input_ids=[target], sampling_params=TARGET)[0]
        crowded = engine.generate(input_ids=[target] + others, sampling_params=[TARGET] + params)[0]
        engine.flush_cache()
        engine.generate(input_ids=[target[:41]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
        cached = engine.generate(input_ids=[target] + others[:64], sampling_params=[TARGET] + params[:64])[0]
    finally:
        engine.shutdown()
    assert crowded.num_cached_tokens == len(target) - 1 and 40 <= cached.num_cached_tokens < len(target) - 1
    _same(alone, crowded)
    _same(alone, cached)
    long = [SamplingParams(max_new_tokens=200, temperature=1.0, seed=i, ignore_eos=True) for i in range(32)]
    squeezed, stats = _target_output(folder, [target] + others[:32], [TARGET] + long, max_total_tokens=2500,
                                     tp_size=2)
    assert stats["retractions"] > 0
    _same(alone, squeezed)


def _compiled(*kernels) -> set:
    """The keys of the kernels Triton holds compiled for these JIT functions,
    on every device."""
    caches = [getattr(k, "device_caches", None) for k in kernels]
    if any(c is None for c in caches):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return {(i, str(key)) for i, c in enumerate(caches) for entry in c.values() for key in entry[0]}


def test_the_first_long_prompt_compiles_no_matmul(tmp_path, monkeypatch):
    """With the Triton kernels (the fallback of cuBLAS at fixed rows, forced
    here), the engine compiles its matrix-product kernels at start: a prompt
    past DECODE_MAX_ROWS tokens, then a batch of them (and the LM head over
    their few sampled rows, outside the graphs), find every kernel ready (a
    compile inside a rollout cost the first long prompt about half a second
    per weight shape)."""
    from rollout_engine.kernels.invariant_matmul import DECODE_MAX_ROWS, split_kernel, tile_kernel
    from rollout_engine.layers import fixed_rows

    monkeypatch.setattr(fixed_rows, "ENABLED", False)

    hf = make_hf_model("qwen2", seed=1, num_hidden_layers=2, vocab_size=1000, initializer_range=0.06,
                       max_position_embeddings=4096, **SHAPES["qwen2"])
    engine = _engine(save_model(hf, tmp_path))
    try:
        before = _compiled(split_kernel, tile_kernel)
        long = [[(7 * i + j) % 997 + 1 for j in range(DECODE_MAX_ROWS + 44)] for i in range(9)]
        engine.generate(input_ids=long[:1], sampling_params=SamplingParams(max_new_tokens=4, temperature=0))
        engine.generate(input_ids=long, sampling_params=SamplingParams(max_new_tokens=4, temperature=0.7, seed=1))
        after = _compiled(split_kernel, tile_kernel)
    finally:
        engine.shutdown()
    assert before and after == before, sorted(after - before)


def test_the_unit_temperature_softmax_equals_the_divided_one_bitwise():
    """Deterministic mode's sampler reuses the logits' log-sum-exp when every
    row is at temperature 0 or 1: the processed table, with filters, is the
    one the division and a second log-sum-exp pass give, bit for bit."""
    from rollout_engine.kernels.greedy import argmax_logsumexp
    from rollout_engine.scheduler.plan_builder import sampling_plan
    from rollout_engine.runner.sampler import INVARIANT_ROWS, SamplingBatch, processed_probs

    torch.manual_seed(1)
    logits = torch.randn(6, 151936, device="cuda") * 4
    params = [SamplingParams(temperature=t, top_p=p) for t, p in ((1.0, 1.0), (0, 1.0), (1.0, 0.9), (1.0, 1.0),
                                                                    (0, 0.5), (1.0, 0.95))]
    sb = SamplingBatch.build(sampling_plan(params, list(range(6)), [3] * 6), torch.device("cuda"))
    assert sb.unit_temperature
    _, _, log_norm = argmax_logsumexp(logits)
    assert torch.equal(processed_probs(logits, sb, INVARIANT_ROWS, log_norm), processed_probs(logits, sb, INVARIANT_ROWS))
