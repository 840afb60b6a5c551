"""`max_new_tokens=0`: the prompt alone goes through the model, for its
prompt logprobs, its routing or to fill the prefix cache; no token is
output, the request finishes with "length", and the requests batched with it
are unchanged."""
from __future__ import annotations

import asyncio

import pytest

from rollout_engine import RolloutEngine, SamplingParams

PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(100, 160))]
ONE = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True, top_logprobs=2)
NONE = SamplingParams(max_new_tokens=0, temperature=0, prompt_logprobs=True, top_logprobs=2)
LONG = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama):
    return RolloutEngine(llama[1], max_total_tokens=2048)


def _assert_prompt_only(out, like):
    assert out.output_token_ids == [] and out.output_logprobs == [] and out.top_logprobs == []
    assert out.output_weight_versions == [] and out.finish_reason == "length"
    assert out.prompt_logprobs == like.prompt_logprobs  # the same prefill as a request that samples one token


def test_the_prompt_alone_gives_its_logprobs_and_no_tokens(engine):
    engine.flush_cache()
    one = engine.generate(input_ids=PROMPTS, sampling_params=ONE)
    engine.flush_cache()
    none = engine.generate(input_ids=PROMPTS, sampling_params=NONE)
    for out, like in zip(none, one):
        _assert_prompt_only(out, like)
    assert engine.num_unfinished_requests() == 0
    engine.check_integrity()


def test_batched_with_sampling_requests_and_n_samples(engine):
    alone = engine.generate(input_ids=PROMPTS, sampling_params=LONG)
    engine.flush_cache()
    mixed = engine.generate(input_ids=PROMPTS * 2, sampling_params=[LONG] * 3 + [NONE] * 3)
    assert [o.output_token_ids for o in mixed[:3]] == [o.output_token_ids for o in alone]
    assert all(o.output_token_ids == [] and o.finish_reason == "length" for o in mixed[3:])
    many = engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=0, n=3))
    assert len(many) == 3 and all(o.output_token_ids == [] for o in many)
    engine.check_integrity()


def test_it_fills_the_prefix_cache_for_the_requests_after_it(engine):
    engine.flush_cache()
    engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=0))
    later = engine.generate(input_ids=PROMPTS[:1], sampling_params=LONG)[0]
    assert later.num_cached_tokens >= len(PROMPTS[0]) - 16  # all but the last, partly filled page or so
    engine.flush_cache()
    cold = engine.generate(input_ids=PROMPTS[:1], sampling_params=LONG)[0]
    assert cold.num_cached_tokens == 0 and cold.output_token_ids == later.output_token_ids


def test_a_stream_gives_one_empty_final_delta(engine):
    deltas = list(engine.stream(input_ids=PROMPTS[1:2], sampling_params=NONE))
    assert len(deltas) == 1 and deltas[0].output_token_ids == [] and deltas[0].finish_reason == "length"

    async def collect():
        return [d async for d in engine.stream_async(input_ids=PROMPTS[1:2], sampling_params=NONE)]
    assert [d.output_token_ids for d in asyncio.run(collect())] == [[]]


def test_a_prompt_as_long_as_the_context_is_taken(engine, llama):
    hf, _ = llama
    context = hf.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(input_ids=[[5] * context], sampling_params=SamplingParams(max_new_tokens=1))
    out = engine.generate(input_ids=[[5] * context], sampling_params=SamplingParams(max_new_tokens=0))[0]
    assert out.output_token_ids == [] and out.finish_reason == "length"


def test_text_is_empty_with_a_tokenizer(smollm2_dir):
    engine = RolloutEngine(smollm2_dir, max_total_tokens=1024)
    try:
        out = engine.generate(["The capital of France is"],
                              sampling_params=SamplingParams(max_new_tokens=0, prompt_logprobs=True))[0]
        assert out.text == "" and out.output_token_ids == [] and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    finally:
        engine.shutdown()


def test_moe_routes_cover_every_prompt_position(moe_models):
    _, folder = moe_models["qwen3_moe"]
    engine = RolloutEngine(folder, max_total_tokens=1024, enable_return_routed_experts=True)
    try:
        one = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
            max_new_tokens=1, temperature=0, return_routed_experts=True))
        engine.flush_cache()
        none = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
            max_new_tokens=0, return_routed_experts=True))
        for a, b, prompt in zip(one, none, PROMPTS):  # every prompt position went through the model
            assert a.routed_experts.shape[0] == b.routed_experts.shape[0] == len(prompt)
            assert (b.routed_experts == a.routed_experts).all()
    finally:
        engine.shutdown()


def test_the_metrics_count_no_output_token(engine):
    before = engine.metrics()
    engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=0, n=2))
    after = engine.metrics()
    assert after["output_tokens"] == before["output_tokens"]
    assert after["finished"]["length"] == before["finished"].get("length", 0) + 6
