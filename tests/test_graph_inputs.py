"""The static inputs of a captured decode graph: one block per batch-size
bucket, filled from a plan with one copy (runner/cuda_graph.py)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout_engine.runner.cuda_graph import StaticInputs


@pytest.mark.parametrize("bucket,rows", [(1, 1), (2, 1), (8, 5), (16, 16), (48, 33)])
def test_a_plan_fills_its_rows_and_zeroes_the_padding(bucket, rows):
    inp = StaticInputs(bucket, torch.device("cpu"))
    inp.block.fill_(-1)  # what an earlier, larger batch left behind
    plan = SimpleNamespace(batch_size=rows, input_ids=np.arange(rows) + 1000, positions=np.arange(rows) + 7,
                           out_cache_loc=np.arange(rows) * 3 + 1, rows=np.arange(rows) + 2)
    inp.fill(plan)
    pad = bucket - rows
    assert inp.input_ids.tolist() == list(range(1000, 1000 + rows)) + [0] * pad
    assert inp.positions.tolist() == list(range(7, 7 + rows)) + [0] * pad
    assert inp.out_cache_loc.tolist() == [3 * i + 1 for i in range(rows)] + [0] * pad  # padding: the reserved page
    assert inp.rows.tolist() == list(range(2, 2 + rows)) + [0] * pad
    assert inp.rows.dtype == torch.int32 and inp.input_ids.dtype == torch.int64
    views = (inp.input_ids, inp.positions, inp.out_cache_loc, inp.rows)
    assert all(v.data_ptr() % 16 == 0 and v.is_contiguous() and v.numel() == bucket for v in views)


@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_arrays_of_mixed_types_travel_in_one_aligned_block(n):
    from rollout_engine.host_block import BlockLayout

    layout = BlockLayout((np.int64, np.int32, np.float32, np.float64, np.bool_), (n,) * 5)
    arrays = (np.arange(n) + 5, np.arange(n) + 9, np.arange(n) / 3, np.arange(n) / 7, np.arange(n) % 2 == 0)
    views = layout.upload(arrays, torch.device("cpu"))
    for view, values, dtype in zip(views, arrays, layout.dtypes):
        assert np.array_equal(view.numpy(), np.asarray(values, dtype=dtype)) and view.data_ptr() % 16 == 0
    # written into a block that held something else: the arrays, zeros after them
    out = np.full(layout.words, -1, dtype=np.int64)
    layout.host((np.arange(n // 2),) * 5, out=out)
    assert all(v.tolist() == list(range(n // 2)) + [0] * (n - n // 2)
               for v in layout.views(torch.from_numpy(out))[:2])


@pytest.mark.parametrize("bucket,rows,greedy", [(1, 1, False), (8, 5, False), (16, 9, True), (48, 33, False)])
def test_a_sampled_plan_fills_the_tails_rows_and_pads_them_greedy(bucket, rows, greedy):
    """With a tail (LM head and sampling in the graph), the block also holds
    each row's temperature, seeded uniform and raw-logprob flag; padding
    rows are greedy (temperature 0) and draw nothing."""
    from rollout_engine.plan import SamplingPlan
    from rollout_engine.runner.sampler import seeded_uniform

    inp = StaticInputs(bucket, torch.device("cpu"), sampling=True)
    inp.block.fill_(-1)
    temps = np.zeros(rows, np.float32) if greedy else ((np.arange(rows) + 1) % 3 * 0.5).astype(np.float32)
    seeds, positions = np.arange(rows) + 11, np.arange(rows) + 40
    ones, zeros = np.ones(rows, np.float32), np.zeros(rows, np.int64)
    sampling = SamplingPlan(temperatures=temps, top_ps=ones, min_ps=ones * 0, top_ks=zeros, seeds=seeds,
                            positions=positions, raw_logprobs=np.arange(rows) % 2 == 0, top_logprobs=zeros)
    plan = SimpleNamespace(batch_size=rows, input_ids=np.arange(rows), positions=positions,
                           out_cache_loc=np.arange(rows) + 1, rows=np.arange(rows), sampling=sampling)
    inp.fill(plan, sampling=True)
    pad = bucket - rows
    assert inp.temperatures.tolist() == temps.tolist() + [0.0] * pad
    uniforms = np.zeros(rows) if greedy else seeded_uniform(seeds, positions)
    assert inp.uniforms.tolist() == uniforms.tolist() + [0.0] * pad
    assert inp.raw_logprobs.tolist() == [i % 2 == 0 for i in range(rows)] + [False] * pad
    assert inp.input_ids.tolist() == list(range(rows)) + [0] * pad
    views = (inp.input_ids, inp.rows, inp.temperatures, inp.uniforms, inp.raw_logprobs)
    assert all(v.data_ptr() % 16 == 0 and v.numel() == bucket for v in views)
    # a plan the tail does not sample fills the indices only
    inp.fill(plan)
    assert inp.temperatures.tolist() == [0.0] * bucket and inp.input_ids.tolist() == list(range(rows)) + [0] * pad


def test_a_tail_step_is_read_from_its_bucket_rows_and_its_buffer_goes_back_to_the_pool():
    """A graph tail packs a bucket's tokens then its logprobs (`bucket` each):
    collecting a step of 5 rows in the 8 bucket reads the first 5 of each,
    and the pinned buffer returns to the runner's pool for the next step,
    the values already copied out."""
    from rollout_engine.plan import SamplingPlan
    from rollout_engine.runner.model_runner import ModelRunner, StepHandle

    rows, bucket = 5, 8
    zeros = np.zeros(rows, np.int64)
    sampling = SamplingPlan(temperatures=np.ones(rows, np.float32), top_ps=np.ones(rows, np.float32),
                            min_ps=np.zeros(rows, np.float32), top_ks=zeros, seeds=zeros, positions=zeros,
                            raw_logprobs=zeros.astype(bool), top_logprobs=zeros)
    plan = SimpleNamespace(batch_size=rows, sampling=sampling)
    host = torch.full((2 * bucket,), -9.0, dtype=torch.float64)
    host[:rows] = torch.arange(rows) + 100
    host[bucket: bucket + rows] = -torch.arange(rows) / 4
    runner = ModelRunner.__new__(ModelRunner)  # the collect path alone: no model
    runner._events, runner._pinned = [], {bucket: []}
    out = runner.collect(StepHandle(plan, None, host, None, bucket))
    assert out.tokens.tolist() == [100, 101, 102, 103, 104] and out.tokens.dtype == np.int64
    assert out.logprobs.tolist() == [0.0, -0.25, -0.5, -0.75, -1.0] and len(out.prompt_logprobs) == 0
    assert runner._pinned[bucket] == [host]
    host.fill_(7.0)  # the next step's copy into the reused buffer leaves this step's results as they were
    assert out.tokens.tolist() == [100, 101, 102, 103, 104] and out.logprobs[1] == -0.25
