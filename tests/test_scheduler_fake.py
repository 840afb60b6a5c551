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
from rollout_engine.scheduler.scheduler import Scheduler, SchedulerConfig
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
        if plan.prev_rows is not None:  # decode inputs: the tokens the previous step sampled
            inputs[ends - 1] = prev[plan.prev_rows]
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
