"""The engine's weight state: hot swaps in place from in-process tensors, a
safetensors folder or a weight-sync group, and the version they produce.

Transactions, where they can be had:
- A list or dict is checked whole before its first byte is copied: names,
  shapes, and finiteness (a read-only pass over the sources in the engine's
  dtype). A refused update changes nothing: weights, version, cache.
- A stream (a generator, a disk load, a broadcast) is copied as it arrives
  and checked for NaN/inf inside the copy. If it stops part-way, exactly the
  tensors it wrote are marked invalid (weights/validity.py) and the error
  names them; generation is refused until they are written again.
- The version moves only when an update completes. Any update that wrote
  something moves the prefix cache to a new weight epoch, so KV computed with
  other weights is never served."""
from __future__ import annotations

import logging
import os
from typing import Iterable, Sequence

import torch

from rollout_engine.distributed.weight_sync import specs_of
from rollout_engine.runner.device_lock import DEVICE_WIDE
from rollout_engine.weights.loader import WeightLoader, iter_safetensors, safetensors_shapes
from rollout_engine.weights.receiver import WeightReceiver
from rollout_engine.weights.validity import WeightValidity, name_list, plural

# Why tensors an unfinished update wrote are marked (weights/validity.py).
STOPPED_PART_WAY = "an update stopped part-way after writing them, so the model would mix two sets of weights"

log = logging.getLogger("rollout_engine")
MAX_VERSION = 2**63 - 1  # a weight version fits a signed 64-bit integer (metrics, the HTTP API, torch tensors)


class IncompleteUpdate(RuntimeError):
    """An update stopped after writing some tensors; `written` names them."""

    def __init__(self, message: str, written: list[str]):
        super().__init__(message)
        self.written = written

    def __reduce__(self):  # crosses processes (tensor-parallel ranks) intact
        return type(self), (str(self), self.written)


class IncompleteUpdateValueError(IncompleteUpdate, ValueError):
    """IncompleteUpdate whose cause was bad input (a name, shape or value)."""


class WeightUpdater:
    def __init__(self, loader: WeightLoader, receiver: WeightReceiver, memory, validity: WeightValidity,
                 prefix_cache, device: torch.device):
        self.loader = loader
        self.receiver = receiver
        self.memory = memory
        self.validity = validity
        self.prefix_cache = prefix_cache
        self.device = device
        self.version = 0

    def _check_can_update(self, version: int | None) -> None:
        if not self.memory.manager.resident("weights"):
            raise RuntimeError("cannot update weights while they are released; resume_memory(['weights']) first")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)
                                    or not 0 <= version <= MAX_VERSION):
            raise ValueError(f"version must be an integer in [0, {MAX_VERSION}], got {version!r}")

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None,
               checked: bool = False) -> int:
        """Copy `named_tensors` in place; returns the new version. A list or
        tuple is all-or-nothing; anything else is streamed."""
        self._check_can_update(version)
        if isinstance(named_tensors, (list, tuple)) and not checked:
            self.check_whole(named_tensors)
        written: set = set()
        try:
            self.loader.load(named_tensors, written)
        except BaseException as e:
            if not written:
                raise
            if not isinstance(e, Exception):  # Ctrl-C, SystemExit: marked as any stop, and raised as they are
                self.prefix_cache.advance_epoch()
                self.validity.mark(written, STOPPED_PART_WAY)
                raise
            self._broke_off(written, e)
        self.validity.clear(written)
        return self._finish(version)

    def check_whole(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Everything an all-or-nothing update checks before copying."""
        self.loader.validate(named_tensors)
        self.loader.check_finite(named_tensors)

    def _finish(self, version: int | None) -> int:
        if self.device.type == "cuda":
            with DEVICE_WIDE:
                torch.cuda.synchronize(self.device)
        self.prefix_cache.advance_epoch()
        self.version = self.version + 1 if version is None else version
        log.debug("weights updated: version %d", self.version)
        return self.version

    def _broke_off(self, written: set, cause: BaseException) -> None:
        """Mark what a stopped update wrote and raise an error naming it."""
        self.prefix_cache.advance_epoch()  # the weights did change
        self.validity.mark(written, STOPPED_PART_WAY)
        names = self.validity.names_of(written)
        message = (f"{cause or type(cause).__name__}; the update stopped after writing {plural(len(names), 'tensor')} "
                   f"({name_list(names)}): they "
                   f"hold new values while the rest are old, so generation is refused until they are written again "
                   f"(the weight version stays {self.version})")
        kind = IncompleteUpdateValueError if isinstance(cause, ValueError) else IncompleteUpdate
        raise kind(message, names) from cause

    def update_from_disk(self, path: str, version: int | None) -> int:
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            raise ValueError(f"path {path!r} is not a folder")
        self._check_can_update(version)
        self.loader.validate(safetensors_shapes(path))
        return self.update(iter_safetensors(path), version, checked=True)

    def update_from_distributed(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                                shapes: Sequence[Sequence[int]], src_rank: int, version: int | None,
                                group_name: str, bucket_bytes: int, timeout_s: float | None = None) -> int:
        specs = specs_of(names, dtypes, shapes)
        try:
            self._check_can_update(version)
            self.loader.validate((s.name, torch.empty(s.shape, dtype=s.dtype, device="meta")) for s in specs)
            error = None
        except (ValueError, RuntimeError) as e:
            error = e
        stream = self.receiver.receive(specs, src_rank, group_name, bucket_bytes, self.device, timeout_s)
        if error is not None:  # drain the broadcasts, so the sender never hangs
            for _ in stream:
                pass
            raise error
        return self.update(stream, version, checked=True)
