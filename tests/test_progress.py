"""Lines shown while a long step with nothing to count runs (the fused
all-reduce kernels' first build: tests/test_fused_norm_setup.py)."""
from __future__ import annotations

import logging
import subprocess
import sys
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


def test_a_quick_step_is_silent_where_asked_and_a_slow_one_still_shows(caplog):
    log = logging.getLogger("rollout_engine")
    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        with progress.Ticking(log, "starting", every_s=60, quiet_if_quick=True):
            pass
        assert caplog.records == []
        with progress.Ticking(log, "starting", every_s=0.05, quiet_if_quick=True):
            time.sleep(0.2)
        lines = [r.getMessage() for r in caplog.records]
        assert lines[0] == "starting: 0s so far" and lines[-1] == "starting: done in 0s", lines
        caplog.clear()
        with pytest.raises(KeyboardInterrupt), progress.Ticking(log, "starting", every_s=0.05, quiet_if_quick=True):
            time.sleep(0.2)
            raise KeyboardInterrupt
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.endswith(" so far") for line in lines), lines  # the caller says it stopped


def test_the_cli_says_so_while_an_engine_is_slow_to_start(smollm2_dir, monkeypatch, capsys, caplog):
    """`rollout-engine generate` shows a line while it starts, if it is slow;
    Ctrl-C then ends it with the one error line."""
    from rollout_engine import cli

    monkeypatch.setattr(cli, "STARTING_TICK_S", 0.05)

    def slow_engine(model, **kwargs):
        time.sleep(0.3)
        raise KeyboardInterrupt

    monkeypatch.setattr("rollout_engine.RolloutEngine", slow_engine)
    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        assert cli.main(["generate", "--model", smollm2_dir, "hi"]) == 130
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith(f"starting the engine ({smollm2_dir}): ") and line.endswith(" so far")
                         for line in lines), lines
    assert capsys.readouterr().err.strip().splitlines() == ["rollout-engine: error: interrupted"]


def test_durations_read_in_minutes_and_seconds():
    assert [progress._duration(s) for s in (0.2, 59.4, 60, 257.4)] == ["0s", "59s", "1m00s", "4m17s"]



BARS_AFTER_THE_READER_LEFT = """
import sys, threading
from rollout_engine import progress
progress.LOG_EVERY_S = 0.0  # a line at every update
def bars():
    with progress.Progress(total=3, desc="requests", unit="req") as bar:
        for _ in range(3):
            bar.update(1, tokens=5)
worker = threading.Thread(target=bars)  # the engine's bars run off the main thread
worker.start()
worker.join()
with progress.Progress(total=1, desc="again", unit="req") as bar:  # needs the lock the first one held
    bar.update(1)
print("done", flush=True)
"""


def test_a_bar_whose_stderr_reader_is_gone_leaves_no_lock_behind():
    # `rollout-engine generate ... 2>&1 | head -2`: tqdm writes under its lock and kept the lock when
    # the write raised, so the next bar of the process (or tqdm's own cleanup at exit) waited forever.
    proc = subprocess.Popen([sys.executable, "-c", BARS_AFTER_THE_READER_LEFT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stderr.close()  # the reader leaves before the first line
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the process hung on a lock a failed progress line left taken")
    assert proc.returncode == 0 and out.strip() == "done"
