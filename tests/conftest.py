from __future__ import annotations

import os
import signal
import sys
import threading

# Many tests start several processes (TP ranks, servers, Ray replicas) on a
# machine with few cores: OpenMP threads that spin while they wait would take
# the cores from the processes doing work. Set before torch loads OpenMP, and
# inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from models import MOE, make_hf_model, save_model  # noqa: E402


# Ctrl-C stops the run even where a test calls code that turns KeyboardInterrupt into a result (the CLI's
# main() answers it with status 130): a real SIGINT is noted here, and the run stops after that test.
_ctrl_c = threading.Event()


def _on_sigint(signum, frame):
    _ctrl_c.set()
    raise KeyboardInterrupt


def pytest_sessionstart(session):
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is \
            signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    result = yield
    if _ctrl_c.is_set():
        item.session.shouldstop = "interrupted (Ctrl-C)"
    return result


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _fused_allreduce_kernels_built(request):
    """Build FlashInfer's fused all-reduce + norm kernels once, before the
    first multi-GPU test, where the run selected any and takes the fused
    path (ROLLOUT_ENGINE_ALLREDUCE fused or unset): on a fresh machine the
    build takes 4 to 5 minutes, longer than the time limit a multi-GPU test
    gives the engine it starts. A no-op elsewhere."""
    if not any(item.get_closest_marker("multigpu") for item in request.session.items):
        return
    if torch.cuda.device_count() < 2:
        return
    from rollout_engine.distributed.fast_allreduce import allreduce_mode

    if allreduce_mode() != "fused":  # the run asked for another path: only a test naming fused builds them
        return
    try:
        from rollout_engine.distributed.fused_norm import _build_kernels

        _build_kernels(first=True)
    except Exception:  # noqa: BLE001 - no FlashInfer, or a failed build: the tests that need it say so
        pass


MODEL_KINDS = [("llama", False), ("llama3", True), ("qwen2", True), ("qwen3", False)]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """(kind, tie) -> (hf_model, folder)."""
    out = {}
    for kind, tie in MODEL_KINDS:
        hf = make_hf_model(kind, tie)
        folder = save_model(hf, tmp_path_factory.mktemp(f"{kind}-{tie}"))
        out[(kind, tie)] = (hf, folder)
    return out


@pytest.fixture(scope="session")
def llama(tiny_models):
    return tiny_models[("llama", False)]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a `rollout-engine` command gets as far as building an
    engine."""
    from rollout_engine import cli

    def refuse(config):
        raise AssertionError(f"the model was loaded: {config}")
    monkeypatch.setattr(cli, "_make_engine", refuse)


@pytest.fixture(scope="session")
def smollm2_dir():
    from rollout_engine.model_zoo import ensure_model

    return ensure_model("smollm2-135m", quiet=True)


def run_checked(engine, reqs, max_steps=100_000):
    """Step the engine (manually, on its loop thread) until `reqs` finish,
    checking KV integrity after every step; then the loop steps on its own
    again. Returns the number of steps."""
    steps = 0
    while not all(r.finished for r in reqs):
        engine.core.step_once()
        engine.check_integrity()
        steps += 1
        assert steps < max_steps
    engine.core.set_manual(False)
    return steps


def submit_manual(engine, prompts, input_ids, params, request_ids=None):
    """Queue requests that only `step_once()` steps (manual mode ends after
    the test)."""
    engine.core.set_manual(True)
    return engine.core.add_requests(prompts, input_ids, params, request_ids)


@pytest.fixture(autouse=True)
def _automatic_stepping_after_each_test():
    yield
    from rollout_engine.core.live import live_cores

    for core in live_cores():
        if core.manual:
            core.set_manual(False)


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    """The tiny MoE models of tests/models.py: kind -> (HF model, folder of its
    checkpoint, per-expert names)."""
    out = {}
    for kind in sorted(MOE):
        hf = make_hf_model(kind, seed=5)
        out[kind] = (hf, save_model(hf, tmp_path_factory.mktemp(kind)))
    return out
