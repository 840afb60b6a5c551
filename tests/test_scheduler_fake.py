"""The scheduler with a fake runner: no model, just the step logic."""
from __future__ import annotations

from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.prefix_cache import NoPrefixCache
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.request import Request
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.scheduler import Scheduler, SchedulerConfig, SeqResult
from rollout_engine.scheduler.stop import StopChecker


class FakeRunner:
    """Next token = (last token + 1) % 100; records every batch."""

    def __init__(self):
        self.batches = []

    def launch(self, batch, prev=None):
        self.batches.append([(s.req.request_id, s.start, s.extend_len) for s in batch.seqs])
        return batch

    def collect(self, batch):  # by now every input token of the batch is known
        return [SeqResult(token=(s.req.all_ids[s.end - 1] + 1) % 100, logprob=-1.0) if s.samples else SeqResult()
                for s in batch.seqs]


def _scheduler(num_pages=64, max_prefill=32, max_running=8, eos=(99,)):
    alloc = PageAllocator(num_pages, 1)
    kv = KVManager(alloc, ReqToTokenTable(max_running, 256), NoPrefixCache(alloc))
    runner = FakeRunner()
    return Scheduler(SchedulerConfig(max_running, max_prefill), kv, runner, StopChecker(eos, 256)), runner


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
