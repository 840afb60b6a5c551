"""Routing capture (MoE, `enable_return_routed_experts`) on the CPU: every
token that went through the model reports the experts Hugging Face's router
picks for it (compared as sets, per MoE layer), on first calls, prefix-cache
hits, n > 1 forks, chunked prefill, retractions in a tight pool, after a
weight update and under tensor parallelism; streams carry it on their last
delta; bad requests are refused naming the flag."""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import numpy as np
import pytest
import torch

from differential import WorkloadGenerator, run_call
from models import MOE, make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

KINDS = sorted(MOE)
SYSTEM = list(range(30, 70))
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6, 7], [7] * 20, list(range(100, 150))]


def hf_routes(hf, ids: list[int], top_k: int) -> np.ndarray:
    """[len(ids), moe_layers, top_k] experts of HF's routers (fp32 top-k of
    the softmax), from hooks on each sparse layer's router."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: logits.append(o[0] if isinstance(o, tuple) else o))
             for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([torch.topk(torch.softmax(x.float(), -1), top_k, -1).indices for x in logits], 1).numpy()


def assert_routes_match(hf, outs, top_k: int) -> None:
    for o in outs:
        ids = o.prompt_token_ids + o.output_token_ids
        got = o.routed_experts
        assert got is not None and got.shape[0] == len(ids) - 1, (o.request_id, None if got is None else got.shape)
        want = hf_routes(hf, ids[:-1], top_k)
        assert got.shape == want.shape
        assert (np.sort(got.astype(np.int64), -1) == np.sort(want, -1)).all(), o.request_id


def _engine(folder: str, **kw) -> RolloutEngine:
    return RolloutEngine(folder, device="cpu", enable_return_routed_experts=True,
                         **{"max_total_tokens": 4096, "max_prefill_tokens": 16, **kw})


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


def test_a_routing_copy_in_flight_never_holds_up_a_step(moe_models, monkeypatch):
    """The copy of a finished request's routing lands later than the step
    that finished it (on a GPU, behind the steps in flight): the request is
    handed out at a later dispatch once it has landed, and the loop waits
    for a copy only when no step is left to run."""
    from rollout_engine.runner import model_runner
    from rollout_engine.runner.routes import RoutesCopy

    hf, folder = moe_models["olmoe"]
    engine = _engine(folder)
    scheduler = engine.core.scheduler
    forced, landed = [], []

    class Late(RoutesCopy):  # not on the host until asked three times
        polls = 0

        def ready(self) -> bool:
            self.polls += 1
            return self.polls > 3

        def result(self):
            (landed if self.polls > 3 else forced).append(scheduler.has_work())
            return super().result()

    monkeypatch.setattr(model_runner, "RoutesCopy", Late)
    params = [SamplingParams(max_new_tokens=m, seed=m, ignore_eos=True, return_routed_experts=True)
              for m in (2, 5, 9, 30)]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert_routes_match(hf, outs, engine.model_config.moe.top_k)
    assert any(landed), "no request was handed out while others still ran"
    assert forced and not any(forced), "a copy was waited for while steps remained"
    deltas = list(engine.stream(input_ids=PROMPTS[:2], sampling_params=params[:2]))
    assert sum(d.routed_experts is not None for d in deltas) == 2
    # random calls: streams aborted midway, forks, cache hits, batches that grow and shrink
    gen = WorkloadGenerator(seed=5, token_range=(0, 512), max_prompt_len=40, max_new_tokens=16, max_batch=8)
    for c in range(12):
        call = gen.call()
        call.params = [dataclasses.replace(p, return_routed_experts=True) for p in call.params]
        for out in run_call(engine, call, f"r{c}"):
            assert out.routed_experts is not None and out.routed_experts.shape[0] <= len(out.prompt_token_ids) + len(
                out.output_token_ids) - 1
            gen.observe(out.prompt_token_ids, out.output_token_ids)
    assert not any(forced), "a copy was waited for while steps remained"
    engine.check_integrity()
    engine.shutdown()


def test_requests_finishing_together_share_one_copy(moe_models, monkeypatch):
    """A GRPO group's samples finish in the same step: their routing goes to
    the host in one copy (one gather, one transfer, one event), not one per
    request, each request still getting exactly its own rows."""
    from rollout_engine.runner import model_runner
    from rollout_engine.runner.routes import RoutesCopy

    hf, folder = moe_models["qwen3_moe"]
    engine = _engine(folder)
    copies = []

    class Counted(RoutesCopy):
        def __init__(self, routes, slot_lists):
            copies.append(len(slot_lists))
            super().__init__(routes, slot_lists)

    monkeypatch.setattr(model_runner, "RoutesCopy", Counted)
    params = SamplingParams(n=6, max_new_tokens=7, seed=3, ignore_eos=True, return_routed_experts=True)
    outs = engine.generate(input_ids=PROMPTS[:2], sampling_params=params)
    assert len(outs) == 12
    assert_routes_match(hf, outs, 2)
    # 12 finishes and 10 forked samples queued: a copy per pass, not per request (one each: 22 copies)
    assert sum(copies) == 22 and len(copies) <= 5, copies
    engine.check_integrity()
    engine.shutdown()


def test_a_request_waiting_without_kv_still_reports_what_was_computed(moe_models):
    """Retracted then aborted (the partial-rollout pattern: pause with
    retract, then abort), or a forked sample aborted before it ran: the
    routing of the positions computed before it gave up its KV."""
    hf, folder = moe_models["qwen3_moe"]
    top_k = 2
    engine = _engine(folder)
    params = SamplingParams(max_new_tokens=400, seed=1, ignore_eos=True, return_routed_experts=True)
    out_ids, paused = [], False
    for delta in engine.stream(input_ids=PROMPTS[:1], sampling_params=params):
        out_ids += delta.output_token_ids
        if len(out_ids) >= 5 and not paused:
            paused = True
            engine.pause_generation("retract")
            engine.pause_generation("abort")
        if delta.finish_reason is not None:
            break
    assert delta.finish_reason == "abort"
    assert delta.routed_experts.shape[0] == len(PROMPTS[0]) + len(out_ids) - 1
    want = hf_routes(hf, (PROMPTS[0] + out_ids)[:-1], top_k)
    assert (np.sort(delta.routed_experts.astype(np.int64), -1) == np.sort(want, -1)).all()
    engine.continue_generation()

    engine.core.set_manual(True)  # a fork's samples wait for their turn; one is aborted before it runs
    reqs = engine.core.add_requests(None, [PROMPTS[2]], SamplingParams(
        n=3, max_new_tokens=50, seed=1, ignore_eos=True, return_routed_experts=True))
    while not any(r.output_ids for r in reqs[1:]):
        engine.core.step_once()
    waiting = reqs[1]
    assert waiting.row is None and waiting.num_output_tokens == 1
    engine.core.call(lambda: engine.core.scheduler.abort([waiting.request_id]))
    engine.core.step_once()
    assert waiting.finish_reason == "abort"
    rows = waiting.routes.result()
    assert rows.shape[0] == len(PROMPTS[2])  # the prompt, computed by the leader
    assert (np.sort(rows.astype(np.int64), -1) == np.sort(hf_routes(hf, PROMPTS[2], top_k), -1)).all()
    engine.core.set_manual(False)
    engine.shutdown()


def test_a_request_finished_by_a_commands_settle_is_handed_out(moe_models, monkeypatch):
    """A weight update settles the step in flight between two steps; a
    request that finished there (its routing copy still on its way) is
    handed out once nothing is left to run, not left waiting for a step
    that never comes."""
    import threading

    from rollout_engine.runner import model_runner
    from rollout_engine.runner.routes import RoutesCopy

    hf, folder = moe_models["qwen3_moe"]
    engine = _engine(folder)
    core, scheduler = engine.core, engine.core.scheduler
    greedy = engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(
        max_new_tokens=8, temperature=0, ignore_eos=True))[0].output_token_ids
    k = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # a stop token: the step after it was
    # already launched when it is seen (a length stop is known ahead and launches nothing more)

    class NotYet(RoutesCopy):  # a GPU copy still behind the step in flight
        def ready(self) -> bool:
            return False

    monkeypatch.setattr(model_runner, "RoutesCopy", NotYet)
    weights = list(hf.state_dict().items())
    step, posted = scheduler.step, []

    def step_then_update():
        finished = step()
        if finished and not posted:  # another thread's update arrives between this step and the next
            posted.append(1)
            core.post(lambda: core.controls.update_weights(weights, None))
        return finished

    monkeypatch.setattr(scheduler, "step", step_then_update)
    params = SamplingParams(max_new_tokens=50, temperature=0, stop_token_ids=[greedy[k]], ignore_eos=True,
                            return_routed_experts=True)
    result = []
    caller = threading.Thread(target=lambda: result.append(engine.generate(input_ids=PROMPTS[:1],
                                                                           sampling_params=params)), daemon=True)
    caller.start()
    caller.join(30)
    assert posted and result, "generate never returned"
    assert result[0][0].output_token_ids == greedy[: k + 1]
    assert result[0][0].routed_experts.shape[0] == len(PROMPTS[0]) + k
    engine.shutdown()


def test_an_aborted_requests_row_refilled_in_the_same_step_keeps_its_routing(moe_models):
    """An abort frees the request's table row at the start of a step; the
    same step admits a waiting request into that row before the routing
    copy starts. The aborted request must report its own slots' routing,
    not the newcomer's."""
    hf, folder = moe_models["qwen3_moe"]
    top_k = 2
    engine = _engine(folder, max_running_requests=1)
    core = engine.core
    core.set_manual(True)
    params = SamplingParams(max_new_tokens=50, seed=1, ignore_eos=True, return_routed_experts=True)
    first, = core.add_requests(None, [PROMPTS[3]], params)
    while first.num_output_tokens < 4:
        core.step_once()
    second, = core.add_requests(None, [PROMPTS[2]], params)  # waits: one row only
    core.call(lambda: core.scheduler.abort([first.request_id]))
    core.step_once()  # the abort frees the row; the newcomer takes it in this step
    assert first.finish_reason == "abort" and second.row is not None
    rows = first.routes.result()
    ids = PROMPTS[3] + first.output_ids
    assert rows.shape[0] >= len(PROMPTS[3])
    want = hf_routes(hf, ids[: rows.shape[0]], top_k)
    assert (np.sort(rows.astype(np.int64), -1) == np.sort(want, -1)).all()
    core.set_manual(False)
    engine.shutdown()
