"""Release and resume the engine's GPU memory between rollouts.

Order matters and is fixed here: a release first settles the scheduler
(nothing in flight), drops the prefix cache with the KV cache and the CUDA
graphs with their pool, then unmaps; a resume maps weights and KV first and
recaptures graphs last (capture runs the model)."""
from __future__ import annotations

import gc
from typing import Sequence

import torch

from rollout_engine.memory.manager import RELEASED, RESIDENT, TAGS, MemoryManager


class MemoryController:
    def __init__(self, manager: MemoryManager, scheduler, prefix_cache, runner, device: torch.device,
                 weights_cpu_backup: bool, all_weights: set):
        self.manager = manager
        self.scheduler = scheduler
        self.prefix_cache = prefix_cache
        self.runner = runner
        self.device = device
        self.weights_cpu_backup = weights_cpu_backup
        # (parameter, shard)s whose contents are not valid weights (after a
        # resume without backup, or an update stream that broke off):
        # generating waits until updates have covered them all.
        self.all_weights = all_weights
        self.missing_weights: set = set()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self, tags: Sequence[str], paused: bool) -> dict[str, int]:
        tags = self.manager.check(tags, RESIDENT, "release")
        if self.scheduler.has_work() and not paused:
            raise RuntimeError("requests are running: call pause_generation() before releasing memory")
        if "kv_cache" in tags and (self.scheduler.running or self.scheduler.waiting):
            raise RuntimeError("paused requests still hold the KV cache: pause_generation(mode='abort') "
                               "or let them finish before releasing kv_cache")
        self.scheduler.settle()
        self._sync()
        freed = {}
        for tag in tags:
            if tag == "kv_cache":
                self.prefix_cache.flush()
            if tag == "cuda_graph" and self.runner.graphs is not None:
                self.runner.graphs.destroy()
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            freed[tag] = self.manager.pause(tag)
        self._sync()
        return freed

    def resume(self, tags: Sequence[str]) -> None:
        tags = self.manager.check(tags, RELEASED, "resume")
        if "cuda_graph" in tags:
            stays_released = [t for t in ("weights", "kv_cache") if not self.manager.resident(t) and t not in tags]
            if stays_released:
                raise RuntimeError(f"cuda_graph can only be resumed with {stays_released} resident "
                                   "(capturing runs the model)")
        for tag in tags:
            self.manager.resume(tag)
            if tag == "weights" and not self.weights_cpu_backup:
                self.missing_weights = set(self.all_weights)
            if tag == "cuda_graph" and self.runner.graphs is not None:
                self.runner.graphs.capture()
        self._sync()

    def check_can_generate(self) -> None:
        released = [t for t in ("weights", "kv_cache") if not self.manager.resident(t)]
        if released:
            raise RuntimeError(f"cannot generate: {released} released; call resume_memory() first")
        if self.missing_weights:
            example = sorted(t.param_name for t in self.missing_weights)[0]
            raise RuntimeError(f"cannot generate: {len(self.missing_weights)} weights hold no valid values "
                               f"(e.g. {example}): after a release without weights_cpu_backup, or an update that "
                               "broke off, load a complete set of weights first")

    def state(self) -> dict[str, str]:
        return {tag: self.manager.state[tag] for tag in TAGS}
