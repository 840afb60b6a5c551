"""A request gives the same tokens alone and in a crowded batch, including
when the KV pool is so small that requests wait and get retracted."""
from __future__ import annotations

import random

import pytest

from conftest import run_checked, submit_manual
from rollout_engine import RolloutEngine, SamplingParams


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


@pytest.mark.parametrize("page_size", [pytest.param(1, marks=pytest.mark.slow), 4])  # page 1: many more steps
def test_alone_equals_in_batch_with_tight_memory(llama, page_size):
    _, folder = llama
    prompts = _prompts(16)
    params = [SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True) for _ in prompts]
    # Sampled requests with seeds must also be reproducible under preemption.
    params[3] = SamplingParams(max_new_tokens=48, temperature=0.9, top_k=50, seed=7, ignore_eos=True)
    alone_engine = RolloutEngine(folder, max_total_tokens=4096, page_size=page_size)
    alone = [alone_engine.generate(input_ids=[p], sampling_params=sp)[0] for p, sp in zip(prompts, params)]

    # 16 requests need up to ~1700 tokens of KV: 320 forces waiting and retraction.
    tight = RolloutEngine(folder, max_total_tokens=320, page_size=page_size, max_prefill_tokens=64)
    reqs = submit_manual(tight, None, prompts, params, None)
    run_checked(tight, reqs)
    assert tight.core.scheduler.num_retractions > 0
    for a, r in zip(alone, reqs):
        assert r.output_ids == a.output_token_ids
        assert r.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)
    tight.flush_cache()
    assert tight.core.scheduler.kv.allocator.num_free_pages == tight.core.scheduler.kv.allocator.num_pages


def test_requests_join_while_others_decode(llama):
    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    first = submit_manual(engine, None, [[1, 2, 3]], SamplingParams(max_new_tokens=30, temperature=0), None)
    for _ in range(5):
        engine.core.step_once()
    before = first[0].num_output_tokens
    assert before >= 5
    late = submit_manual(engine, None, [[4, 5, 6]], SamplingParams(max_new_tokens=10, temperature=0), None)
    # The newcomer joins the next step scheduled (ahead, while a decode step
    # runs): its prefill shares a step with the running request's decode, and
    # its first token is in once that step is collected.
    engine.core.step_once()
    assert late[0].num_output_tokens == 0 and late[0].kv_len == 3
    engine.core.step_once()
    assert late[0].num_output_tokens == 1 and first[0].num_output_tokens > before + 1
    run_checked(engine, first + late)
    ref = engine.generate(input_ids=[[4, 5, 6]], sampling_params=SamplingParams(max_new_tokens=10, temperature=0))
    assert late[0].output_ids == ref[0].output_token_ids


def test_chunked_prefill_matches_unchunked(llama):
    _, folder = llama
    prompts = _prompts(6, seed=1)
    params = SamplingParams(max_new_tokens=16, temperature=0)
    whole = RolloutEngine(folder, max_total_tokens=4096).generate(input_ids=prompts, sampling_params=params)
    chunked = RolloutEngine(folder, max_total_tokens=4096, max_prefill_tokens=7)
    out = chunked.generate(input_ids=prompts, sampling_params=params)
    assert [o.output_token_ids for o in out] == [o.output_token_ids for o in whole]


def test_max_running_requests_is_respected(llama):
    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096, max_running_requests=3)
    reqs = submit_manual(engine, None, _prompts(8), SamplingParams(max_new_tokens=8, temperature=0), None)
    while not all(r.finished for r in reqs):
        engine.core.step_once()
        assert len(engine.core.scheduler.running) <= 3


def test_n_samples_are_adjacent_and_distinct(llama):
    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    outs = engine.generate(input_ids=[[1, 2, 3], [9, 9]], sampling_params=SamplingParams(
        n=4, max_new_tokens=12, temperature=1.0, seed=5), request_ids=["a", "b"])
    assert [o.request_id for o in outs] == ["a-0", "a-1", "a-2", "a-3", "b-0", "b-1", "b-2", "b-3"]
    assert all(o.prompt_token_ids == [1, 2, 3] for o in outs[:4])
    assert len({tuple(o.output_token_ids) for o in outs[:4]}) > 1


def test_abort_returns_partial_output_and_memory(llama):
    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    reqs = submit_manual(engine, None, [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=100, temperature=0),
                                 ["x", "y"])
    for _ in range(4):
        engine.core.step_once()
    produced = reqs[0].num_output_tokens
    engine.abort(["x"])
    engine.core.step_once()  # settles the step in flight (one more token at most), then aborts
    assert reqs[0].finish_reason == "abort" and produced <= len(reqs[0].output_ids) <= produced + 1
    engine.abort()
    engine.core.step_once()
    assert reqs[1].finish_reason == "abort"
    engine.check_integrity()
    engine.flush_cache()
    alloc = engine.core.scheduler.kv.allocator
    assert alloc.num_free_pages == alloc.num_pages
    engine.core.set_manual(False)
    n = len(reqs[0].output_ids)
    out = engine.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_new_tokens=n, temperature=0))
    assert out[0].output_token_ids == reqs[0].output_ids  # the partial output is a true prefix


