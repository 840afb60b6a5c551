"""Release/resume state machine on the CPU, with a fake saver that really
loses a tag's contents on pause (and restores them only with a CPU backup)."""
from __future__ import annotations

import pytest
import torch

import rollout_engine.core.build as engine_module
from conftest import submit_manual
from rollout_engine import RolloutEngine, SamplingParams


class FakeSaver:
    """Emulates unmapping: pause zeroes the tag's tensors (keeping a copy when
    the region asked for a CPU backup), resume restores the copy or leaves
    garbage. Pausing a paused tag would crash the real library: fail loudly."""

    pauses_graphs = False

    def __init__(self):
        self.manager = None
        self.backup_tags: set[str] = set()
        self.saved: dict[str, list[torch.Tensor]] = {}
        self.paused: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def region(self, tag, cpu_backup):
        if cpu_backup:
            self.backup_tags.add(tag)
        import contextlib
        return contextlib.nullcontext()

    def pause(self, tag):
        assert tag not in self.paused, f"pause of a paused tag {tag} would exit the process"
        self.calls.append(("pause", tag))
        tensors = self.manager.tensors(tag)
        if tag in self.backup_tags:
            self.saved[tag] = [t.detach().clone() for t in tensors]
        with torch.no_grad():
            for t in tensors:
                t.fill_(float("nan") if t.is_floating_point() else 0)
        self.paused.add(tag)

    def resume(self, tag):
        assert tag in self.paused, f"resume of a resident tag {tag} would exit the process"
        self.calls.append(("resume", tag))
        with torch.no_grad():
            for t, saved in zip(self.manager.tensors(tag), self.saved.pop(tag, [])):
                t.copy_(saved)
        self.paused.discard(tag)


@pytest.fixture
def make_engine(monkeypatch, llama):
    _, folder = llama

    def make(**kw):
        fake = FakeSaver()
        monkeypatch.setattr(engine_module, "create_saver", lambda enabled, device: fake)
        engine = RolloutEngine(folder, max_total_tokens=4096, **kw)
        fake.manager = engine.core.parts.memory
        return engine, fake

    return make


PARAMS = SamplingParams(max_new_tokens=16, temperature=0)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def test_round_trip_with_cpu_backup_gives_identical_outputs(make_engine):
    engine, fake = make_engine(weights_cpu_backup=True)
    before = [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
    assert engine.cache_stats()["cached_tokens"] > 0
    for _ in range(50):
        freed = engine.release_memory()
        assert engine.memory_state() == {"weights": "released", "kv_cache": "released"}
        assert freed["weights"] == sum(p.numel() * 4 for p in engine.core.parts.model.parameters())
        assert freed["kv_cache"] == engine.core.parts.kv_pool.nbytes
        assert engine.cache_stats()["cached_tokens"] == 0  # the prefix cache went with the KV cache
        engine.resume_memory()
        assert engine.memory_state() == {"weights": "resident", "kv_cache": "resident"}
        after = [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
        assert after == before
    engine.check_integrity()
    assert not fake.paused


def test_buffers_that_are_not_weights_survive(make_engine):
    engine, _ = make_engine(weights_cpu_backup=False)
    cos = engine.core.parts.model.model.layers[0].self_attn.rotary.cos.clone()
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    assert torch.equal(engine.core.parts.model.model.layers[0].self_attn.rotary.cos, cos)


def test_wrong_order_calls_are_runtime_errors(make_engine):
    engine, fake = make_engine()
    with pytest.raises(RuntimeError, match="already resident"):
        engine.resume_memory(["kv_cache"])
    engine.release_memory(["kv_cache"])
    with pytest.raises(RuntimeError, match="already released"):
        engine.release_memory(["kv_cache"])
    with pytest.raises(RuntimeError, match="already released"):
        engine.release_memory()  # all-or-nothing: weights stay resident
    assert engine.memory_state()["weights"] == "resident"
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] released"):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    with pytest.raises(ValueError, match="tags: unknown"):
        engine.release_memory(["activations"])
    engine.resume_memory(["kv_cache"])
    assert len(engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)) == 2
    assert fake.calls == [("pause", "kv_cache"), ("resume", "kv_cache")]


