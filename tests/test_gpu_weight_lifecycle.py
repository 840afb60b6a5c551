"""The weight lifecycle on the GPU: the soak cycle (release -> the trainer
uses the memory -> resume -> full update -> generate) keeps memory flat and
outputs equal, with CUDA graphs; refusals leave the weights untouched."""
from __future__ import annotations

import pytest
import torch

from rollout_engine import RolloutEngine

pytestmark = pytest.mark.gpu


def test_soak_cycles_keep_memory_flat_and_outputs_equal():
    pytest.importorskip("torch_memory_saver")
    from rollout_engine.bench.soak import run_soak

    engine = RolloutEngine("qwen3-0.6b", load_format="dummy", enable_memory_saver=True, weights_cpu_backup=False,
                           max_total_tokens=32768)
    try:
        prompts = [list(range(1, 33)), list(range(100, 200)), [5, 6, 7]]
        report = run_soak(engine, 200, prompts)
        assert report["outputs_equal"], report["unequal_cycles"]
        assert report["memory_flat"], report["resume_used_MiB"]
    finally:
        engine.shutdown()


def test_refused_updates_leave_the_weights_bitwise_as_they_were():
    engine = RolloutEngine("qwen3-0.6b", load_format="dummy", max_total_tokens=8192)
    try:
        before = engine.weights_checksum()
        name = "model.layers.3.mlp.up_proj.weight"
        good = engine.get_weight(name)
        nan = good.clone()
        nan[7, 7] = float("nan")
        with pytest.raises(ValueError, match=f"{name}: holds NaN"):
            engine.update_weights([("model.norm.weight", engine.get_weight("model.norm.weight") * 2), (name, nan)])
        overflow = good.float().clone()
        overflow[0, 0] = 3.4e38  # finite in float32, infinite in the engine's bfloat16
        with pytest.raises(ValueError, match=f"{name}: holds NaN"):
            engine.update_weights({name: overflow})
        assert engine.weights_checksum() == before and engine.weight_version == 0
        assert engine.update_weights({name: good * 0.5}) == 1
        after = engine.weights_checksum([name])
        assert after[name] != before[name]
    finally:
        engine.shutdown()
