"""RolloutPool: many engines behind one API, each in a Ray actor
(docs/ray.md).

Ray places the replicas (placement.py: one placement group per replica,
`tp_size` GPUs packed on one node, or CPUs), owns their processes and
restarts one that dies. The pool routes prompts (routing.py), fans the RL
controls out to every replica and brings a restarted replica back to the
pool's weights and state before it takes work (recovery.py, which reaches
the slots only through `slot()` and the four `*_replica` methods below).
Ray is an optional extra (`pip install -e ".[ray]"`), imported on first use.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from rollout_engine.integrations.ray.batching import Batch, make_batch
from rollout_engine.integrations.ray.calls import PoolCall, gather, ray_module
from rollout_engine.integrations.ray.generate import run_batch
from rollout_engine.integrations.ray.placement import Slot, place_replicas, release_replicas, replica_bundle
from rollout_engine.integrations.ray.recovery import Recovery
from rollout_engine.integrations.ray.routing import Router, Unit
from rollout_engine.integrations.ray.streams import merge_streams
from rollout_engine.outputs import RolloutOutput
from rollout_engine.sampling_params import SamplingParams

log = logging.getLogger("rollout_engine")
TAGS = ("kv_cache", "weights", "cuda_graph")


class RolloutPool:
    def __init__(self, model: str, num_replicas: int = 1, tp_size: int = 1, *, ray_address: str | None = None,
                 call_timeout_s: float = 600.0, generate_timeout_s: float = 3600.0,
                 restart_timeout_s: float = 300.0, max_restarts: int = 3, seed: int = 0, **engine_kwargs):
        for name, value in (("num_replicas", num_replicas), ("tp_size", tp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
            raise ValueError(f"max_restarts must be an integer >= -1 (-1: without limit), got {max_restarts!r}")
        for name, value in (("call_timeout_s", call_timeout_s), ("generate_timeout_s", generate_timeout_s),
                            ("restart_timeout_s", restart_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        from rollout_engine.config import EngineConfig
        from rollout_engine.model_zoo import ZOO

        EngineConfig(model=model, tp_size=tp_size, **engine_kwargs)  # bad options fail here, before any actor
        if not (os.path.isdir(model) or model in ZOO or engine_kwargs.get("load_format") == "dummy"):
            raise ValueError(f"model {model!r} is not a folder, a known model ({sorted(ZOO)}), "
                             "or a preset with load_format='dummy'")
        ray = ray_module()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        self.model, self.tp_size = model, tp_size
        self.call_timeout_s, self.generate_timeout_s = call_timeout_s, generate_timeout_s
        self._engine_kwargs = {"tp_size": tp_size, **engine_kwargs}
        self._rng = random.Random(seed)  # seeds of prompts that bring none: a re-run gives the same samples
        self._ids = itertools.count()
        self._prefix = f"pool-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()  # the slots' states and the pool's weights/version/pause/release state
        self._router = Router()
        self._closed = False
        self.recovery = Recovery(self, restart_timeout_s=restart_timeout_s, call_timeout_s=call_timeout_s)
        self._slots: list[Slot] = []
        self.sync_world_size: int | None = None
        try:
            self._start(ray, num_replicas, max_restarts)
        except BaseException:
            self._closed = True
            self._release(ray)
            raise

    # ---- placement -----------------------------------------------------------------
    def _start(self, ray, num_replicas: int, max_restarts: int) -> None:
        bundle = replica_bundle(ray, self.tp_size, str(self._engine_kwargs.get("device", "auto")))
        place_replicas(ray, self._slots, bundle, num_replicas, max_restarts, self.model, self._engine_kwargs,
                       self.call_timeout_s)
        infos = gather({s.index: s.actor.info.remote() for s in self._slots}, "start", self.call_timeout_s)
        self.model_config = ray.get(self._slots[0].actor.model_config.remote(), timeout=self.call_timeout_s)
        for slot in self._slots:
            slot.incarnation = infos[slot.index]["incarnation"]
            self._router.add(slot.index)

    # ---- generation ------------------------------------------------------------------
    def generate(self, prompts: Sequence[str] | None = None, input_ids: Sequence[Sequence[int]] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 request_ids: Sequence[str] | None = None, session_ids: Sequence[Any] | None = None,
                 timeout_s: float | None = None) -> list[RolloutOutput]:
        """`RolloutEngine.generate` over the replicas: one output per (prompt,
        sample), samples of a prompt adjacent, in input order."""
        return self._run(self._batch(prompts, input_ids, sampling_params, request_ids, session_ids), timeout_s)

    async def generate_async(self, prompts=None, input_ids=None, sampling_params=None, request_ids=None,
                             session_ids=None, timeout_s: float | None = None) -> list[RolloutOutput]:
        """Awaitable `generate`; cancelling the awaiting task aborts its requests."""
        batch = self._batch(prompts, input_ids, sampling_params, request_ids, session_ids)
        try:
            return await asyncio.to_thread(self._run, batch, timeout_s)
        except asyncio.CancelledError:
            self.abort(batch.sample_ids())
            raise

    def stream(self, prompts=None, input_ids=None, sampling_params=None, request_ids=None, session_ids=None,
               timeout_s: float | None = None) -> Iterator[RolloutOutput]:
        """`RolloutEngine.stream` over the replicas: deltas as tokens come. A
        replica that dies mid-stream has its requests re-run elsewhere (same
        seeds); what was already delivered is not delivered twice."""
        batch = self._batch(prompts, input_ids, sampling_params, request_ids, session_ids)
        deadline = self._deadline(timeout_s)
        return merge_streams(self, batch, deadline) if batch.units else iter(())

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        if request_ids is not None and (isinstance(request_ids, str) or not isinstance(request_ids, (list, tuple))):
            raise ValueError("request_ids must be a list of request id strings, or None for all")
        return sum(self._fanout("abort", None if request_ids is None else list(request_ids)).values())

    def _batch(self, prompts, input_ids, sampling_params, request_ids, session_ids) -> Batch:
        return make_batch(prompts, input_ids, sampling_params, request_ids, session_ids, self._rng,
                          lambda: f"{self._prefix}-{next(self._ids)}")

    def _deadline(self, timeout_s: float | None) -> float:
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or timeout_s <= 0):
            raise ValueError(f"timeout_s must be None or a number of seconds > 0, got {timeout_s!r}")
        return time.monotonic() + (self.generate_timeout_s if timeout_s is None else timeout_s)

    def dispatch(self, units: list[Unit], deadline: float) -> dict[int, list[Unit]]:
        """Units -> replicas that are ready; waits (to the deadline) while
        every replica is restarting."""
        while True:
            with self._lock:
                self._require_open()
                usable = [s.index for s in self._slots if s.state == "ready"]
                if usable:
                    return self._router.assign(units, usable)
                if not any(s.state == "recovering" for s in self._slots):
                    raise RuntimeError("no replica is left in the pool (every one died and could not come back)")
            if time.monotonic() > deadline:
                raise TimeoutError("no replica came back before the call's deadline")
            time.sleep(0.2)

    def finished(self, replica: int, units: list[Unit]) -> None:
        with self._lock:
            self._router.finished(replica, units)

    def slot(self, index: int) -> Slot:
        return self._slots[index]

    def _run(self, batch: Batch, timeout_s: float | None) -> list[RolloutOutput]:
        deadline = self._deadline(timeout_s)
        return run_batch(self, batch, deadline) if batch.units else []  # no prompts: nothing to wait for

    # ---- RL controls -----------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.recovery.version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       version: int | None = None) -> int:
        """Every replica takes these weights (Hugging Face names); they go
        into Ray's object store once, not once per replica, and stay there
        for a replica that restarts later. Returns the new weight version."""
        self._require_open()
        ray = ray_module()
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        tensors = [(name, t.detach().to("cpu")) for name, t in items]
        with self._lock:
            v = self._next_version(version)
            ref = ray.put(tensors)
            self._fanout("update_weights", lambda slot: slot.actor.update_weights.remote(ref, v))
            self.recovery.set_source(("tensors", ref), v)
        return v

    def update_weights_from_disk(self, path: str, version: int | None = None) -> int:
        """Every replica loads this checkpoint (a path every node can read)."""
        with self._lock:
            v = self._next_version(version)
            self._fanout("update_weights_from_disk", path, v)
            self.recovery.set_source(("disk", path), v)
        return v

    def init_weight_sync_group(self, master_address: str, master_port: int, group_name: str = "weight_sync",
                               backend: str = "nccl") -> PoolCall:
        """Every engine rank of every replica joins one group with the
        trainer (rank 0). Returns at once: the trainer creates its sender
        (`WeightSender(master_address, master_port, world_size=call.world_size)`)
        and then waits on the returned call."""
        self._require_open()
        with self._lock:
            members = [s for s in self._slots if s.state == "ready"]
            world = 1 + self.tp_size * len(members)
            refs = {}
            for k, slot in enumerate(members):
                slot.sync_group = group_name
                refs[slot.index] = slot.actor.call.remote("init_weight_sync_group", master_address, master_port,
                                                          1 + k * self.tp_size, world, group_name, backend)
            self.sync_world_size = world
        return PoolCall(self, "init_weight_sync_group", refs, self.call_timeout_s, world_size=world)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                                        shapes: Sequence[Sequence[int]], src_rank: int = 0,
                                        version: int | None = None, group_name: str = "weight_sync",
                                        bucket_bytes: int | None = None) -> PoolCall:
        """Every replica receives the trainer's broadcast. Returns at once:
        the trainer broadcasts, then waits on the returned call (its result
        is the new version)."""
        self._require_open()
        kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        with self._lock:
            ready = [s for s in self._slots if s.state == "ready"]
            stale = [s.index for s in ready if s.sync_group != group_name]
            if stale or not ready:
                raise RuntimeError(f"replica(s) {stale} are not in the weight-sync group {group_name!r} (restarted "
                                   "since init_weight_sync_group?): destroy the group and init it again, with the "
                                   "trainer's sender" if ready else "no replica is ready")
            v = self._next_version(version)
            refs = {s.index: s.actor.call.remote("update_weights_from_distributed", list(names), list(dtypes),
                                                 [list(x) for x in shapes], src_rank, v, group_name, **kwargs)
                    for s in ready}
            self.recovery.set_source(("replica",), v)
        return PoolCall(self, "update_weights_from_distributed", refs, self.call_timeout_s, result=v)

    def destroy_weight_sync_group(self, group_name: str = "weight_sync") -> None:
        self._require_open()
        with self._lock:
            members = [s for s in self._slots if s.state == "ready" and s.sync_group == group_name]
            refs = {s.index: s.actor.call.remote("destroy_weight_sync_group", group_name) for s in members}
            for s in members:
                s.sync_group = None
        gather(refs, "destroy_weight_sync_group", self.call_timeout_s, on_lost=self.recovery.lost_slot)

    def release_memory(self, tags: Sequence[str] = TAGS) -> dict[str, int]:
        """Every replica releases `tags`; bytes freed per tag, summed."""
        with self._lock:
            freed = self._fanout("release_memory", list(tags))
            self.recovery.released |= set(tags)
        total: dict[str, int] = {}
        for per_tag in freed.values():
            for tag, n in per_tag.items():
                total[tag] = total.get(tag, 0) + n
        return total

    def resume_memory(self, tags: Sequence[str] = TAGS) -> None:
        with self._lock:
            self._fanout("resume_memory", list(tags))
            self.recovery.released -= set(tags)

    def pause_generation(self, mode: str = "abort") -> None:
        """Returns when every replica has paused (so an update that follows
        reaches no running step anywhere)."""
        with self._lock:
            self._fanout("pause_generation", mode)
            self.recovery.paused = mode

    def continue_generation(self) -> None:
        with self._lock:
            self._fanout("continue_generation")
            self.recovery.paused = None

    def flush_cache(self) -> None:
        self._fanout("flush_cache")

    # ---- the recovery's view of the replicas (recovery.RecoveryHost) -------------------
    def withdraw_replica(self, slot: Slot, incarnation: str | None) -> bool:
        """Takes a replica whose actor died while running `incarnation` out
        of service: it gets no new work, its sessions go elsewhere next time,
        and it has left its weight-sync group. False when that was already
        done for this death (the slot is not ready, or runs a newer incarnation)."""
        with self._lock:
            if slot.state != "ready" or slot.incarnation != incarnation:
                return False
            slot.state, slot.sync_group = "recovering", None
            self._router.forget(slot.index)
            return True

    def readmit_replica(self, slot: Slot, incarnation: str, restore: Callable[[Slot], None]) -> bool:
        """Puts a restarted replica back in service as `incarnation` once
        `restore(slot)` has brought it to the pool's weights and state.
        `restore` runs under the pool's lock, so no control reaches the
        replicas meanwhile and the replica misses none; if it raises, the
        replica stays out of service and the exception propagates. False,
        without calling `restore`, once the pool is shut down."""
        with self._lock:
            if self._closed:
                return False
            restore(slot)
            slot.incarnation, slot.state = incarnation, "ready"
            self._router.add(slot.index)
            return True

    def drop_replica(self, slot: Slot) -> None:
        """Gives up on a replica for good: it never takes work again (the
        pool goes on with the others)."""
        with self._lock:
            slot.state = "dropped"

    def live_replica(self) -> Slot | None:
        """A replica in service (the first one), or None."""
        with self._lock:
            return next((s for s in self._slots if s.state == "ready"), None)

    # ---- observation -----------------------------------------------------------------
    def replicas(self) -> list[dict[str, Any]]:
        """Per replica: index, state ("ready", "recovering", "dropped"), and,
        for a ready one, its process id, weight version and unfinished requests."""
        self._require_open()
        with self._lock:
            slots = [(s.index, s.state) for s in self._slots]
        ready = {i: self._slots[i].actor.info.remote() for i, state in slots if state == "ready"}
        infos = gather(ready, "info", self.call_timeout_s, on_lost=self.recovery.lost_slot) if ready else {}
        return [{"index": i, "state": state, **infos.get(i, {})} for i, state in slots]

    def metrics(self) -> list[dict]:
        return list(self._fanout("metrics").values())

    def cache_stats(self) -> list[dict]:
        return list(self._fanout("cache_stats").values())

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[int, dict[str, str]]:
        """Replica index -> its `RolloutEngine.weights_checksum(names)`: after
        a sync every ready replica should give the trainer's digests."""
        from rollout_engine.validation import weight_name_list

        return self._fanout("weights_checksum", weight_name_list(names))

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until no replica is restarting (for tests and for callers
        that want the full pool before a step)."""
        deadline = time.monotonic() + timeout_s
        while any(s.state == "recovering" for s in self._slots):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica(s) {[s.index for s in self._slots if s.state == 'recovering']} "
                                   f"still restarting after {timeout_s} s")
            time.sleep(0.1)

    def shutdown(self) -> None:
        """Stop every replica and free its placement; idempotent. A Ray
        instance the pool started itself is stopped too."""
        if self._closed:
            return
        ray = ray_module()
        with self._lock:
            self._closed = True
        self.recovery.stop()
        live = {s.index: s.actor.shutdown.remote() for s in self._slots if s.state == "ready"}
        try:
            gather(live, "shutdown", min(self.call_timeout_s, 60.0))
        except Exception as e:  # noqa: BLE001 - the actors are killed below either way
            log.warning("pool shutdown: %s", e)
        self._release(ray)

    def _release(self, ray) -> None:
        release_replicas(ray, self._slots)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals -------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("pool is shut down")

    def _next_version(self, version: int | None) -> int:
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version must be None or an integer >= 0, got {version!r}")
        return self.recovery.version + 1 if version is None else version

    def _fanout(self, method: str, *args) -> dict[int, Any]:
        """A control on every ready replica; waits for all. `args[0]` may be
        a function of the slot that returns the call's ref."""
        self._require_open()
        with self._lock:
            ready = [s for s in self._slots if s.state == "ready"]
            if args and callable(args[0]):
                refs = {s.index: args[0](s) for s in ready}
            else:
                refs = {s.index: s.actor.call.remote(method, *args) for s in ready}
        return gather(refs, method, self.call_timeout_s, on_lost=self.recovery.lost_slot)
