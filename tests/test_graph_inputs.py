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
