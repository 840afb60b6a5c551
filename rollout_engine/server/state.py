"""What the routes share: the engine, the settings, the admission bound,
and how a request's wait ends when its client goes away."""
from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager
from typing import Any, Awaitable

from fastapi import Request

from rollout_engine.server.config import ServerConfig
from rollout_engine.server.errors import ApiError

DISCONNECT_POLL_SECONDS = 0.25


class Admission:
    """At most `limit` samples admitted at once (queued or running in the
    engine); past it a request is answered 503 with Retry-After at once,
    instead of queueing without bound."""

    def __init__(self, limit: int):
        self.limit, self.admitted = limit, 0

    def check(self, samples: int) -> None:
        if samples > self.limit:  # could never be admitted: the request is wrong, not the timing
            raise ApiError(400, f"the request asks for {samples} samples, more than the server admits at once "
                                f"({self.limit}): lower n or split the batch", "n")
        if self.admitted + samples > self.limit:
            raise ApiError(503, f"the server is at its limit of {self.limit} queued samples; retry shortly",
                           headers={"Retry-After": "1"})

    @contextmanager
    def held(self, samples: int):
        """Count `samples` as admitted while the block runs (check first)."""
        self.admitted += samples
        try:
            yield
        finally:
            self.admitted -= samples

    @contextmanager
    def admit(self, samples: int):
        self.check(samples)
        with self.held(samples):
            yield


class ServerState:
    def __init__(self, engine, cfg: ServerConfig, model_name: str):
        self.engine, self.cfg, self.model_name = engine, cfg, model_name
        self.admission = Admission(cfg.max_queued_requests)
        self.metrics = None  # a Metrics, when prometheus-client is installed


def state_of(request: Request) -> ServerState:
    return request.app.state.server


class ClientGone(Exception):
    pass


async def until_done_or_gone(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client disconnects first, cancel it (which aborts
    its requests and frees their KV) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


async def read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON", "body") from None
