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
from typing import Any, AsyncIterator, Iterator, Sequence

from rollout_engine.core.engine_core import EngineCore
from rollout_engine.core.subscription import Subscription
from rollout_engine.outputs import RolloutOutput
from rollout_engine.progress import Progress
from rollout_engine.sampling_params import SamplingParams

ABORT_WAIT_SECONDS = 10.0


Inputs = tuple[list[list[int]], list[SamplingParams], Sequence[str] | None]  # token lists, params, request ids


def _abort_and_wait(core: EngineCore, sub: Subscription) -> None:
    core.abort_call(sub)
    applied: Future = Future()
    try:
        core.post(lambda: applied.set_result(None))
        applied.result(timeout=ABORT_WAIT_SECONDS)
    except (RuntimeError, FutureTimeout):  # a stopped loop, or a step that takes long: the abort still applies
        pass


def _items(core: EngineCore, inputs: Inputs, sub: Subscription, get) -> Iterator[tuple[str, Any]]:
    """Submit, then yield the call's items up to "end" (an error item
    raises); leaving before "end" aborts the call."""
    ended = False
    try:
        core.submit(*inputs, sub)
        while True:
            kind, value = get()
            if kind == "error":
                raise value
            ended = kind == "end"
            yield kind, value
    finally:
        if not ended:  # closed early, interrupted or failed
            _abort_and_wait(core, sub)


async def _async_items(core: EngineCore, inputs: Inputs, stream: bool,
                       progress: bool = False) -> AsyncIterator[tuple[str, Any]]:
    """`_items` for a coroutine: results arrive through its event loop; a
    cancelled wait aborts the call without blocking the loop."""
    loop = asyncio.get_running_loop()
    aq: asyncio.Queue = asyncio.Queue()

    def deliver(item) -> None:
        try:
            loop.call_soon_threadsafe(aq.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting
            pass

    sub = Subscription(deliver, stream=stream, progress=progress)
    ended = False
    try:
        core.submit(*inputs, sub)
        while True:
            kind, value = await aq.get()
            if kind == "error":
                raise value
            ended = kind == "end"
            yield kind, value
    finally:
        if not ended:  # cancelled (a timeout, Ctrl-C), closed early or failed
            core.abort_call(sub)


PROGRESS_TICK_SECONDS = 0.5


def generate(core: EngineCore, inputs: Inputs, progress: bool) -> list[RolloutOutput]:
    q: queue.SimpleQueue = queue.SimpleQueue()
    sub = Subscription(q.put, progress=progress)

    def get() -> tuple[str, Any]:
        if not progress:
            return q.get()
        try:
            return q.get(timeout=PROGRESS_TICK_SECONDS)
        except queue.Empty:
            return "tick", None

    with Progress(sum(p.n for p in inputs[1]), "rollout", "req", show=progress) as bar:
        for kind, value in _items(core, inputs, sub, get):
            if kind in ("progress", "tick"):
                # Requests of one batch finish together: the tokens made so
                # far show that it moves meanwhile (read racily, for display).
                bar.update(value or 0, redraw=kind == "tick", tokens=sum(r.num_output_tokens for r in sub.reqs))
            elif kind == "end":
                if progress and value is not None:  # the last line counts every token (an abort sends no progress)
                    bar.update(0, tokens=sum(len(o.output_token_ids) for o in value))
                return value


def stream(core: EngineCore, inputs: Inputs) -> Iterator[RolloutOutput]:
    q: queue.SimpleQueue = queue.SimpleQueue()
    items = _items(core, inputs, Subscription(q.put, stream=True), q.get)
    try:
        for kind, value in items:
            if kind == "end":
                return
            yield value
    finally:
        items.close()  # a stream closed early closes (and aborts) its call now


async def generate_async(core: EngineCore, inputs: Inputs, progress: bool = False) -> list[RolloutOutput]:
    items = _async_items(core, inputs, stream=False, progress=progress)
    with Progress(sum(p.n for p in inputs[1]), "rollout", "req", show=progress) as bar:
        try:
            async for kind, value in items:
                if kind == "progress":
                    bar.update(value or 0)
                    continue
                if progress:  # "end": the last line counts every token
                    bar.update(0, tokens=sum(len(o.output_token_ids) for o in value))
                return value
        finally:
            await items.aclose()


async def stream_async(core: EngineCore, inputs: Inputs) -> AsyncIterator[RolloutOutput]:
    items = _async_items(core, inputs, stream=True)
    try:
        async for kind, value in items:
            if kind == "end":
                return
            yield value
    finally:
        await items.aclose()
