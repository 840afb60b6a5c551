"""The rollout workload through the engine: n-sampling, multi-turn and shared
prefixes give the same greedy outputs with the cache on and off, and the
cache actually serves the shared tokens."""
from __future__ import annotations

import random

import pytest

from conftest import run_checked, submit_manual
from rollout_engine import RolloutEngine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n, lo=5, hi=60, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _engines(folder, **kw):
    on = RolloutEngine(folder, max_total_tokens=8192, **kw)
    off = RolloutEngine(folder, max_total_tokens=8192, enable_prefix_cache=False, **kw)
    return on, off


@pytest.mark.parametrize("page_size", [1, 4])
def test_n_sampling_prefills_once(llama, page_size):
    _, folder = llama
    prompts = _prompts(16)
    params = SamplingParams(n=8, max_new_tokens=24, temperature=0, ignore_eos=True)
    on, off = _engines(folder, page_size=page_size)
    outs_on = on.generate(input_ids=prompts, sampling_params=params)
    outs_off = off.generate(input_ids=prompts, sampling_params=params)
    assert [o.output_token_ids for o in outs_on] == [o.output_token_ids for o in outs_off]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs_on)
    cached = sum(o.num_cached_tokens for o in outs_on)
    if page_size == 1:
        assert cached >= prompt_tokens * 7 / 8
    else:  # whole pages only: the partial last page of each prompt is recomputed
        assert cached >= sum((len(p) - len(p) % 4) * 7 for p in prompts)
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    on.check_integrity()


def test_seeded_n_sampling_same_with_cache_on_and_off(llama):
    _, folder = llama
    params = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=11)
    on, off = _engines(folder)
    a = on.generate(input_ids=_prompts(3), sampling_params=params)
    b = off.generate(input_ids=_prompts(3), sampling_params=params)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert len({tuple(o.output_token_ids) for o in a[:4]}) > 1


def test_multi_turn_reuses_the_previous_turn(llama):
    _, folder = llama
    on, off = _engines(folder)
    rng = random.Random(5)
    histories = {"on": [[1, 2, 3, 4, 5, 6, 7]] * 3, "off": [[1, 2, 3, 4, 5, 6, 7]] * 3}
    histories["on"] = [h + [i] for i, h in enumerate(histories["on"])]
    histories["off"] = list(histories["on"])
    for turn in range(4):
        user = [[rng.randrange(512) for _ in range(6)] for _ in range(3)]
        outs = {}
        for name, engine in (("on", on), ("off", off)):
            prompts = [h + u for h, u in zip(histories[name], user)] if turn else histories[name]
            outs[name] = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            histories[name] = [p + o.output_token_ids for p, o in zip(prompts, outs[name])]
        assert [o.output_token_ids for o in outs["on"]] == [o.output_token_ids for o in outs["off"]]
        if turn:  # everything but the last token of the previous turn was cached
            for o, prev in zip(outs["on"], prev_lens):
                assert o.num_cached_tokens >= prev - 1
        prev_lens = [len(h) for h in histories["on"]]


def test_partial_shared_prefixes(llama):
    _, folder = llama
    system = list(range(300, 340))
    rng = random.Random(2)
    prompts = [system[: rng.randrange(10, 41)] + [rng.randrange(512) for _ in range(rng.randrange(1, 20))]
               for _ in range(12)]
    on, off = _engines(folder)
    first = on.generate(input_ids=[system], sampling_params=GREEDY)
    outs = on.generate(input_ids=prompts, sampling_params=GREEDY)
    ref = off.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    for p, o in zip(prompts, outs):
        shared = next(i for i in range(len(p) + 1) if i == len(p) or i >= len(system) or p[i] != system[i])
        assert o.num_cached_tokens >= min(shared, len(p) - 1)
    assert first[0].num_cached_tokens == 0


def test_eviction_and_preemption_keep_outputs(llama):
    _, folder = llama
    prompts = _prompts(12, lo=20, hi=50, seed=9)
    params = SamplingParams(n=4, max_new_tokens=40, temperature=0, ignore_eos=True)
    ref = RolloutEngine(folder, max_total_tokens=16384).generate(input_ids=prompts, sampling_params=params)
    tight = RolloutEngine(folder, max_total_tokens=400, max_prefill_tokens=128)
    reqs = submit_manual(tight, None, prompts, params, None)
    run_checked(tight, reqs)
    stats = tight.cache_stats()
    assert stats["retractions"] > 0 and stats["evicted_tokens"] > 0
    assert [r.output_ids for r in reqs] == [o.output_token_ids for o in ref]
    assert all(r.finish_reason == "length" for r in reqs)


def test_abort_reaches_samples_not_yet_forked(llama):
    _, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=4096)
    reqs = submit_manual(engine, None, [[1, 2, 3]], SamplingParams(n=4, max_new_tokens=30, temperature=0), ["a"])
    engine.abort(["a-2"])
    run_checked(engine, reqs)
    assert reqs[2].finish_reason == "abort" and reqs[2].output_ids == []
    assert [r.finish_reason for r in reqs[:2] + reqs[3:]] == ["length"] * 3
    reqs = submit_manual(engine, None, [[4, 5]], SamplingParams(n=3, max_new_tokens=30), ["b"])
    engine.abort()
    engine.core.step_once()
    assert all(r.finish_reason == "abort" for r in reqs)
    engine.check_integrity()
