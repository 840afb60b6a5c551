"""Routing capture's copy to the host (MoE, CPU): a finished request's
routing copy lands after the step that finished it and never holds up a
step; requests finishing together share one copy; requests waiting without
KV, finished by a command's settle, or aborted with their row refilled in
the same step still report what was computed."""
from __future__ import annotations

import dataclasses

import numpy as np

from differential import WorkloadGenerator, run_call
from rollout_engine import SamplingParams
from routes_check import PROMPTS, assert_routes_match, engine_with_routes as _engine, hf_routes


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
