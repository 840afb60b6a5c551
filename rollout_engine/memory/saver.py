"""Where GPU memory that can be released comes from: torch-memory-saver
regions, or nothing (memory saver disabled)."""
from __future__ import annotations

import contextlib
import os
from typing import ContextManager, Protocol

import torch


class MemorySaver(Protocol):
    def region(self, tag: str, cpu_backup: bool) -> ContextManager: ...

    def pause(self, tag: str) -> None: ...

    def resume(self, tag: str) -> None: ...


class NoSaver:
    """Allocations go nowhere special; nothing can be released."""

    def region(self, tag: str, cpu_backup: bool) -> ContextManager:
        return contextlib.nullcontext()

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
        self.tms.hook_mode = hook_mode
        self.hook_mode = hook_mode

    def region(self, tag: str, cpu_backup: bool) -> ContextManager:
        return self.tms.region(tag=tag, enable_cpu_backup=cpu_backup)

    def pause(self, tag: str) -> None:
        self.tms.pause(tag)

    def resume(self, tag: str) -> None:
        self.tms.resume(tag)


def create_saver(enabled: bool, device: torch.device) -> MemorySaver:
    if not enabled:
        return NoSaver()
    if device.type != "cuda":
        raise ValueError("enable_memory_saver needs a CUDA device")
    return TorchMemorySaver("preload" if preload_active() else "torch")
