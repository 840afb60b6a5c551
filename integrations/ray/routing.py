"""Which replica of a RolloutPool runs which prompt (no Ray here).

A unit is one prompt with its n samples: they stay together, so the prompt
is prefilled once and its samples share the cached prefix. Units of one
session (`session_ids`) go where that session went before, while that
replica lives. Identical prompts of one call go together. Everything else
goes to the replica with the least queued work, counted in tokens (prompt
plus n times max_new_tokens: an upper bound of what the unit costs), not in
requests."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True)
class Unit:
    index: int  # the prompt's position in the caller's list
    cost: int  # tokens: prompt + n * max_new_tokens
    session: Hashable | None  # the caller's session id
    prompt_key: Hashable  # equal for identical prompts


class Router:
    def __init__(self, max_sessions: int = 100_000):
        self.queued: dict[int, int] = {}  # replica -> tokens dispatched and not yet returned
        self.sessions: OrderedDict[Hashable, int] = OrderedDict()  # least recently used first
        self.max_sessions = max_sessions

    def add(self, replica: int) -> None:
        self.queued.setdefault(replica, 0)

    def forget(self, replica: int) -> None:
        """A replica that died or was dropped: its sessions move on next time."""
        for key in [k for k, r in self.sessions.items() if r == replica]:
            del self.sessions[key]

    def assign(self, units: list[Unit], usable: list[int]) -> dict[int, list[Unit]]:
        """Replica -> its units, in input order; charges their cost."""
        if not usable:
            raise RuntimeError("no replica is available")
        plan: dict[int, list[Unit]] = {}
        by_prompt: dict[Hashable, int] = {}
        for unit in sorted(units, key=lambda u: (u.session is None, -u.cost)):  # sticky first, then largest first
            replica = self._sticky(unit, usable, by_prompt)
            if replica is None:
                replica = min(usable, key=lambda r: (self.queued.get(r, 0), r))
            by_prompt.setdefault(unit.prompt_key, replica)
            if unit.session is not None:
                self.sessions[unit.session] = replica
                self.sessions.move_to_end(unit.session)
                while len(self.sessions) > self.max_sessions:
                    self.sessions.popitem(last=False)
            self.queued[replica] = self.queued.get(replica, 0) + unit.cost
            plan.setdefault(replica, []).append(unit)
        return {r: sorted(us, key=lambda u: u.index) for r, us in plan.items()}

    def finished(self, replica: int, units: list[Unit]) -> None:
        if replica in self.queued:
            self.queued[replica] = max(0, self.queued[replica] - sum(u.cost for u in units))

    def _sticky(self, unit: Unit, usable: list[int], by_prompt: dict[Hashable, int]) -> int | None:
        if unit.session is not None and self.sessions.get(unit.session) in usable:
            return self.sessions[unit.session]
        if by_prompt.get(unit.prompt_key) in usable:
            return by_prompt[unit.prompt_key]
        return None
