"""Routing capture (MoE, `enable_return_routed_experts`) on the CPU: every
token that went through the model reports the experts Hugging Face's router
picks for it (compared as sets, per MoE layer), on first calls, prefix-cache
hits, n > 1 forks, chunked prefill, retractions in a tight pool, after a
weight update and under tensor parallelism; streams carry it on their last
delta; bad requests are refused naming the flag."""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

from models import MOE, make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams
from routes_check import PROMPTS, SYSTEM, assert_routes_match, engine_with_routes as _engine, hf_routes

KINDS = sorted(MOE)


@pytest.mark.parametrize("kind", KINDS)
def test_routing_equals_hf_on_first_calls_cache_hits_and_forks(moe_models, kind):
    hf, folder = moe_models[kind]
    engine = _engine(folder)  # prefill chunks of 16: every prompt but one is chunked
    top_k = engine.model_config.moe.top_k
    params = SamplingParams(max_new_tokens=12, seed=1, ignore_eos=True, return_routed_experts=True)
    first = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert_routes_match(hf, first, top_k)
    forks = engine.generate(input_ids=PROMPTS[:2], sampling_params=SamplingParams(
        n=3, max_new_tokens=12, seed=2, ignore_eos=True, return_routed_experts=True))
    assert all(o.num_cached_tokens >= len(SYSTEM) for o in forks)  # served from the cache
    assert_routes_match(hf, forks, top_k)
    # one token each: the siblings finish as they are forked, holding no KV of their own
    ones = engine.generate(input_ids=[PROMPTS[2] + [1]], sampling_params=SamplingParams(
        n=3, max_new_tokens=1, seed=2, return_routed_experts=True))
    assert_routes_match(hf, ones, top_k)
    assert first[0].routed_experts.dtype == np.uint8
    assert first[0].routed_experts.shape[1:] == (len(engine.model_config.moe.sparse_layers), top_k)
    plain = engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=3))
    assert plain[0].routed_experts is None  # not asked for
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
def test_retractions_in_a_tight_pool_report_the_recomputed_routing(moe_models, kind):
    hf, folder = moe_models[kind]
    engine = _engine(folder, max_total_tokens=160, max_prefill_tokens=32, page_size=4)
    prompts = [[i + 3] * 8 + list(range(200 + i, 220 + i)) for i in range(8)]
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(
        max_new_tokens=40, seed=4, ignore_eos=True, return_routed_experts=True))
    assert engine.cache_stats()["retractions"] > 0
    assert_routes_match(hf, outs, engine.model_config.moe.top_k)
    engine.shutdown()


def test_routing_follows_a_weight_update(moe_models):
    hf, folder = moe_models["qwen3_moe"]
    engine = _engine(folder)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, return_routed_experts=True)
    engine.generate(input_ids=PROMPTS, sampling_params=params)  # the prompts' KV cached under the old weights
    new = make_hf_model("qwen3_moe", seed=6)
    engine.update_weights(list(new.state_dict().items()))
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert_routes_match(new, outs, engine.model_config.moe.top_k)
    engine.shutdown()


def test_a_stream_carries_the_routing_on_its_last_delta(moe_models):
    hf, folder = moe_models["olmoe"]
    engine = _engine(folder)
    params = SamplingParams(max_new_tokens=10, seed=3, ignore_eos=True, return_routed_experts=True)
    deltas = list(engine.stream(input_ids=PROMPTS[:2], sampling_params=params, request_ids=["a", "b"]))
    last = {d.request_id: d for d in deltas if d.finish_reason is not None}
    assert all(d.routed_experts is None for d in deltas if d.finish_reason is None)
    whole = engine.generate(input_ids=PROMPTS[:2], sampling_params=params, request_ids=["a", "b"])
    for o in whole:
        assert np.array_equal(last[o.request_id].routed_experts, o.routed_experts)
    assert_routes_match(hf, whole, engine.model_config.moe.top_k)
    engine.shutdown()


def test_an_aborted_request_reports_the_tokens_computed(moe_models):
    hf, folder = moe_models["qwen3_moe"]
    engine = _engine(folder)
    params = SamplingParams(max_new_tokens=400, seed=3, ignore_eos=True, return_routed_experts=True)
    stream = engine.stream(input_ids=PROMPTS[:1], sampling_params=params)
    for i, delta in enumerate(stream):
        if i == 3:
            engine.abort()
        if delta.finish_reason is not None:
            break
    assert delta.finish_reason == "abort"
    routes = delta.routed_experts
    assert routes is not None and 0 < routes.shape[0] < len(PROMPTS[0]) + 400
    want = hf_routes(hf, PROMPTS[0], engine.model_config.moe.top_k)  # the prompt's part
    assert (np.sort(routes[: len(PROMPTS[0])].astype(np.int64), -1) == np.sort(want, -1)).all()
    engine.shutdown()


