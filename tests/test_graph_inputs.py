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