def test_stream_deltas_add_up(llama):
    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    full = engine.generate(input_ids=[[1, 2, 3]], sampling_params=params)[0]
    deltas = list(engine.stream(input_ids=[[1, 2, 3]], sampling_params=params))
    assert sum((d.output_token_ids for d in deltas), []) == full.output_token_ids
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_generate_async_and_concurrent_calls(llama):
    import asyncio

    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    params = SamplingParams(max_new_tokens=12, temperature=0)

    async def both():
        return await asyncio.gather(engine.generate_async(input_ids=[[1, 2]], sampling_params=params),
                                    engine.generate_async(input_ids=[[3, 4]], sampling_params=params))

    a, b = asyncio.run(both())
    assert a[0].output_token_ids == engine.generate(input_ids=[[1, 2]], sampling_params=params)[0].output_token_ids
    assert b[0].output_token_ids == engine.generate(input_ids=[[3, 4]], sampling_params=params)[0].output_token_ids


@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_schedule_changes_nothing_but_timing(llama, page_size):
    _, folder = llama
    prompts = _prompts(10, seed=4)
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=3, stop_token_ids=[7])
              for n, t in zip(range(5, 55, 5), [0, 1.0] * 5)]
    outs = {}
    for overlap in (True, False):
        engine = RolloutEngine(folder, max_total_tokens=4096, page_size=page_size, overlap_schedule=overlap)
        reqs = submit_manual(engine, None, prompts, params, None)
        run_checked(engine, reqs)
        assert (engine.core.scheduler.num_ahead_steps > 0) == overlap
        outs[overlap] = [(r.output_ids, r.output_logprobs, r.finish_reason) for r in reqs]
        engine.flush_cache()
        assert engine.core.scheduler.kv.allocator.num_free_pages == engine.core.scheduler.kv.allocator.num_pages
    assert outs[True] == outs[False]


def test_decode_steps_are_scheduled_ahead_while_requests_wait_for_a_slot(llama):
    """With every running slot taken, waiting requests cannot join before a
    running one finishes: decode goes on overlapping meanwhile. A freed slot
    is filled one step later, so a request may meet other neighbours than
    without overlap: deterministic mode makes the outputs comparable."""
    _, folder = llama
    prompts = _prompts(8, seed=5)
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=9, stop_token_ids=[7])
              for n, t in zip(range(12, 44, 4), [0, 1.0] * 4)]
    outs, ahead = {}, {}
    for overlap in (True, False):
        engine = RolloutEngine(folder, max_total_tokens=4096, max_running_requests=2, overlap_schedule=overlap,
                               deterministic=True)
        reqs = submit_manual(engine, None, prompts, params, None)
        run_checked(engine, reqs)
        sched = engine.core.scheduler
        outs[overlap] = [(r.output_ids, r.output_logprobs, r.finish_reason) for r in reqs]
        ahead[overlap] = (sched.num_ahead_steps, sched.num_steps)
        engine.shutdown()
    assert outs[True] == outs[False]
    ahead_steps, steps = ahead[True]
    # Only the last two requests decode with nobody waiting: most steps of
    # the first six run ahead too.
    assert ahead_steps > 0.6 * steps, ahead


def test_prefill_steps_are_scheduled_ahead_with_the_same_outputs(llama):
    """Chunked prefills, arrivals while others decode, n>1 groups (forks),
    prompt logprobs and a KV pool tight enough to retract: with overlap the
    prefilling steps are scheduled while the previous step runs too (their
    decodes read that step's tokens on the device), and every output equals
    the settled schedule's (deterministic mode: the batches differ)."""
    _, folder = llama
    prompts = _prompts(10, seed=6)
    params = [SamplingParams(max_new_tokens=n, temperature=t, seed=11, stop_token_ids=[7], n=k)
              for n, t, k in zip(range(6, 46, 4), [0, 1.0] * 5, [1, 3, 1, 1, 2, 1, 1, 1, 1, 1])]
    params[2] = SamplingParams(max_new_tokens=8, temperature=0, prompt_logprobs=True)
    outs, counts = {}, {}
    for overlap in (True, False):
        engine = RolloutEngine(folder, max_total_tokens=160, max_prefill_tokens=24, overlap_schedule=overlap,
                               deterministic=True)
        reqs = submit_manual(engine, None, prompts[:6], params[:6], None)
        for _ in range(3):
            engine.core.step_once()
            engine.check_integrity()
        reqs += engine.core.add_requests(None, prompts[6:], params[6:], None)
        run_checked(engine, reqs)
        sched = engine.core.scheduler
        outs[overlap] = [(r.output_ids, r.output_logprobs, r.prompt_logprobs, r.finish_reason) for r in reqs]
        counts[overlap] = (sched.num_ahead_steps, sched.num_steps, sched.num_retractions)
        engine.flush_cache()
        assert sched.kv.allocator.num_free_pages == sched.kv.allocator.num_pages
        engine.shutdown()
    assert outs[True] == outs[False]
    ahead_steps, steps, retractions = counts[True]
    assert retractions > 0, counts
    # Only steps after a retraction or a KV shortage (settled state decides) are not ahead.
    assert ahead_steps > 0.8 * steps, counts
