"""Bad input raises ValueError naming the request and field, before any work;
the engine generates correctly afterwards."""
from __future__ import annotations

import pytest

from rollout_engine import RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(llama):
    return RolloutEngine(llama[1], max_total_tokens=1024)


GOOD = SamplingParams(max_new_tokens=8, temperature=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(input_ids=[[1, 2], []]), r"request 1: input_ids is empty"),
    (dict(input_ids=[[1, 2], [3, 512]]), r"request 1: input_ids contains 512, outside the vocabulary"),
    (dict(input_ids=[[-1]]), r"request 0: input_ids contains -1"),
    (dict(input_ids=[[1] * 500], sampling_params=SamplingParams(max_new_tokens=20)),
     r"request 0: sampling_params.max_new_tokens .* context of 512"),
    (dict(input_ids=[[1, 2]], prompts=["hi"]), r"exactly one of prompts and input_ids"),
    (dict(), r"exactly one of prompts and input_ids"),
    (dict(prompts=["hello"]), r"need a tokenizer"),
    (dict(input_ids=[[1], [2]], sampling_params=[GOOD]),
     r"sampling_params must be a SamplingParams or a list of 2 SamplingParams \(one per prompt\), got a list of 1"),
    (dict(input_ids=[[1]], sampling_params={"temperature": 0}),
     r"sampling_params must be a SamplingParams .* got dict \(build one from a dict with SamplingParams\(\*\*d\)\)"),
    (dict(input_ids=[[1], [2]], request_ids=["a", "a"]), r"request 1: request_ids 'a' is already in use"),
    (dict(input_ids=[[1]], sampling_params=SamplingParams(stop=["x"])), r"request 0: sampling_params.stop needs a tokenizer"),
    (dict(input_ids=[[1]], sampling_params=SamplingParams(stop_token_ids=[9999])), r"request 0: sampling_params.stop_token_ids"),
])
def test_bad_generate_input(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    assert not engine.core.scheduler.has_work()  # nothing was queued
    out = engine.generate(input_ids=[[1, 2, 3]], sampling_params=GOOD)
    assert len(out[0].output_token_ids) == 8


def test_no_prompts_give_no_outputs_without_a_tokenizer_too(engine):
    """An empty list of prompts is no work, text or ids alike, tokenizer or not."""
    assert engine.generate(prompts=[]) == [] and engine.generate(input_ids=[]) == []


def test_kv_capacity_is_checked(llama):
    small = RolloutEngine(llama[1], max_total_tokens=64)
    with pytest.raises(ValueError, match=r"request 0: sampling_params.max_new_tokens .* KV cache capacity of 64"):
        small.generate(input_ids=[[1] * 40], sampling_params=SamplingParams(max_new_tokens=30))
    assert small.generate(input_ids=[[1] * 40], sampling_params=SamplingParams(max_new_tokens=20))


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n"), (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(seed=-3), "seed"), (dict(logprob_mode="softmax"), "logprob_mode"), (dict(top_logprobs=-1), "top_logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[1.5]), "stop_token_ids"), (dict(logprobs="yes"), "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"sampling_params\.{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(dtype="int8"), "dtype"), (dict(page_size=3), "page_size"), (dict(mem_fraction=0), "mem_fraction"),
    (dict(attention_backend="magic"), "attention_backend"), (dict(load_format="pt"), "load_format"),
    (dict(device="tpu"), "device"), (dict(max_running_requests=0), "max_running_requests"),
    # a bool is no count (Python counts it an int), a string no fraction
    (dict(max_prefill_tokens=True), "max_prefill_tokens"), (dict(page_size=True), "page_size"),
    (dict(seed=False), "seed"), (dict(max_total_tokens=True), "max_total_tokens"),
    (dict(mem_fraction="0.5"), "mem_fraction"), (dict(mem_fraction=True), "mem_fraction"),
])
def test_bad_engine_arguments_name_the_field(llama, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        RolloutEngine(llama[1], **kwargs)


def test_unknown_model_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        RolloutEngine(str(tmp_path / "nope"))
    # A folder that is no model folder: named as such, not in transformers' words.
    with pytest.raises(ValueError, match=r"^model .* is a folder without a config\.json"):
        RolloutEngine(str(tmp_path))
    with pytest.raises(ValueError, match=r"^model .* is a folder without a config\.json"):
        RolloutEngine(str(tmp_path), load_format="dummy")
