"""The generation front ends: submit to the EngineCore, then wait.

Whatever ends the wait early (a cancelled task, a closed stream, Ctrl-C, an
error) aborts the call's requests, so their KV memory goes back and nothing
keeps running for a caller that left. A blocking caller waits for that abort
to be applied (bounded); an async one does not block its event loop for it.
"""
from __future__ import annotations

import asyncio
import queue
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import AsyncIterator, Iterator, Sequence

from rollout_engine.core.engine_core import EngineCore
from rollout_engine.core.subscription import Subscription
from rollout_engine.outputs import RolloutOutput
from rollout_engine.sampling_params import SamplingParams

ABORT_WAIT_SECONDS = 10.0


def _item(kind: str, value):
    """An item's payload; an error item raises its exception."""
    if kind == "error":
        raise value
    return value


def _abort_and_wait(core: EngineCore, sub: Subscription) -> None:
    core.abort_call(sub)
    applied: Future = Future()
    try:
        core.post(lambda: applied.set_result(None))
        applied.result(timeout=ABORT_WAIT_SECONDS)
    except (RuntimeError, FutureTimeout):  # a stopped loop, or a step that takes long: the abort still applies
        pass


def generate(core: EngineCore, token_lists: list[list[int]], params: list[SamplingParams],
             request_ids: Sequence[str] | None, progress: bool) -> list[RolloutOutput]:
    from tqdm import tqdm

    q: queue.SimpleQueue = queue.SimpleQueue()
    sub = Subscription(q.put, progress=progress)
    bar = tqdm(total=sum(p.n for p in params), disable=not progress, desc="rollout", unit="req")
    ended = False
    try:
        core.submit(token_lists, params, request_ids, sub)
        while True:
            kind, value = q.get()
            value = _item(kind, value)
            if kind == "progress":
                bar.update(value)
            elif kind == "end":
                ended = True
                return value
    finally:
        bar.close()
        if not ended:
            _abort_and_wait(core, sub)


def stream(core: EngineCore, token_lists: list[list[int]], params: list[SamplingParams],
           request_ids: Sequence[str] | None) -> Iterator[RolloutOutput]:
    q: queue.SimpleQueue = queue.SimpleQueue()
    sub = Subscription(q.put, stream=True)
    ended = False
    try:
        core.submit(token_lists, params, request_ids, sub)
        while True:
            kind, value = q.get()
            value = _item(kind, value)
            if kind == "end":
                ended = True
                return
            yield value
    finally:
        if not ended:  # closed early, interrupted or failed
            _abort_and_wait(core, sub)


def _async_subscription(stream: bool) -> tuple[Subscription, asyncio.Queue]:
    loop = asyncio.get_running_loop()
    aq: asyncio.Queue = asyncio.Queue()

    def deliver(item) -> None:
        try:
            loop.call_soon_threadsafe(aq.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting
            pass

    return Subscription(deliver, stream=stream), aq


async def generate_async(core: EngineCore, token_lists: list[list[int]], params: list[SamplingParams],
                         request_ids: Sequence[str] | None) -> list[RolloutOutput]:
    sub, aq = _async_subscription(stream=False)
    ended = False
    try:
        core.submit(token_lists, params, request_ids, sub)
        kind, value = await aq.get()
        value = _item(kind, value)
        ended = True
        return value
    finally:
        if not ended:  # cancelled (a timeout, Ctrl-C) or failed
            core.abort_call(sub)


async def stream_async(core: EngineCore, token_lists: list[list[int]], params: list[SamplingParams],
                       request_ids: Sequence[str] | None) -> AsyncIterator[RolloutOutput]:
    sub, aq = _async_subscription(stream=True)
    ended = False
    try:
        core.submit(token_lists, params, request_ids, sub)
        while True:
            kind, value = await aq.get()
            value = _item(kind, value)
            if kind == "end":
                ended = True
                return
            yield value
    finally:
        if not ended:
            core.abort_call(sub)
