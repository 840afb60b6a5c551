"""Server-sent events from an engine stream, for every streaming route."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from rollout_engine.outputs import RolloutOutput


def event(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse(admission, samples: int, stream: AsyncIterator[RolloutOutput],
              render: Callable[[RolloutOutput], dict], tail: Callable[[], dict | None] | None = None):
    """One event per delta (`render`), then `tail()` if it gives one, then
    `data: [DONE]`. The stream is created by the route (its arguments are
    checked before the response starts) and submitted on the first read. A
    failure after the response started (e.g. a prompt over the context
    length, found at admission) becomes an error event. A client that goes
    away closes this generator, which aborts the stream's requests."""
    with admission.held(samples):
        try:
            async for delta in stream:
                yield event(render(delta))
        except (ValueError, RuntimeError) as e:
            status = 400 if isinstance(e, ValueError) else 409
            yield event({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                   "code": status}})
        finally:
            await stream.aclose()
    last = tail() if tail is not None else None
    if last is not None:
        yield event(last)
    yield "data: [DONE]\n\n"
