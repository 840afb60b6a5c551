"""The scheduler with a fake runner: no model, just the step logic."""
from __future__ import annotations

import numpy as np

from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.prefix_cache import NoPrefixCache
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.request import Request
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.plan import StepOutput
from rollout_engine.scheduler.config import SchedulerConfig
from rollout_engine.scheduler.scheduler import Scheduler
from rollout_engine.scheduler.stop import StopChecker


class FakeRunner:
    """Next token = (last input token + 1) % 100; records every plan as
    (request id, start, extend_len) per sequence."""

    def __init__(self):
        self.batches = []
        self.scheduler = None  # to name the request in each table row

    def launch(self, plan, prev=None):
        names = {r.row: r.request_id for r in self.scheduler.running}
        ends = np.cumsum(plan.extend_lens)
        starts = ends - plan.extend_lens
        self.batches.append([(names[row], int(plan.positions[a]), int(n))
                             for row, a, n in zip(plan.rows, starts, plan.extend_lens)])
        inputs = plan.input_ids.copy()
        if plan.prev_rows is not None:  # inputs that are the tokens the previous step sampled
            reads = plan.prev_rows >= 0
            inputs[(ends - 1)[reads]] = prev[plan.prev_rows[reads]]
        assert (inputs >= 0).all(), "a placeholder reached the model"
        tokens = (inputs[plan.logit_rows[plan.sample_rows]] + 1) % 100
        return tokens

    def collect(self, tokens):
        n = len(tokens)
        return StepOutput(tokens, np.full(n, -1.0), None, None, np.zeros(0))


def _scheduler(num_pages=64, max_prefill=32, max_running=8, eos=(99,)):
    alloc = PageAllocator(num_pages, 1)
    kv = KVManager(alloc, ReqToTokenTable(max_running, 256), NoPrefixCache(alloc))
    runner = FakeRunner()
    runner.scheduler = Scheduler(SchedulerConfig(max_running, max_prefill), kv, runner, StopChecker(eos, 256))
    return runner.scheduler, runner


def _run(s):
    while s.has_work():
        s.step()
        s.check_integrity()


def test_long_prompt_is_chunked_while_decodes_continue():
    s, runner = _scheduler(max_prefill=10)
    short = Request("short", [1, 2], SamplingParams(max_new_tokens=20), seed=0)
    s.add(short)
    s.step()
    long = Request("long", list(range(30)), SamplingParams(max_new_tokens=3), seed=0)
    s.add(long)
    _run(s)
    chunks = [e for b in runner.batches for (rid, _, e) in b if rid == "long"]
    assert chunks[:3] == [10, 10, 10] and set(chunks[3:]) == {1}
    # The short request decoded in every step the long one was prefilling.
    for batch in runner.batches[1:4]:
        assert ("short" in [rid for rid, _, _ in batch])
    assert short.output_ids == [(2 + i) % 100 for i in range(1, 21)]
    assert long.output_ids == [30, 31, 32]


def test_stop_reasons():
    s, _ = _scheduler()
    eos = Request("eos", [95], SamplingParams(max_new_tokens=50), seed=0)
    stop_id = Request("stop_id", [10], SamplingParams(max_new_tokens=50, stop_token_ids=[13]), seed=0)
    ignore = Request("ignore", [97], SamplingParams(max_new_tokens=5, ignore_eos=True), seed=0)
    for r in (eos, stop_id, ignore):
        s.add(r)
    _run(s)
    assert eos.output_ids == [96, 97, 98, 99] and eos.finish_reason == "stop"
    assert stop_id.output_ids == [11, 12, 13] and stop_id.finish_reason == "stop"
    assert ignore.output_ids == [98, 99, 0, 1, 2] and ignore.finish_reason == "length"


def test_waiting_requests_never_fail_when_memory_is_short():
    s, _ = _scheduler(num_pages=40, max_prefill=64)
    reqs = [Request(f"r{i}", [i] * 10, SamplingParams(max_new_tokens=20, ignore_eos=True), seed=0) for i in range(8)]
    for r in reqs:
        s.add(r)
    _run(s)
    assert all(len(r.output_ids) == 20 and r.finish_reason == "length" for r in reqs)
    assert s.kv.allocator.num_free_pages == 40


