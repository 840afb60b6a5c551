"""Release and resume the engine's GPU memory between rollouts.

Order matters and is fixed here: a release first settles the scheduler
(nothing in flight), drops the prefix cache with the KV cache, then unmaps;
a resume maps weights and KV first and graphs last.

CUDA graphs (`graph_mode`):
- "pause": the graph pool lives in the `cuda_graph` region (preload hook);
  it is unmapped and mapped again like the others, graphs stay valid.
- "keep": the hook cannot see the graph pool (torch hook mode); the graphs
  and their pool stay resident, a release of `cuda_graph` frees 0 bytes.
- "recapture": destroy the graphs and their pool on release, capture them
  again on resume.
In torch hook mode the engine keeps them (TORCH_HOOK_GRAPH_MODE): the pools
are small next to weights and KV (the decode graphs', and the prompt graphs'
of about one largest step's activations: 346 MiB for Qwen3-0.6B), and
recapturing costs more than a resume should (BENCHMARKS.md, `memory`
workload). With the graphs paused, generating waits for their resume."""
from __future__ import annotations

import gc
import logging
from typing import Sequence

import torch

from rollout_engine.memory.manager import RELEASED, RESIDENT, TAGS, MemoryManager
from rollout_engine.runner.device_lock import DEVICE_WIDE

GRAPH_MODES = ("pause", "keep", "recapture")
TORCH_HOOK_GRAPH_MODE = "keep"

log = logging.getLogger("rollout_engine")


class MemoryController:
    def __init__(self, manager: MemoryManager, scheduler, prefix_cache, runner, device: torch.device,
                 weights_cpu_backup: bool, validity, graph_mode: str | None = None):
        self.manager = manager
        if graph_mode is None:
            graph_mode = "pause" if manager.saver.pauses_graphs else TORCH_HOOK_GRAPH_MODE
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        self.graph_mode = graph_mode
        self.scheduler = scheduler
        self.prefix_cache = prefix_cache
        self.runner = runner
        self.device = device
        self.weights_cpu_backup = weights_cpu_backup
        # Weights whose contents are not valid (after a resume without backup,
        # or an update that stopped part-way): generating waits until updates
        # have covered them all (weights/validity.py).
        self.validity = validity

    def _sync(self) -> None:
        if self.device.type == "cuda":
            with DEVICE_WIDE:
                torch.cuda.synchronize(self.device)

    def release(self, tags: Sequence[str], paused: bool) -> dict[str, int]:
        tags = self.manager.check(tags, RESIDENT, "release")
        if self.scheduler.has_work() and not paused:
            raise RuntimeError("requests are running: call pause_generation() before releasing memory")
        if "kv_cache" in tags and self.scheduler.running:
            raise RuntimeError("paused requests still hold the KV cache: pause_generation(mode='retract') or "
                               "(mode='abort') before releasing kv_cache")
        self.scheduler.settle()
        self._sync()
        freed = {}
        for tag in tags:
            if tag == "kv_cache":
                self.prefix_cache.flush()
            before = self._free_bytes()
            if tag == "cuda_graph" and self.graph_mode != "pause":
                expected = self._drop_graphs()
            else:
                expected = self.manager.pause(tag)
            # On the GPU, what the driver reports; elsewhere, the bookkeeping.
            freed[tag] = expected if before is None else max(0, self._free_bytes() - before)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # activation blocks cached by the step path go back too
        self._sync()
        log.debug("memory released: %s", ", ".join(f"{tag} {n / 2**20:.0f} MiB" for tag, n in freed.items()))
        return freed

    def _free_bytes(self) -> int | None:
        if self.device.type != "cuda":
            return None
        with DEVICE_WIDE:
            torch.cuda.synchronize(self.device)
            return torch.cuda.mem_get_info(self.device)[0]

    def _drop_graphs(self) -> int:
        """cuda_graph without a pausable pool: destroy or keep (see above)."""
        held = self.manager.nbytes("cuda_graph")
        self.manager.mark("cuda_graph", RELEASED)
        if self.graph_mode == "keep" or self.runner.graphs is None:
            return 0
        with DEVICE_WIDE:
            self.runner.graphs.destroy()
            gc.collect()
            torch.cuda.empty_cache()
        return held

    def resume(self, tags: Sequence[str]) -> None:
        tags = self.manager.check(tags, RELEASED, "resume")
        if "cuda_graph" in tags:
            stays_released = [t for t in ("weights", "kv_cache") if not self.manager.resident(t) and t not in tags]
            if stays_released:
                raise RuntimeError(f"cuda_graph can only be resumed with {stays_released} resident "
                                   "(capturing runs the model)")
        for tag in tags:
            if tag == "cuda_graph" and self.graph_mode != "pause":
                self.manager.mark(tag, RESIDENT)
                if self.graph_mode == "recapture" and self.runner.graphs is not None:
                    self.runner.graphs.capture()
                continue
            self.manager.resume(tag)
            if tag == "weights" and not self.weights_cpu_backup:
                self.validity.mark_all("released without weights_cpu_backup")
        self._sync()
        log.debug("memory resumed: %s", ", ".join(tags))

    def check_can_generate(self) -> None:
        released = [t for t in ("weights", "kv_cache") if not self.manager.resident(t)]
        if self.graph_mode == "pause" and self.runner.graphs is not None and not self.manager.resident("cuda_graph"):
            released.append("cuda_graph")  # the graphs stay, their memory unmapped
        if released:
            raise RuntimeError(f"cannot generate: {released} released; call resume_memory() first")
        self.validity.check()

    def state(self) -> dict[str, str]:
        """The tags this engine holds: no "cuda_graph" without captured graphs."""
        held = [t for t in TAGS if t != "cuda_graph" or self.runner.graphs is not None]
        return {tag: self.manager.state[tag] for tag in held}
