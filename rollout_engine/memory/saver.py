"""Where GPU memory that can be released comes from: torch-memory-saver
regions, or nothing (memory saver disabled)."""
from __future__ import annotations

import atexit
import contextlib
import os
from typing import ContextManager, Protocol

import torch


class MemorySaver(Protocol):
    # Graph memory captured through `graph_capture` can be paused like a region.
    pauses_graphs: bool

    def region(self, tag: str, cpu_backup: bool) -> ContextManager: ...

    def graph_capture(self, graph: torch.cuda.CUDAGraph, pool) -> ContextManager: ...

    def pause(self, tag: str) -> None: ...

    def resume(self, tag: str) -> None: ...


# Each engine captures on its own loop thread. "thread_local" keeps another
# engine's thread (one stopping and freeing its memory, or synchronising) from
# invalidating this capture, as the default "global" mode would.
CAPTURE_ERROR_MODE = "thread_local"


def plain_graph_capture(graph: torch.cuda.CUDAGraph, pool) -> ContextManager:
    return torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE)


class NoSaver:
    """Allocations go nowhere special; nothing can be released."""

    pauses_graphs = False

    def region(self, tag: str, cpu_backup: bool) -> ContextManager:
        return contextlib.nullcontext()

    def graph_capture(self, graph: torch.cuda.CUDAGraph, pool) -> ContextManager:
        return plain_graph_capture(graph, pool)

    def pause(self, tag: str) -> None:
        raise RuntimeError("no memory saver")

    def resume(self, tag: str) -> None:
        raise RuntimeError("no memory saver")


def preload_active() -> bool:
    """The process was started with the preload hook (`rollout-engine run`)."""
    return "torch_memory_saver_hook_mode_preload" in os.environ.get("LD_PRELOAD", "")


class TorchMemorySaver:
    """torch-memory-saver: tagged virtual-memory regions whose physical memory
    can be unmapped and mapped again at the same addresses. Its pause/resume
    exit the process when called in the wrong state; the MemoryManager keeps
    the state and never lets that happen."""

    def __init__(self, hook_mode: str):
        from torch_memory_saver import torch_memory_saver

        self.tms = torch_memory_saver
        # The library is a process-wide singleton, configured once: later
        # engines in the same process share it (in the same mode).
        if self.tms._impl is None:
            self.tms.hook_mode = hook_mode
        elif self.tms._impl._hook_mode != hook_mode:
            raise RuntimeError(f"torch-memory-saver already runs in {self.tms._impl._hook_mode!r} mode in this "
                               f"process, not {hook_mode!r}")
        self.hook_mode = hook_mode
        if hook_mode == "torch":
            _free_inside_a_region_at_exit(self.tms)
        # Only the preload hook sees the allocations a graph capture makes.
        self.pauses_graphs = hook_mode == "preload"

    def region(self, tag: str, cpu_backup: bool) -> ContextManager:
        if cpu_backup:
            # Keep the pinned host copy between cycles: allocating and freeing
            # it on every pause/resume costs more than the copy itself.
            self.tms.retain_cpu_backup = True
        return self.tms.region(tag=tag, enable_cpu_backup=cpu_backup)

    def graph_capture(self, graph: torch.cuda.CUDAGraph, pool) -> ContextManager:
        if not self.pauses_graphs:
            return plain_graph_capture(graph, pool)
        return self.tms.cuda_graph(graph, pool=pool, tag="cuda_graph", capture_error_mode=CAPTURE_ERROR_MODE)

    def pause(self, tag: str) -> None:
        self.tms.pause(tag)

    def resume(self, tag: str) -> None:
        self.tms.resume(tag)


_exit_hook_registered = False


def _free_inside_a_region_at_exit(tms) -> None:
    """In torch hook mode the library ends the process with status 1 when
    memory of its pools is freed outside a region, which is what interpreter
    teardown does to every engine still alive. From exit on, stay inside a
    region so that teardown frees quietly."""
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True

    def enter_region() -> None:
        # The flag is per thread; teardown runs on this one. (Library internals,
        # pinned at 0.0.10: if they move, exit as before rather than raise.)
        cdll = getattr(getattr(getattr(tms, "_impl", None), "_binary_wrapper", None), "cdll", None)
        if cdll is not None:
            cdll.tms_set_interesting_region(True)

    atexit.register(enter_region)


def create_saver(enabled: bool, device: torch.device) -> MemorySaver:
    if not enabled:
        return NoSaver()
    if device.type != "cuda":
        raise ValueError("enable_memory_saver needs a CUDA device")
    return TorchMemorySaver("preload" if preload_active() else "torch")
