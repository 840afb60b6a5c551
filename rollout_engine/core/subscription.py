"""A front-end call's requests and where their results go.

The loop thread feeds a Subscription; the front end that made it waits on
its `deliver` callable's other end (a queue for blocking callers, an asyncio
queue for async ones). Items delivered:

- ("delta", RolloutOutput)  streams: the tokens since the request's previous delta
- ("progress", n)           blocking calls with a progress bar: n more requests finished
- ("end", outputs)          every request finished (at once for a call of no prompts):
                            outputs in request order (streams: None)
- ("error", exception)      the call failed; nothing follows
"""
from __future__ import annotations

from typing import Any, Callable

from rollout_engine.outputs import RolloutOutput, build_output, routes_ready
from rollout_engine.request import Request
from rollout_engine.scheduler.stop import StopChecker


def counts_as_done(finish_reason: str | None) -> bool:
    """Whether a progress bar counts a finished request: stopped by an abort, it is not done."""
    return finish_reason != "abort"

Deliver = Callable[[tuple[str, Any]], None]


class Subscription:
    def __init__(self, deliver: Deliver, stream: bool = False, progress: bool = False):
        self.deliver = deliver
        self.stream = stream
        self.progress = progress
        self.reqs: list[Request] = []
        self.done = False
        self._outputs: list[RolloutOutput | None] = []
        self._index: dict[int, int] = {}  # id(request) -> position
        self._sent: list[int] = []  # streams: output tokens delivered per request
        self._open: list[int] = []  # streams: positions of requests whose last delta is not out yet
        self._remaining = 0

    def attach(self, reqs: list[Request]) -> None:
        self.reqs = reqs
        self._outputs = [None] * len(reqs)
        self._index = {id(r): i for i, r in enumerate(reqs)}
        self._sent = [0] * len(reqs)
        self._open = list(range(len(reqs)))
        self._remaining = len(reqs)
        if not reqs:  # nothing will finish or stream: the call ends now
            self._end(None if self.stream else [])

    # ---- called on the loop thread --------------------------------------------
    def on_finish(self, req: Request, stop: StopChecker) -> None:
        """`req` (one of ours) finished. Streams send its last delta at the next
        `poll`; the others keep its output for the end."""
        if self.stream or self.done:
            return
        self._outputs[self._index[id(req)]] = build_output(req, stop)
        self._remaining -= 1
        if self.progress and counts_as_done(req.finish_reason):
            self.deliver(("progress", 1))
        if self._remaining == 0:
            self._end(self._outputs)

    def poll(self, stop: StopChecker, wait: bool = False) -> None:
        """Streams: deliver a delta for every request with new tokens (or that
        finished) since the last poll. A finished request whose routing is
        still being copied to the host waits for a later poll (`wait`: not)."""
        still_open = []
        for i in self._open:
            r = self.reqs[i]
            if r.finished and not (wait or routes_ready(r)):
                still_open.append(i)
                continue
            if r.num_output_tokens > self._sent[i] or r.finished:
                self.deliver(("delta", build_output(r, stop, since=self._sent[i])))
                self._sent[i] = r.num_output_tokens
            if not r.finished:
                still_open.append(i)
        self._open = still_open
        if not still_open:
            self._end(None)

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.done = True
            self.deliver(("error", error))

    def _end(self, outputs) -> None:
        self.done = True
        self.deliver(("end", outputs))
