"""`memory` workload: after a rollout, release and resume each tag and all
of them; bytes freed (device-wide, from the driver) against what the engine
held, seconds per call, and the two ways of handling CUDA graphs when their
pool cannot be unmapped (keep them, or destroy and recapture)."""
from __future__ import annotations

import statistics
from typing import Any

import torch

from rollout_engine.bench import workloads
from rollout_engine.bench.common import free_device_memory, make_engine, timed
from rollout_engine.memory.manager import TAGS


def used_device_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _rollout(engine, wl) -> list[list[int]]:
    engine.flush_cache()
    return [o.output_token_ids for o in engine.generate(input_ids=wl.input_ids, sampling_params=wl.params)]


def _cycle(engine, tags) -> dict[str, float]:
    before = used_device_bytes()
    release_s = timed(lambda: engine.release_memory(tags))
    freed = before - used_device_bytes()
    resume_s = timed(lambda: engine.resume_memory(tags))
    return {"release_s": release_s, "resume_s": resume_s, "freed_bytes": freed}


def _median_cycles(engine, tags, cycles: int) -> dict[str, float]:
    runs = [_cycle(engine, tags) for _ in range(cycles)]
    return {"release_s": round(statistics.median(r["release_s"] for r in runs), 4),
            "resume_s": round(statistics.median(r["resume_s"] for r in runs), 4),
            "freed_GiB": round(statistics.median(r["freed_bytes"] for r in runs) / 2**30, 3)}


def bench_memory(args) -> dict[str, Any]:
    torch.zeros(1, device="cuda")  # the CUDA context is not the engine's
    free_device_memory()
    used_before = used_device_bytes()
    engine = make_engine(args, enable_memory_saver=True, weights_cpu_backup=True)
    mc = engine.model_config
    wl = workloads.grpo(mc.vocab_size, 8, 4, 256, 512, 64, seed=1)
    reference = _rollout(engine, wl)
    held = used_device_bytes() - used_before
    report: dict[str, Any] = {
        "hook_mode": getattr(engine.core.parts.memory.saver, "hook_mode", None), "graph_mode": engine.core.parts.controller.graph_mode,
        "engine_held_GiB": round(held / 2**30, 3),
        "tag_GiB": {t: round(engine.core.parts.memory.nbytes(t) / 2**30, 3) for t in TAGS},
    }
    # Everything at once, as a training loop does.
    release_s = timed(lambda: engine.release_memory())
    freed = held - (used_device_bytes() - used_before)
    resume_s = timed(lambda: engine.resume_memory())
    report["all_tags"] = {"release_s": round(release_s, 4), "resume_s": round(resume_s, 4),
                          "freed_GiB": round(freed / 2**30, 3), "freed_share": round(freed / held, 4),
                          "outputs_identical": _rollout(engine, wl) == reference}
    report["per_tag"] = {tag: _median_cycles(engine, [tag], args.cycles) for tag in TAGS}
    # CUDA graphs when the hook cannot unmap their pool: destroy + recapture.
    if engine.core.parts.runner.graphs is not None and engine.core.parts.controller.graph_mode != "pause":
        kept = engine.core.parts.controller.graph_mode
        engine.core.parts.controller.graph_mode = "recapture"
        report["graphs_recapture"] = _median_cycles(engine, ["cuda_graph"], args.cycles)
        engine.core.parts.controller.graph_mode = kept
        report["graphs_recapture"]["outputs_identical"] = _rollout(engine, wl) == reference
    report["outputs_identical_at_end"] = _rollout(engine, wl) == reference
    free_device_memory(engine)
    del engine
    return report
