"""Placing a RolloutPool's replicas: one Ray actor per engine, each in a
placement group of its own (`tp_size` GPUs packed on one node, or CPUs), so
that an engine's ranks never straddle nodes. Ray owns the actors' processes
and restarts one that dies (up to `max_restarts` times)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_engine.integrations.ray.replica import EngineReplica


@dataclass
class Slot:
    """The pool's handle on one replica. Its state changes only under the
    pool's lock: "ready" (takes work) -> "recovering" (its actor died and Ray
    restarts it) -> "ready" again, or "dropped" (it cannot come back)."""
    index: int
    actor: Any
    group: Any  # its placement group
    state: str = "ready"  # "ready" | "recovering" | "dropped"
    incarnation: str | None = None  # changes when Ray restarts the actor
    sync_group: str | None = None  # the weight-sync group it has joined


def replica_bundle(ray, tp_size: int, device: str) -> dict[str, float]:
    """The resources one replica needs on one node. ValueError at once when
    no node of the cluster could ever hold them: Ray would wait forever."""
    gpus = tp_size if device.startswith("cuda") or (
        device == "auto" and ray.cluster_resources().get("GPU", 0) > 0) else 0
    bundle = {"GPU": gpus, "CPU": 1} if gpus else {"CPU": tp_size}
    have = ray.cluster_resources()
    short = {k: v for k, v in bundle.items() if have.get(k, 0) < v}
    if short:
        raise ValueError(f"one replica needs {bundle} on one node; the Ray cluster has {have.get('GPU', 0):g} "
                         f"GPUs and {have.get('CPU', 0):g} CPUs in all (tp_size={tp_size}, device={device!r})")
    return bundle


def place_replicas(ray, slots: list[Slot], bundle: dict[str, float], num_replicas: int, max_restarts: int,
                   model: str, engine_kwargs: dict[str, Any], timeout_s: float) -> None:
    """Starts `num_replicas` engine actors, each appended to `slots` as soon
    as it exists, so that a caller failing midway can release those placed.
    Returns without waiting for the engines to load."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_cls = ray.remote(EngineReplica)
    for i in range(num_replicas):
        group = placement_group([bundle], strategy="STRICT_PACK")
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"replica {i}: Ray cannot place {bundle} on one node within "
                               f"{timeout_s} s (free now: {ray.available_resources()})") from None
        actor = actor_cls.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=max_restarts, max_task_retries=0,
            max_concurrency=32,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(model, engine_kwargs)
        slots.append(Slot(index=i, actor=actor, group=group))


def release_replicas(ray, slots: list[Slot]) -> None:
    """Kills every replica for good and frees its placement."""
    for s in slots:
        ray.kill(s.actor, no_restart=True)
        ray.util.remove_placement_group(s.group)
