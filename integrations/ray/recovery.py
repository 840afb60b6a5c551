"""Bringing a restarted replica back: Ray restarts a replica's actor (a new
engine with the checkpoint's weights); before it takes work again the pool
gives it the pool's current weights and version, and its pause and released
memory. A replica that cannot come back is dropped with a warning.

The recovery sees its pool only through `RecoveryHost`: the pool keeps the
slots' states, their routing and the lock over both, and makes each change
the recovery asks for."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

from rollout_engine.integrations.ray.calls import ray_module
from rollout_engine.integrations.ray.placement import Slot

log = logging.getLogger("rollout_engine")


class RecoveryHost(Protocol):
    """What a Recovery needs of its pool (RolloutPool implements it)."""

    def slot(self, index: int) -> Slot:
        """The slot of replica `index`."""

    def withdraw_replica(self, slot: Slot, incarnation: str | None) -> bool:
        """Out of service after its actor died while running `incarnation`;
        False if already done for this death."""

    def readmit_replica(self, slot: Slot, incarnation: str, restore: Callable[[Slot], None]) -> bool:
        """Back in service as `incarnation` after `restore(slot)`, which runs
        under the pool's lock; False, without restoring, once the pool is shut down."""

    def drop_replica(self, slot: Slot) -> None:
        """Out of service for good."""

    def live_replica(self) -> Slot | None:
        """A replica in service, or None."""


class Recovery:
    def __init__(self, pool: RecoveryHost, restart_timeout_s: float, call_timeout_s: float):
        self.pool = pool
        self.restart_timeout_s, self.call_timeout_s = restart_timeout_s, call_timeout_s
        # The pool's state that a restarted replica is brought to, set by the
        # pool's controls under its lock (and read under it, in `_restore`).
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

    def lost(self, slot: Slot, incarnation: str | None) -> None:
        """The replica's actor died while running `incarnation`: stop routing
        to it and bring it back in the background (once per death)."""
        if not self.pool.withdraw_replica(slot, incarnation):
            return
        log.warning("replica %d died; its requests go to the others while Ray restarts it", slot.index)
        threading.Thread(target=self._bring_back, args=(slot,), name=f"pool-recover-{slot.index}",
                         daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _bring_back(self, slot: Slot) -> None:
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
        try:
            back = self.pool.readmit_replica(slot, info["incarnation"], lambda s: self._restore(ray, s))
        except Exception as e:  # noqa: BLE001 - whatever failed, this replica cannot serve
            return self._drop(slot, f"restoring its weights failed: {e}")
        if back:
            log.warning("replica %d is back (weights version %d)", slot.index, self.version)

    def _restore(self, ray, slot: Slot) -> None:
        """The pool's weights, version, pause and released memory onto a
        restarted replica (run under the pool's lock)."""
        timeout = self.call_timeout_s
        actor = slot.actor
        if self.source is not None:
            kind = self.source[0]
            if kind == "tensors":
                ray.get(actor.update_weights.remote(self.source[1], self.version), timeout=timeout)
            elif kind == "disk":
                ray.get(actor.call.remote("update_weights_from_disk", self.source[1], self.version), timeout=timeout)
            else:  # after a broadcast: copy a live replica's weights
                donor = self.pool.live_replica()
                if donor is None:
                    raise RuntimeError("no live replica holds the broadcast weights")
                ray.get(actor.update_weights.remote(donor.actor.export_weights.remote(), self.version),
                        timeout=timeout)
        if self.paused is not None:
            ray.get(actor.call.remote("pause_generation", self.paused), timeout=timeout)
        if self.released:
            ray.get(actor.call.remote("release_memory", sorted(self.released)), timeout=timeout)

    def _drop(self, slot: Slot, why: str) -> None:
        self.pool.drop_replica(slot)
        log.warning("replica %d dropped from the pool: %s; the pool goes on with the others", slot.index, why)
        try:
            ray_module().kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it is gone either way
            pass
