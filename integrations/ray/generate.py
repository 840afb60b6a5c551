"""RolloutPool.generate: a call's units sent to the replicas, their outputs
put back in input order. A replica that dies has its part re-run on the
others with the same seeds; an error or the deadline stops what still runs."""
from __future__ import annotations

import time
from typing import Any

from rollout_engine.integrations.ray.calls import lift_task_error, ray_module
from rollout_engine.outputs import RolloutOutput


def run_batch(pool, batch, deadline: float) -> list[RolloutOutput]:
    ray = ray_module()
    results: dict[int, list[RolloutOutput]] = {}
    pending: dict[Any, tuple] = {}  # ref -> (slot, its incarnation, units)

    def send(units) -> None:
        for r, part in pool.dispatch(units, deadline).items():
            slot = pool.slot(r)
            pending[slot.actor.generate.remote(*batch.part(part))] = (slot, slot.incarnation, part)

    send(batch.units)
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                names = sorted({slot.index for slot, _, _ in pending.values()})
                raise TimeoutError(f"replica(s) {names} did not finish generate before the call's deadline")
            slot, incarnation, units = pending.pop(done[0])
            pool.finished(slot.index, units)
            try:
                outs = ray.get(done[0])
            except ray.exceptions.RayActorError:
                pool.recovery.lost(slot, incarnation)
                send(units)  # the same seeds elsewhere: the same samples
                continue
            except ray.exceptions.RayTaskError as e:
                raise lift_task_error(e, slot.index) from None
            it = iter(outs)
            for u in units:
                results[u.index] = [next(it) for _ in range(batch.params[u.index].n)]
    finally:
        for slot, _, units in pending.values():  # an error or timeout: stop what still runs for this call
            pool.finished(slot.index, units)
            slot.actor.call.remote("abort", batch.sample_ids())
    return [o for i in range(len(batch.units)) for o in results[i]]
