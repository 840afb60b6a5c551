"""What the engine says on its logger ("rollout_engine"): at INFO what it
built (model, KV cache, attention and graphs), at DEBUG the memory and
weight events of an RL loop (memory release needs a GPU: the update here).
Shown by `--log-level` on the command line."""
from __future__ import annotations

import logging

from rollout_engine import RolloutEngine


def test_build_at_info_and_the_rl_loops_events_at_debug(llama, caplog):
    _, folder = llama
    with caplog.at_level(logging.DEBUG, logger="rollout_engine"):
        engine = RolloutEngine(folder, max_total_tokens=2048)
        built = caplog.text
        caplog.clear()
        engine.update_weights([(name, engine.get_weight(name)) for name in engine.weight_names()])
        engine.shutdown()
    assert "model LlamaForCausalLM (" in built and "GiB of weights in float32 on cpu, loaded in" in built
    assert "KV cache: 2048 tokens in pages of 1" in built and "prefix cache on" in built
    assert "attention: TorchAttentionBackend; no CUDA graphs" in built
    assert "weights updated: version 1" in caplog.text
    assert [r.levelname for r in caplog.records if r.getMessage().startswith("weights updated")] == ["DEBUG"]
