"""kv_cache_dtype="fp8_e4m3" on the CPU: the pool holds e4m3 K/V (scale 1)
and the engine computes what a Hugging Face model computes when its
attention reads K/V rounded so (`differential.fp8_kv_oracle`), over cache
hits, chunked prefill, n > 1, random call sequences with retractions and
aborts, with fp8 weights too, and in deterministic mode bitwise
batch-invariant as with a full-precision cache."""
from __future__ import annotations

import pytest
import torch

from differential import Reference, WorkloadGenerator, fp8_kv_oracle, fp8_oracle, stress
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.kernels.e4m3 import to_kv
from rollout_engine.kernels.fp8 import FP8
from rollout_engine.kv_sizing import kv_bytes_per_token
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import preset_config
from test_fp8_engine import assert_near_oracle

PROMPTS = [[5, 17, 3, 99, 250, 7], [1, 2, 3], list(range(40, 75))]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0, logprobs=True, ignore_eos=True)
# Engine against the oracle: both fp32, the same values rounded to e4m3; measured up to 4e-6 nats on these
# tiny models (a rounding tie decided the other way would move one value by one e4m3 step: a few hundredths
# at most). The e4m3 cache itself moves tokens 0.1-0.2 nats from the model with a full-precision cache.
TOL = 0.02


def _check(outs, prompts, oracle: Reference, plain: Reference, tag) -> None:
    """Every token within TOL of the oracle (teacher-forced on the engine's
    tokens), greedy choices the oracle's best, and on average far nearer
    the oracle than the model with a full-precision cache."""
    assert_near_oracle(outs, prompts, oracle, plain, tag, tol=TOL, margin=TOL, ratio=0.01)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2_moe"])
def test_the_engine_attends_over_what_an_e4m3_cache_holds(tmp_path, kind):
    """Two calls (the second from the prefix cache), a 35-token prompt in
    chunks of 16, and n = 3 forks, against the fp8-KV oracle."""
    hf = make_hf_model(kind, seed=3)
    engine = RolloutEngine(save_model(hf, tmp_path), device="cpu", max_total_tokens=2048, max_prefill_tokens=16,
                           kv_cache_dtype="fp8_e4m3")
    pool = engine.core.parts.kv_pool
    assert pool.k[0].dtype == FP8 and pool.v[-1].dtype == FP8
    oracle, plain = Reference(fp8_kv_oracle(hf), "cpu"), Reference(hf, "cpu")
    for rep in range(2):
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        _check(outs, PROMPTS, oracle, plain, (kind, rep))
    assert outs[2].num_cached_tokens >= 32
    fork = engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(
        n=3, max_new_tokens=16, temperature=0, ignore_eos=True))
    assert all(o.output_token_ids == outs[0].output_token_ids for o in fork)
    engine.check_integrity()
    engine.shutdown()


def test_fp8_weights_with_an_e4m3_cache(tmp_path):
    """quantization="fp8" and kv_cache_dtype="fp8_e4m3" together (the fp8
    rollout configuration): near the oracle quantizing both."""
    hf = make_hf_model("qwen2", seed=3)
    engine = RolloutEngine(save_model(hf, tmp_path), device="cpu", max_total_tokens=2048, max_prefill_tokens=16,
                           quantization="fp8", kv_cache_dtype="fp8_e4m3")
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert_near_oracle(outs, PROMPTS, Reference(fp8_kv_oracle(fp8_oracle(hf)), "cpu"), Reference(hf, "cpu"), "both")
    engine.shutdown()


@pytest.mark.slow  # a 40-call sequence; run by .ci/run after the fast tests
def test_random_call_sequences_with_an_e4m3_cache(tmp_path):
    """The differential stress on one long-lived engine (a tight pool:
    retractions and evictions; aborts; small prefill chunks; page size 16)
    against the fp8-KV oracle."""
    hf = make_hf_model("llama", seed=3)
    engine = RolloutEngine(save_model(hf, tmp_path), device="cpu", max_total_tokens=400, max_prefill_tokens=48,
                           page_size=16, max_running_requests=24, kv_cache_dtype="fp8_e4m3")
    gen = WorkloadGenerator(seed=7, token_range=(0, 512), max_prompt_len=60, max_new_tokens=40, max_batch=16)
    report = stress(engine, Reference(fp8_kv_oracle(hf), "cpu"), gen, num_calls=40, margin=TOL, logprob_tol=TOL)
    print(report.summary())
    assert not report.violations, report.violations[:5]
    stats = engine.cache_stats()
    assert stats["retractions"] > 0 and stats["hit_rate"] > 0.1 and report.aborted > 0
    engine.shutdown()


def test_deterministic_mode_stays_batch_invariant_with_an_e4m3_cache(tmp_path):
    """A seeded sampled request alone = among 16 others with chunked prefill,
    bitwise; and the e4m3 cache is in use (its tokens' logprobs differ from
    a full-precision cache's)."""
    from test_deterministic import TARGET, _prompts, _same, first_output

    folder = save_model(make_hf_model("qwen3", seed=1, num_hidden_layers=2), tmp_path)
    target, others, params = _prompts()

    def run(batch, batch_params, **kw):
        engine = RolloutEngine(folder, device="cpu", deterministic=True, max_total_tokens=16384, **kw)
        return first_output(engine, batch, batch_params)[0]

    alone = run([target], [TARGET], kv_cache_dtype="fp8_e4m3")
    crowded = run([target] + others[:16], [TARGET] + params[:16], kv_cache_dtype="fp8_e4m3", max_prefill_tokens=7)
    _same(alone, crowded)
    assert run([target], [TARGET]).output_logprobs != alone.output_logprobs


def test_an_e4m3_cache_is_half_the_bytes_and_saturates_instead_of_overflowing():
    mc = ModelConfig.from_hf(preset_config("qwen2.5-7b"), ())
    assert 2 * kv_bytes_per_token(mc, 4, FP8) == kv_bytes_per_token(mc, 4, torch.bfloat16) == 57344
    x = torch.tensor([1000.0, -1e6, 447.0, 0.3, 3.3, 1e-4, -0.0])
    held = to_kv(x.to(torch.bfloat16), FP8).float()
    assert held.tolist()[:3] == [448.0, -448.0, 448.0]  # clamped, never NaN
    assert torch.equal(held, x.to(torch.bfloat16).float().to(FP8).float().nan_to_num(448.0).clamp(-448, 448))
    assert torch.equal(to_kv(x, torch.float32), x)


def test_the_kv_cache_dtype_is_checked_and_offered_on_the_command_line():
    from rollout_engine.cli_args import FIELD_CHOICES

    assert "fp8_e4m3" in FIELD_CHOICES["kv_cache_dtype"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        RolloutEngine("qwen3-0.6b", load_format="dummy", device="cpu", kv_cache_dtype="fp8")


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_tensor_parallel_ranks_hold_their_heads_in_e4m3(tmp_path):
    """tp_size=2 over gloo: each rank's pool holds its KV heads in e4m3, and
    the engine stays near the fp8-KV oracle (the ranks' all-reduce sums in
    another order than one rank: at most a rounding tie decided otherwise)."""
    hf = make_hf_model("qwen2_moe", seed=3)
    engine = RolloutEngine(save_model(hf, tmp_path), device="cpu", tp_size=2, max_total_tokens=2048,
                           max_prefill_tokens=16, kv_cache_dtype="fp8_e4m3")
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    _check(outs, PROMPTS, Reference(fp8_kv_oracle(hf), "cpu"), Reference(hf, "cpu"), "tp2")