def test_weights_without_backup_must_be_replaced_before_generating(make_engine):
    engine, _ = make_engine(weights_cpu_backup=False)
    engine.release_memory(["weights"])
    with pytest.raises(RuntimeError, match=r"\['weights'\] released"):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    engine.resume_memory(["weights"])
    with pytest.raises(RuntimeError, match="without weights_cpu_backup"):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    from rollout_engine.weights.loader import iter_safetensors

    partial = [(n, t) for n, t in iter_safetensors(engine.config.model) if "layers.0." in n]
    engine.update_weights(partial)
    with pytest.raises(RuntimeError, match="are not usable"):  # still incomplete
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    engine.update_weights_from_disk(engine.config.model)
    assert len(engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)) == 2


def test_release_refuses_while_requests_run_unless_paused(make_engine):
    engine, _ = make_engine(weights_cpu_backup=True)
    reqs = submit_manual(engine, None, PROMPTS, SamplingParams(max_new_tokens=50), None)
    engine.core.step_once()
    with pytest.raises(RuntimeError, match="pause_generation"):
        engine.release_memory()
    engine.pause_generation(mode="keep")
    with pytest.raises(RuntimeError, match="still hold the KV cache"):
        engine.release_memory()
    assert engine.release_memory(["weights"])["weights"] > 0  # weights can go while requests wait
    engine.resume_memory(["weights"])
    with pytest.raises(RuntimeError, match="paused"):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    engine.pause_generation(mode="abort")
    assert all(r.finish_reason == "abort" for r in reqs)
    engine.release_memory()
    engine.resume_memory()
    engine.continue_generation()
    engine.core.set_manual(False)
    assert len(engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)) == 2


