"""Which requests' routing to copy out, gathered over one scheduler pass
and sent as one copy (routing capture; runner/routes.py does the copy)."""
from __future__ import annotations

import functools

import numpy as np

from rollout_engine.plan import StepRunner
from rollout_engine.request import Request
from rollout_engine.scheduler.kv_manager import KVManager

UNSENT = object()  # a request's routing kept, its copy not started yet (starts before the scheduler returns)


class RoutesKeeper:
    def __init__(self, kv: KVManager, runner: StepRunner):
        self.kv, self.runner = kv, runner
        self._wanted: list[tuple[Request, np.ndarray]] = []

    def keep(self, req: Request, kv_of: Request | None = None) -> None:
        """return_routed_experts: note the slots of the positions `req` has
        computed (or its fork leader `kv_of` for it) while they are still
        its: at its end, and when it gives them up to wait (retracted, or a
        forked sample queued), so that ending while it waits still reports
        what was computed (kept when it gave them up: nothing new since)."""
        kept_while_waiting = req.row is None and kv_of is None and req.routes is not None
        if req.params.return_routed_experts and not kept_while_waiting:
            # a copy: the table row is freed right after and may be refilled before the send
            self._wanted.append((req, np.array(self.kv.computed_slots(req, kv_of), dtype=np.int64)))
            req.routes = UNSENT

    def send(self) -> None:
        """Start one copy of the routing kept since the last one. The
        scheduler calls it before every launch (a step may reuse the slots)
        and at the end of every public entry that may keep some
        (`sends_routes`: outputs wait on it)."""
        if self._wanted:
            wanted, self._wanted = self._wanted, []
            for (req, _), part in zip(wanted, self.runner.routes_of([slots for _, slots in wanted])):
                req.routes = part


def sends_routes(method):
    """A Scheduler entry that ends by starting the copy of the routing it kept."""
    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self.routes.send()
    return entry