def _radix_scheduler(overlap, num_pages=512, max_prefill=16, max_running=8, page_size=1):
    from rollout_engine.cache.radix import RadixCache

    alloc = PageAllocator(num_pages, page_size)
    kv = KVManager(alloc, ReqToTokenTable(max_running, 256), RadixCache(alloc))
    runner = FakeRunner()
    runner.scheduler = Scheduler(SchedulerConfig(max_running, max_prefill, overlap=overlap), kv, runner,
                                 StopChecker((99,), 256))
    return runner.scheduler, runner


def _cached_sequences(cache):
    """Every token sequence the radix tree holds, root to leaf."""
    out, stack = [], [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        seq = prefix + tuple(node.key)
        if not node.children:
            out.append(seq)
        stack.extend((child, seq) for child in node.children.values())
    return out


def _mixed_workload():
    """Prompts longer than the prefill budget (chunked), a late arrival, an
    n=3 group (forks), a request that stops at EOS while scheduled ahead."""
    long_a = Request("a", list(range(40)), SamplingParams(max_new_tokens=6, ignore_eos=True), seed=0)
    short = Request("b", [5, 6], SamplingParams(max_new_tokens=12, ignore_eos=True), seed=0)
    eos = Request("e", list(range(60, 90)), SamplingParams(max_new_tokens=50), seed=0)  # reaches 99: EOS
    group = [Request(f"g-{j}", [7, 8, 9, 10, 11], SamplingParams(max_new_tokens=4, ignore_eos=True), seed=j)
             for j in range(3)]
    group[0].fork_siblings = group[1:]
    late = Request("late", list(range(20, 45)), SamplingParams(max_new_tokens=5, ignore_eos=True), seed=0)
    return [short, long_a, eos, group[0]], late, [short, long_a, eos, *group, late]


def test_prefill_chunks_and_admissions_are_scheduled_ahead():
    """With overlap, steps that prefill (chunks of long prompts, new arrivals,
    fork siblings) are scheduled while the previous step runs, as decodes
    are; the tokens are those of the settled schedule, and no placeholder
    (a token still being sampled) reaches the model or the prefix cache."""
    outputs = {}
    for overlap in (False, True):
        s, runner = _radix_scheduler(overlap)
        first, late, every = _mixed_workload()
        for r in first:
            s.add(r)
        s.step()
        s.add(late)
        steps = 1
        while s.has_work():
            s.step()
            s.check_integrity()
            for seq in _cached_sequences(s.kv.cache):
                assert -1 not in seq, "a placeholder was put into the prefix cache"
            steps += 1
        outputs[overlap] = {r.request_id: (r.output_ids, r.finish_reason) for r in every}
        if overlap:
            # Every step but the first was scheduled while another ran,
            # prefilling ones included.
            assert s.num_ahead_steps == s.num_steps - 1, (s.num_ahead_steps, s.num_steps)
            prefill_steps = [b for b in runner.batches[1:] if any(n > 1 for _, _, n in b)]
            assert len(prefill_steps) >= 4
        assert s.kv.allocator.num_free_pages + s.kv.cache.evictable_tokens == 512
    assert outputs[True] == outputs[False]
    assert outputs[True]["e"][1] == "stop" and outputs[True]["e"][0][-1] == 99
    assert outputs[True]["late"][0] == [45, 46, 47, 48, 49]


def test_prefix_cache_never_holds_a_placeholder_when_a_prefill_completes_ahead():
    """A prompt whose prefill completes in step N decodes in step N+1,
    scheduled before N's token is known; N's result then caches the prompt's
    KV, and must stop at what N computed (page size 1: the next position is
    the placeholder's)."""
    s, _ = _radix_scheduler(True, max_prefill=64)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=8, ignore_eos=True), seed=0)
    s.add(a)
    s.step()  # prefill of a launched, a's decode scheduled ahead (in flight), the prefill's token applied
    assert a.output_ids == [5] and a.kv_len == 5
    assert all(-1 not in seq for seq in _cached_sequences(s.kv.cache))
    b = Request("b", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=2, ignore_eos=True), seed=0)
    s.add(b)
    while s.has_work():
        s.step()
        s.check_integrity()
    assert a.output_ids == [5, 6, 7, 8, 9, 10, 11, 12] and b.output_ids == [6, 7]
