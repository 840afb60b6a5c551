"""Setting up the fused all-reduce + norm (distributed/fused_norm.py) as far
as the CPU can check it: FlashInfer's builder and the buffers replaced by
fakes, every rank agreeing with itself. What is said when the kernels are
built, and when the default falls back to separate steps."""
from __future__ import annotations

import logging
import sys
import time
import types

import pytest
import torch

from rollout_engine import progress
from rollout_engine.distributed import fused_norm
from rollout_engine.distributed.comm import TPComm


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FlashInfer's module builder, as far as `fused_norm._build_kernels`
    uses it: `compiled` says whether its JIT cache holds the kernels, a build
    takes 0.2 s, and `fails` makes it raise."""
    state = types.SimpleNamespace(compiled=False, builds=0, fails=None)

    def build():
        state.builds += 1
        time.sleep(0.2)
        if state.fails is not None:
            raise state.fails

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


class _Buffers:
    """Stands in for FusedAllReduceNorm (its buffers need GPUs)."""

    max_tokens = fused_norm.MAX_TOKENS

    def __init__(self, *args):
        pass


@pytest.fixture
def one_gpu_rank(monkeypatch):
    """make_fused_norm as rank 0 of two on a GPU, every agreement its own."""
    monkeypatch.setattr(fused_norm, "agree_everywhere", lambda ok, group, device: bool(ok))
    monkeypatch.setattr(fused_norm, "FusedAllReduceNorm", _Buffers)
    monkeypatch.delenv("ROLLOUT_ENGINE_ALLREDUCE", raising=False)
    return TPComm(0, 2, group=object())


def _setup(comm, caplog, hidden=4096):
    with caplog.at_level(logging.INFO, logger="rollout_engine"):
        made = fused_norm.make_fused_norm(comm, hidden, torch.bfloat16, torch.device("cuda"))
    fused_norm._OPEN.pop(id(comm.group), None)
    return made, [(r.levelno, r.getMessage()) for r in caplog.records]


def test_the_default_sets_up_the_kernel_where_it_builds(fake_flashinfer, one_gpu_rank, caplog):
    fake_flashinfer.compiled = True
    made, lines = _setup(one_gpu_rank, caplog)
    assert isinstance(made, _Buffers)
    assert [level for level, _ in lines] == [logging.INFO]


@pytest.mark.parametrize("asked", ["", "fused"], ids=["unset", "fused"])
def test_a_failed_build_is_a_warning_that_says_why(fake_flashinfer, one_gpu_rank, caplog, monkeypatch, asked):
    monkeypatch.setenv("ROLLOUT_ENGINE_ALLREDUCE", asked)
    fake_flashinfer.fails = RuntimeError("nvcc: not found")
    made, lines = _setup(one_gpu_rank, caplog)
    assert made is None
    level, last = lines[-1]
    assert level == logging.WARNING and "no fused all-reduce + norm here (nvcc: not found)" in last, lines
    assert "ROLLOUT_ENGINE_ALLREDUCE=one-shot" in last


@pytest.mark.parametrize("asked,level", [("", logging.INFO), ("fused", logging.WARNING)], ids=["unset", "fused"])
def test_without_flashinfer_the_default_falls_back_quietly(one_gpu_rank, caplog, monkeypatch, asked, level):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # an import of it raises ImportError
    monkeypatch.setenv("ROLLOUT_ENGINE_ALLREDUCE", asked)
    made, lines = _setup(one_gpu_rank, caplog)
    assert made is None and [lv for lv, _ in lines] == [level], lines


def test_a_shape_the_kernel_does_not_take_falls_back_quietly_without_building(fake_flashinfer, one_gpu_rank, caplog):
    made, lines = _setup(one_gpu_rank, caplog, hidden=4100)  # not a multiple of 8
    assert made is None and fake_flashinfer.builds == 0
    assert lines == [(logging.INFO, "tensor parallelism: no fused all-reduce + norm here (tp_size 2, hidden size "
                                    "4100); the all-reduce and the norm stay separate, as with "
                                    "ROLLOUT_ENGINE_ALLREDUCE=one-shot")]
