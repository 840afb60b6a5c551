"""Differential stress on the CPU: random call sequences on one long-lived
engine (fp32, torch backend), every output checked against Hugging Face
teacher-forced (tests/differential.py). Catches scheduling, prefix-cache,
retraction and abort bugs that hand a request another request's KV."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from differential import Reference, WorkloadGenerator, stress
from models import make_hf_model, save_model
from rollout_engine import RolloutEngine
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.forward_batch import TableMirror


@pytest.mark.parametrize("kind,page_size", [("llama", 1), ("qwen3", 16)])
def test_random_call_sequences_match_the_reference(tmp_path, kind, page_size):
    hf = make_hf_model(kind, seed=3)
    folder = save_model(hf, tmp_path / kind)
    # A tight pool (retractions, evictions) and small prefill chunks.
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=400, max_prefill_tokens=48, page_size=page_size,
                           max_running_requests=24)
    gen = WorkloadGenerator(seed=page_size, token_range=(0, 512), max_prompt_len=60, max_new_tokens=40,
                            max_batch=16)
    report = stress(engine, Reference(hf, "cpu"), gen, num_calls=80, margin=1e-3, logprob_tol=1e-3)
    print(report.summary())
    assert not report.violations, report.violations[:5]
    stats = engine.cache_stats()
    print(stats)
    assert stats["retractions"] > 0 and stats["hit_rate"] > 0.1 and report.aborted > 0


def _row_written_twice(table: ReqToTokenTable) -> None:
    row = table.alloc_row()
    table.write(row, 0, np.arange(100, 140))  # the old request
    table.free_row(row)
    row = table.alloc_row()
    table.write(row, 0, np.arange(500, 520))  # the new one, its prefix from the cache


def test_table_sync_sends_current_values_for_cells_written_twice():
    """A row freed and handed to another request between two steps is
    written twice; a device scatter applies duplicates in no defined order,
    so each drained entry must carry the cell's current value."""
    table = ReqToTokenTable(4, 64)
    table.track_writes()
    _row_written_twice(table)
    writes = table.drain_writes()
    assert (writes[2] == table.table[writes[0], writes[1]]).all()

    table = ReqToTokenTable(4, 64)
    table.track_writes()
    mirror = TableMirror(4, 64, torch.device("cpu"), on_device=True, on_host=True)
    _row_written_twice(table)
    writes = table.drain_writes()
    mirror.apply(writes)
    assert np.array_equal(mirror.host, table.table)
    assert np.array_equal(mirror.tensor.numpy(), table.table.astype(np.int32))


def test_table_without_a_mirror_keeps_no_write_log():
    table = ReqToTokenTable(2, 16)
    for _ in range(1000):
        table.write(0, 0, np.arange(16))
    assert table.drain_writes() is None