def test_bad_requests_name_the_flag_and_leave_the_engine_usable(moe_models, tmp_path):
    _, folder = moe_models["qwen2_moe"]
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    with pytest.raises(ValueError, match="return_routed_experts.*enable_return_routed_experts=True"):
        engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(return_routed_experts=True))
    assert engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(max_new_tokens=2))[0].finish_reason
    engine.shutdown()
    with pytest.raises(ValueError, match="return_routed_experts must be a bool"):
        SamplingParams(return_routed_experts=1)
    with pytest.raises(ValueError, match="enable_return_routed_experts must be True or False"):
        RolloutEngine(folder, device="cpu", enable_return_routed_experts="yes")
    dense = save_model(make_hf_model("qwen3", seed=1), tmp_path / "dense")
    with pytest.raises(ValueError, match="enable_return_routed_experts=True needs a mixture-of-experts model; "
                                         "Qwen3ForCausalLM"):
        RolloutEngine(dense, device="cpu", max_total_tokens=1024, enable_return_routed_experts=True)


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_tp2_reports_the_routing_of_tp1(moe_models):
    hf, folder = moe_models["qwen3_moe"]
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, return_routed_experts=True)
    outs = {}
    for tp in (1, 2):
        engine = _engine(folder, tp_size=tp)
        try:
            outs[tp] = engine.generate(input_ids=PROMPTS, sampling_params=params)
        finally:
            engine.shutdown()
    for a, b in zip(outs[1], outs[2]):
        assert a.output_token_ids == b.output_token_ids
        assert np.array_equal(a.routed_experts, b.routed_experts)
    assert_routes_match(hf, outs[2], 2)


def _trainer_logprobs(hf, outs, routes=None, agree: list | None = None) -> list[torch.Tensor]:
    """Each output token's logprob under `hf` over a right-padded batch, with
    the engine's routing replayed when `routes` is given (`agree`: measured
    against it instead)."""
    from rollout_engine.integrations.routing_replay import agreement, replay

    seqs = [o.prompt_token_ids + o.output_token_ids for o in outs]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    context = contextlib.nullcontext() if routes is None else (
        agreement(hf, routes, agree) if agree is not None else replay(hf, routes))
    with torch.no_grad(), context:
        logp = torch.log_softmax(hf(ids, attention_mask=mask).logits.float(), -1)
    out = []
    for i, o in enumerate(outs):
        p = len(o.prompt_token_ids)
        pos = torch.arange(p - 1, p - 1 + len(o.output_token_ids))
        out.append(logp[i, pos, torch.tensor(o.output_token_ids)])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_trainer_replaying_the_engines_routing_scores_its_tokens_as_the_engine_did(moe_models, kind):
    """The engine's arrays feed `integrations.routing_replay.replay` as they
    come: with the engine's weights the trainer's logprobs equal the engine's
    (fp32, 1e-4); with a drifted router, replay brings them closer."""
    hf, folder = moe_models[kind]
    engine = _engine(folder)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(
        max_new_tokens=10, seed=1, ignore_eos=True, logprob_mode="raw", return_routed_experts=True))
    engine.shutdown()
    routes = [o.routed_experts for o in outs]
    for o, lp in zip(outs, _trainer_logprobs(hf, outs, routes)):
        assert torch.allclose(lp, torch.tensor(o.output_logprobs), atol=1e-4), o.request_id
    drifted = copy.deepcopy(hf)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in drifted.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * layer.mlp.gate.weight.std())

    def gap(logprobs) -> float:
        return float(torch.cat([lp - torch.tensor(o.output_logprobs) for o, lp in zip(outs, logprobs)]).abs().mean())

    free, replayed = gap(_trainer_logprobs(drifted, outs)), gap(_trainer_logprobs(drifted, outs, routes))
    assert replayed < free, (replayed, free)
    agree: list[float] = []
    _trainer_logprobs(hf, outs, routes, agree)  # the same weights: every (token, layer) as the engine routed it
    _trainer_logprobs(drifted, outs, routes, agree)
    assert agree[0] == 1.0 and 0 < agree[1] < 1.0, agree
