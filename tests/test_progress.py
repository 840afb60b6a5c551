"""Lines shown while a long step with nothing to count runs (the fused
all-reduce kernels' first build: tests/test_fused_norm_setup.py)."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from rollout_engine import progress


def test_ticking_says_how_long_so_far_then_how_long_it_took(caplog):
    log = logging.getLogger("rollout_engine")
    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        with progress.Ticking(log, "building things", every_s=0.05):
            time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("building things: ") and line.endswith(" so far") for line in lines) >= 2, lines
    assert lines[-1] == "building things: done in 0s", lines
    assert not any(t.name == "rollout-engine-ticking" for t in threading.enumerate())  # the ticker ended


def test_ticking_says_when_the_step_failed_and_lets_the_error_through(caplog):
    log = logging.getLogger("rollout_engine")
    with caplog.at_level(logging.WARNING, logger="rollout_engine"), pytest.raises(KeyboardInterrupt):
        with progress.Ticking(log, "building things", every_s=60):
            raise KeyboardInterrupt
    assert [r.getMessage() for r in caplog.records] == ["building things: stopped after 0s"]


def test_durations_read_in_minutes_and_seconds():
    assert [progress._duration(s) for s in (0.2, 59.4, 60, 257.4)] == ["0s", "59s", "1m00s", "4m17s"]
