"""Finished requests' routing on its way to the host (routing capture).

One copy per scheduler pass takes the rows of every request that needed
them in that pass (finished, retracted, or a fork sample queued): one
gather, one device-to-host copy and one event, however many requests
finish together (a GRPO batch's samples often do). The copy is enqueued
on the device after every step launched so far (the steps that computed
those requests' KV, so the rows are final) and before any later step could
reuse their slots; the host waits for it only when an output is handed
out, and the engine hands outputs out without waiting while other steps
keep the device busy (core/engine_core.py: dispatch)."""
from __future__ import annotations

import numpy as np
import torch


class RoutesCopy:
    def __init__(self, routes: torch.Tensor, slot_lists: list[np.ndarray]):
        """`routes` [slots, moe_layers, top_k] (the KV pool's buffer);
        `slot_lists`: each request's KV slots (int64), position by position,
        in arrays of their own (not views of the request table)."""
        self._bounds = np.cumsum([0] + [len(s) for s in slot_lists])
        self._slots = np.concatenate(slot_lists)  # kept while copying
        self._event = None
        self._array: np.ndarray | None = None
        index = torch.from_numpy(self._slots)
        if routes.is_cuda:
            # from pinned memory: CUDA may drain the stream before an upload
            # from pageable memory
            rows = routes[index.pin_memory().to(routes.device, non_blocking=True)]
            self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self._host.copy_(rows, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._array = routes[index].numpy()

    def ready(self) -> bool:
        """The rows are on the host (result() will not wait)."""
        return self._array is not None or self._event.query()

    def result(self) -> np.ndarray:
        """[positions of every request, moe_layers, top_k] expert ids (waits
        for the copy)."""
        if self._array is None:
            self._event.synchronize()
            self._array = self._host.numpy().copy()  # not pinned memory in the callers' hands
            self._host = self._event = None
        return self._array

    def parts(self) -> list[RoutesPart]:
        """One handle per request, in the order of `slot_lists`."""
        return [RoutesPart(self, int(a), int(b)) for a, b in zip(self._bounds[:-1], self._bounds[1:])]


class RoutesPart:
    """One request's rows of a shared copy."""

    __slots__ = ("_copy", "_start", "_end")

    def __init__(self, copy: RoutesCopy, start: int, end: int):
        self._copy, self._start, self._end = copy, start, end

    def ready(self) -> bool:
        return self._copy.ready()

    def result(self) -> np.ndarray:
        """[positions, moe_layers, top_k] (its own array: an output kept
        does not hold the others' rows)."""
        return self._copy.result()[self._start:self._end].copy()