def test_pause_keep_then_continue_finishes_the_requests(make_engine):
    engine, _ = make_engine()
    reqs = submit_manual(engine, None, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0), None)
    engine.core.step_once()
    engine.pause_generation(mode="keep")
    produced = [r.num_output_tokens for r in reqs]
    engine.continue_generation()
    while not all(r.finished for r in reqs):
        engine.core.step_once()
    assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in reqs)
    assert all(p >= 1 for p in produced)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_a_gpu_attention_backend_on_the_cpu_is_refused_before_the_weights_load(llama, backend, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the backend was checked")

    monkeypatch.setattr(engine_module, "load_model", no_load)
    with pytest.raises(ValueError, match=f"attention_backend '{backend}' needs a CUDA device"):
        RolloutEngine(llama[1], device="cpu", attention_backend=backend, max_total_tokens=1024)


def test_controls_need_the_memory_saver(llama):
    engine = RolloutEngine(llama[1], max_total_tokens=1024)
    with pytest.raises(RuntimeError, match="enable_memory_saver=True"):
        engine.release_memory()
    with pytest.raises(ValueError, match="enable_memory_saver needs a CUDA device"):
        RolloutEngine(llama[1], max_total_tokens=1024, enable_memory_saver=True)
    with pytest.raises(ValueError, match="mode must be"):
        engine.pause_generation("sleep")


def test_preload_launcher_environment(tmp_path):
    from rollout_engine.memory.launch import preload_env, preload_library

    (tmp_path / "torch_memory_saver_hook_mode_preload_cu13.abi3.so").write_bytes(b"")
    (tmp_path / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    lib = preload_library(tmp_path, cuda_major=13)
    env = preload_env({"LD_PRELOAD": "/x/other.so", "PATH": "/bin"}, lib, tmp_path, 13)
    assert env["LD_PRELOAD"] == f"{lib}:/x/other.so"
    assert env["LD_LIBRARY_PATH"] == str(tmp_path / "nvidia" / "cu13" / "lib")
    assert env["PATH"] == "/bin"
    with pytest.raises(RuntimeError, match="no preload hook for CUDA 12"):
        preload_library(tmp_path, cuda_major=12)


class FakeGraphs:
    prompt = None  # no prompt graphs
    samples = False

    def __init__(self):
        self.calls = []

    def can_run(self, plan) -> bool:  # every step eagerly
        return False

    def destroy(self):
        self.calls.append("destroy")

    def capture(self):
        self.calls.append("capture")


@pytest.mark.parametrize("mode", ["pause", "keep", "recapture"])
def test_graph_modes(make_engine, mode):
    """pause: the saver unmaps the graph region; keep: graphs untouched, 0
    bytes freed; recapture: destroyed on release, captured on resume."""
    from rollout_engine.memory.controller import MemoryController

    engine, fake = make_engine(weights_cpu_backup=True)
    graphs = FakeGraphs()
    engine.core.parts.runner.graphs = graphs
    engine.core.parts.memory.register("cuda_graph", extra_bytes=1234)
    parts = engine.core.parts
    c = parts.controller
    parts.controller = MemoryController(parts.memory, parts.scheduler, parts.prefix_cache, parts.runner,
                                        engine.device, True, c.validity, graph_mode=mode)
    freed = engine.release_memory(["cuda_graph"])
    assert engine.memory_state()["cuda_graph"] == "released"
    assert freed == {"cuda_graph": 0 if mode == "keep" else 1234}
    with pytest.raises(RuntimeError, match="already released"):
        engine.release_memory(["cuda_graph"])
    if mode == "pause":  # the graphs' memory is unmapped: replaying them would read and write none
        with pytest.raises(RuntimeError, match=r"cannot generate: \['cuda_graph'\] released"):
            engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    else:  # kept whole, or destroyed (steps run eagerly until they are captured again)
        assert len(engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)) == 2
    engine.resume_memory(["cuda_graph"])
    assert engine.memory_state()["cuda_graph"] == "resident"
    assert graphs.calls == {"pause": [], "keep": [], "recapture": ["destroy", "capture"]}[mode]
    saver_calls = [c for c in fake.calls if c[1] == "cuda_graph"]
    assert saver_calls == ([("pause", "cuda_graph"), ("resume", "cuda_graph")] if mode == "pause" else [])
    engine.core.parts.runner.graphs = None
    assert len(engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)) == 2
    with pytest.raises(ValueError, match="graph_mode"):
        MemoryController(parts.memory, parts.scheduler, parts.prefix_cache, parts.runner, engine.device,
                         True, c.validity, graph_mode="drop")


def test_pause_retract_releases_kv_while_requests_wait(make_engine, llama):
    """Requests give their KV back, the KV cache (and weights) are released
    and resumed, new weights arrive, and the requests finish from where they
    were, the rest of their tokens from the new weights."""
    from models import make_hf_model

    engine, _ = make_engine(weights_cpu_backup=True)
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    alone = engine.generate(input_ids=PROMPTS, sampling_params=params)
    reqs = submit_manual(engine, None, PROMPTS, params, None)
    for _ in range(4):
        engine.core.step_once()
    produced = [list(r.output_ids[: r.num_output_tokens]) for r in reqs]
    engine.pause_generation(mode="retract")
    assert not engine.core.scheduler.running and len(engine.core.scheduler.waiting) == len(reqs)
    engine.release_memory()
    engine.resume_memory()
    engine.continue_generation()
    while not all(r.finished for r in reqs):  # same weights: the same tokens as without the pause
        engine.core.step_once()
    assert [r.output_ids for r in reqs] == [o.output_token_ids for o in alone]

    reqs = submit_manual(engine, None, PROMPTS, params, None)
    for _ in range(4):
        engine.core.step_once()
    engine.pause_generation(mode="retract")
    done = [r.num_output_tokens for r in reqs]  # a step in flight was settled by the pause
    engine.release_memory(["kv_cache"])
    engine.update_weights(make_hf_model("llama", seed=9).state_dict())
    engine.resume_memory(["kv_cache"])
    engine.continue_generation()
    while not all(r.finished for r in reqs):
        engine.core.step_once()
    for r, n in zip(reqs, done):
        assert r.output_weight_versions == [0] * n + [1] * (20 - n)
    engine.check_integrity()
    assert all(p for p in produced)
