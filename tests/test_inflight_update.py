"""Weights updated while requests are under way: pause, update, continue.
Every request finishes; its tokens carry the version that produced them and
switch exactly once; with "retract" the tokens after the switch are what the
new model alone gives for the same prefix."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

NUM, LENGTH, SWITCH_AT = 32, 200, 50
PARAMS = SamplingParams(max_new_tokens=LENGTH, temperature=0, ignore_eos=True)


def _peaked(seed: int):
    return make_hf_model("llama", seed=seed, initializer_range=0.2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    first = save_model(_peaked(3), tmp_path_factory.mktemp("first"))
    second = _peaked(4)
    return first, second, save_model(second, tmp_path_factory.mktemp("second"))


def _prompts():
    return [[(5 * i + j) % 300 + 1 for j in range(4 + i % 5)] for i in range(NUM)]


def _update_mid_run(engine, mode: str, between=lambda e: None, new_weights=None):
    """Generate in a thread; after ~SWITCH_AT tokens each: pause, (between),
    update, continue. Returns the outputs."""
    outs: list = []
    worker = threading.Thread(target=lambda: outs.extend(engine.generate(input_ids=_prompts(),
                                                                          sampling_params=PARAMS)))
    worker.start()
    deadline = time.monotonic() + 120
    while engine.metrics()["output_tokens"] < NUM * SWITCH_AT and time.monotonic() < deadline:
        time.sleep(0.002)
    engine.pause_generation(mode)
    between(engine)
    engine.update_weights(new_weights)
    engine.continue_generation()
    worker.join(timeout=300)
    assert not worker.is_alive()
    return outs


def _switch_points(outs) -> list[int]:
    points = []
    for o in outs:
        v = o.output_weight_versions
        assert len(v) == len(o.output_token_ids) == LENGTH and o.finish_reason == "length"
        k = v.index(1) if 1 in v else len(v)
        assert v == [0] * k + [1] * (LENGTH - k), "the version switches exactly once"
        assert 0 < k < LENGTH
        points.append(k)
    return points


def _check_against_fresh(outs, points, second_folder, device: str, **kw):
    fresh = RolloutEngine(second_folder, device=device, max_total_tokens=65536, **kw)
    for o, k in zip(outs, points):
        cont = fresh.generate(input_ids=[o.prompt_token_ids + o.output_token_ids[:k]],
                              sampling_params=SamplingParams(max_new_tokens=LENGTH - k, temperature=0,
                                                             ignore_eos=True))[0]
        assert o.output_token_ids[k:] == cont.output_token_ids
    fresh.shutdown()


def test_retract_update_continue_on_cpu(models):
    first, second, second_folder = models
    engine = RolloutEngine(first, device="cpu", max_total_tokens=65536)
    outs = _update_mid_run(engine, "retract", new_weights=second.state_dict())
    points = _switch_points(outs)
    assert min(points) >= SWITCH_AT // 2
    _check_against_fresh(outs, points, second_folder, "cpu")
    engine.check_integrity()
    assert engine.num_unfinished_requests() == 0


def test_keep_update_continue_on_cpu(models):
    first, second, _ = models
    engine = RolloutEngine(first, device="cpu", max_total_tokens=65536)
    outs = _update_mid_run(engine, "keep", new_weights=second.state_dict())
    _switch_points(outs)
    engine.check_integrity()
    assert engine.num_unfinished_requests() == 0


@pytest.mark.gpu
def test_retract_release_resume_update_on_gpu(models):
    first, second, second_folder = models

    def release_and_resume(engine):
        assert engine.release_memory()["kv_cache"] > 0
        engine.resume_memory()

    engine = RolloutEngine(first, device="cuda", dtype="float32", attention_backend="torch", cuda_graph=False,
                           max_total_tokens=65536, enable_memory_saver=True)
    outs = _update_mid_run(engine, "retract", release_and_resume, {k: v.cuda() for k, v in second.state_dict().items()})
    points = _switch_points(outs)
    _check_against_fresh(outs, points, second_folder, "cuda", dtype="float32", attention_backend="torch",
                         cuda_graph=False)
    engine.check_integrity()
    engine.shutdown()
    torch.cuda.empty_cache()
