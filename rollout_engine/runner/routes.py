"""A finished request's routing on its way to the host (routing capture).

The copy is enqueued on the device after every step launched so far (the
steps that computed the request's KV, so the rows are final) and before
any later step could reuse its slots; the host waits for it only when the
output is handed out, and the engine hands outputs out without waiting
while other steps keep the device busy (core/engine_core.py: dispatch)."""
from __future__ import annotations

import numpy as np
import torch


class RoutesCopy:
    def __init__(self, routes: torch.Tensor, slots: np.ndarray):
        """`routes` [slots, moe_layers, top_k] (the KV pool's buffer); `slots`:
        the request's KV slots, position by position."""
        self._slots = np.array(slots, dtype=np.int64)  # its own copy (the table row is reused), kept while copying
        self._event = None
        self._array: np.ndarray | None = None
        index = torch.from_numpy(self._slots)
        if routes.is_cuda:
            # from pinned memory: an upload from pageable memory would wait for
            # the steps in flight (CUDA syncs the stream before such a copy)
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
        """[positions, moe_layers, top_k] expert ids (waits for the copy)."""
        if self._array is None:
            self._event.synchronize()
            self._array = self._host.numpy().copy()  # not pinned memory in the caller's hands
            self._host = self._event = None
        return self._array
