"""The StepPlan seam: plans are plain data (they pickle), and a second
runner on the same weights, given a run's plans in order, computes the same
tokens: what tensor-parallel ranks will rely on."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.core.build import replica_runner
from rollout_engine.plan import StepPlan


class Recorder:
    """Wraps a runner; keeps every launched plan (pickled) and its tokens."""

    def __init__(self, inner):
        self.inner = inner
        self.log: list[list] = []

    def launch(self, plan, prev=None):
        entry = [pickle.dumps(plan), None]
        self.log.append(entry)
        return self.inner.launch(plan, None if prev is None else prev[0]), entry

    def collect(self, handle):
        inner, entry = handle
        out = self.inner.collect(inner)
        entry[1] = out
        return out


def _workload(engine):
    system = list(range(10, 40))
    engine.generate(input_ids=[system + [1, 2], system + [3]], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=True))
    engine.generate(input_ids=[system + [4, 5, 6], [7, 8]], sampling_params=SamplingParams(
        n=3, max_new_tokens=20, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, top_logprobs=3))
    engine.generate(input_ids=[list(range(50, 120))], sampling_params=SamplingParams(
        max_new_tokens=9, temperature=0.7, top_k=20, ignore_eos=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_plans_replay_on_a_second_runner(llama, device):
    _, folder = llama
    kw = dict(max_prefill_tokens=48) if device == "cpu" else dict(dtype="bfloat16", max_prefill_tokens=48, cuda_graph=False)
    engine = RolloutEngine(folder, device=device, max_total_tokens=4096, **kw)
    sched = engine.core.scheduler
    recorder = Recorder(sched.runner)
    engine.core.call(lambda: setattr(sched, "runner", recorder))
    _workload(engine)
    engine.core.call(lambda: setattr(sched, "runner", recorder.inner))
    assert any(pickle.loads(b).prev_rows is not None for b, _ in recorder.log)  # overlap steps included
    assert any(len(pickle.loads(b).prompt_rows) for b, _ in recorder.log)
    assert any(not pickle.loads(b).is_decode and pickle.loads(b).batch_size > 1 for b, _ in recorder.log)

    replica = replica_runner(engine.core.parts)
    prev = None
    for blob, out in recorder.log:
        plan = pickle.loads(blob)
        assert isinstance(plan, StepPlan)
        again, prev = replica.run(plan, prev)
        assert np.array_equal(again.tokens, out.tokens)
        assert np.array_equal(again.logprobs, out.logprobs)
        assert np.array_equal(again.prompt_logprobs, out.prompt_logprobs)
    engine.shutdown()
    if device == "cuda":
        torch.cuda.empty_cache()
