"""Bringing a restarted replica back: Ray restarts a replica's actor (a new
engine with the checkpoint's weights); before it takes work again the pool
gives it the pool's current weights and version, and its pause and released
memory. A replica that cannot come back is dropped with a warning."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from rollout_engine.integrations.ray.calls import ray_module

log = logging.getLogger("rollout_engine")


@dataclass
class Slot:
    index: int
    actor: Any
    group: Any  # its placement group
    state: str = "ready"  # "ready" | "recovering" | "dropped"
    incarnation: str | None = None  # changes when Ray restarts the actor
    sync_group: str | None = None  # the weight-sync group it has joined


class Recovery:
    def __init__(self, pool, restart_timeout_s: float):
        self.pool = pool
        self.restart_timeout_s = restart_timeout_s
        self.version = 0
        # Where the current weights come from: None (the checkpoint),
        # ("tensors", ObjectRef), ("disk", path) or ("replica",) after a
        # broadcast (a live replica's copy).
        self.source: tuple | None = None
        self.paused: str | None = None
        self.released: set[str] = set()
        self._stopped = threading.Event()

    def set_source(self, source: tuple, version: int) -> None:
        self.source, self.version = source, version

    def lost_slot(self, index: int) -> None:
        slot = self.pool.slot(index)
        self.lost(slot, slot.incarnation)

    def lost(self, slot, incarnation: str | None) -> None:
        """The replica's actor died while running `incarnation`: stop routing
        to it and bring it back in the background (once per death)."""
        with self.pool._lock:
            if slot.state != "ready" or slot.incarnation != incarnation:
                return
            slot.state, slot.sync_group = "recovering", None
            self.pool._router.forget(slot.index)
        log.warning("replica %d died; its requests go to the others while Ray restarts it", slot.index)
        threading.Thread(target=self._bring_back, args=(slot,), name=f"pool-recover-{slot.index}",
                         daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _bring_back(self, slot) -> None:
        ray = ray_module()
        deadline = time.monotonic() + self.restart_timeout_s
        info = None
        while info is None:
            if self._stopped.is_set():
                return
            try:
                info = ray.get(slot.actor.info.remote(), timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            except ray.exceptions.ActorDiedError:
                return self._drop(slot, "Ray will not restart it (max_restarts reached)")
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    return self._drop(slot, f"it did not come back within {self.restart_timeout_s} s")
                time.sleep(0.5)
        with self.pool._lock:
            if self._stopped.is_set():
                return
            try:
                self._restore(ray, slot)
            except Exception as e:  # noqa: BLE001 - whatever failed, this replica cannot serve
                return self._drop(slot, f"restoring its weights failed: {e}")
            slot.incarnation, slot.state = info["incarnation"], "ready"
            self.pool._router.add(slot.index)
        log.warning("replica %d is back (weights version %d)", slot.index, self.version)

    def _restore(self, ray, slot) -> None:
        timeout = self.pool.call_timeout_s
        actor = slot.actor
        if self.source is not None:
            kind = self.source[0]
            if kind == "tensors":
                ray.get(actor.update_weights.remote(self.source[1], self.version), timeout=timeout)
            elif kind == "disk":
                ray.get(actor.call.remote("update_weights_from_disk", self.source[1], self.version), timeout=timeout)
            else:  # after a broadcast: copy a live replica's weights
                donor = next((s for s in self.pool._slots if s.state == "ready"), None)
                if donor is None:
                    raise RuntimeError("no live replica holds the broadcast weights")
                ray.get(actor.update_weights.remote(donor.actor.export_weights.remote(), self.version),
                        timeout=timeout)
        if self.paused is not None:
            ray.get(actor.call.remote("pause_generation", self.paused), timeout=timeout)
        if self.released:
            ray.get(actor.call.remote("release_memory", sorted(self.released)), timeout=timeout)

    def _drop(self, slot, why: str) -> None:
        with self.pool._lock:
            slot.state = "dropped"
        log.warning("replica %d dropped from the pool: %s; the pool goes on with the others", slot.index, why)
        try:
            ray_module().kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it is gone either way
            pass
