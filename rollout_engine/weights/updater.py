"""The engine's weight state: hot swaps in place from in-process tensors, a
safetensors folder or a weight-sync group, and the version they produce.

Rules kept here: a list or dict is validated whole (names, shapes) before
anything is copied; a stream is copied as it arrives; values are checked for
NaN/inf inside the copy. Whenever tensors were copied and the update then
failed, the weights are a mix, and the memory controller's missing set makes
the engine refuse to generate until a complete update."""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch

from rollout_engine.distributed.weight_sync import specs_of
from rollout_engine.layers.weight_copy import NonFiniteWeights
from rollout_engine.memory.controller import MemoryController
from rollout_engine.runner.device_lock import DEVICE_WIDE
from rollout_engine.weights.loader import WeightLoader, iter_safetensors, safetensors_shapes
from rollout_engine.weights.receiver import WeightReceiver


class WeightUpdater:
    def __init__(self, loader: WeightLoader, receiver: WeightReceiver, memory: MemoryController, prefix_cache,
                 device: torch.device):
        self.loader = loader
        self.receiver = receiver
        self.memory = memory
        self.prefix_cache = prefix_cache
        self.device = device
        self.version = 0

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None, flush_cache: bool,
               checked: bool = False) -> int:
        """Copy `named_tensors` in place; returns the new version."""
        if not self.memory.manager.resident("weights"):
            raise RuntimeError("cannot update weights while they are released; resume_memory(['weights']) first")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        streamed = not isinstance(named_tensors, (list, tuple))
        if not streamed and not checked:
            self.loader.validate(named_tensors)
        try:
            touched = self.loader.load(named_tensors)
        except Exception as e:
            if streamed or isinstance(e, NonFiniteWeights):
                self.memory.missing_weights = set(self.loader.required())
            raise
        self.memory.missing_weights -= touched
        if self.device.type == "cuda":
            with DEVICE_WIDE:
                torch.cuda.synchronize(self.device)
        self.version = self.version + 1 if version is None else version
        if flush_cache:
            self.prefix_cache.flush()  # KV computed with the old weights
        return self.version

    def update_from_disk(self, path: str, version: int | None) -> int:
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise ValueError(f"path {path!r} is not a folder")
        self.loader.validate(safetensors_shapes(path))
        return self.update(iter_safetensors(path), version, flush_cache=True, checked=True)

    def update_from_distributed(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                                shapes: Sequence[Sequence[int]], src_rank: int, version: int | None,
                                group_name: str, bucket_bytes: int) -> int:
        specs = specs_of(names, dtypes, shapes)
        try:
            self.loader.validate((s.name, torch.empty(s.shape, dtype=s.dtype, device="meta")) for s in specs)
            error = None
        except ValueError as e:
            error = e
        stream = self.receiver.receive(specs, src_rank, group_name, bucket_bytes, self.device)
        if error is not None:  # drain the broadcasts, so the sender never hangs
            for _ in stream:
                pass
            raise error
        return self.update(stream, version, flush_cache=True, checked=True)
