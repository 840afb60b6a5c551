"""Lines shown while a long step with nothing to count runs (the fused
all-reduce kernels' first build)."""
from __future__ import annotations

import logging
import sys
import threading
import time
import types

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


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer's module builder, as far as `fused_norm._build_kernels`
    uses it: `compiled` says whether its JIT cache holds the kernels, and a
    build takes 0.2 s."""
    state = types.SimpleNamespace(compiled=False, builds=0)

    def build():
        state.builds += 1
        time.sleep(0.2)

    trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")
    trtllm_ar.get_trtllm_comm_module = build
    jit_comm = types.ModuleType("flashinfer.jit.comm")
    jit_comm.gen_trtllm_comm_module = lambda: types.SimpleNamespace(is_compiled=state.compiled)
    for name, module in {"flashinfer": types.ModuleType("flashinfer"),
                         "flashinfer.comm": types.ModuleType("flashinfer.comm"),
                         "flashinfer.jit": types.ModuleType("flashinfer.jit"),
                         "flashinfer.comm.trtllm_ar": trtllm_ar, "flashinfer.jit.comm": jit_comm}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)
    return state


@pytest.mark.parametrize("first,compiled,shown", [(True, False, True), (True, True, False), (False, False, False)])
def test_a_cold_build_of_the_fused_kernels_is_announced_and_timed_by_the_first_rank(fake_flashinfer, caplog, first,
                                                                                    compiled, shown):
    from rollout_engine.distributed import fused_norm

    fake_flashinfer.compiled = compiled
    with caplog.at_level(logging.WARNING, logger="rollout_engine"):
        fused_norm._build_kernels(first=first)
    lines = [r.getMessage() for r in caplog.records]
    assert fake_flashinfer.builds == 1  # every rank loads the kernels
    if not shown:
        assert lines == []
        return
    assert "first use on this machine" in lines[0] and "ROLLOUT_ENGINE_ALLREDUCE=one-shot skips them" in lines[0]
    assert any(line.endswith(" so far") for line in lines[1:-1]), lines
    assert lines[-1].startswith("building FlashInfer's fused all-reduce + norm kernels: done in "), lines
