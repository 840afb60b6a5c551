"""RolloutPool.stream: the replicas' streams merged into one iterator.

Each replica's part of the call streams from its actor (a Ray streaming
generator) into one queue, read by the caller. If a replica dies mid-stream
its prompts are re-run elsewhere with the same seeds, so they produce the
same tokens again; what the caller already has is cut from the new deltas."""
from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import replace
from typing import Iterator

from rollout_engine.integrations.ray.calls import lift_task_error, ray_module
from rollout_engine.outputs import RolloutOutput


def _pump(slot, part, key, out: queue.Queue) -> None:
    ray = ray_module()
    try:
        for ref in slot.actor.stream.options(num_returns="streaming").remote(*part):
            out.put(("delta", key, ray.get(ref)))
    except ray.exceptions.RayActorError:
        out.put(("lost", key, None))
    except ray.exceptions.RayTaskError as e:
        out.put(("error", key, lift_task_error(e, slot.index)))
    except Exception as e:  # noqa: BLE001 - handed to the caller's thread
        out.put(("error", key, e))
    else:
        out.put(("done", key, None))


class _Delivered:
    """What the caller has of each request, and what each attempt re-sent."""

    def __init__(self):
        self.tokens: dict[str, int] = defaultdict(int)
        self.chars: dict[str, int] = defaultdict(int)
        self.finished: set[str] = set()
        self.seen: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])  # (attempt, request) -> [tokens, chars]

    def new_part(self, attempt: int, d: RolloutOutput) -> RolloutOutput | None:
        rid = d.request_id
        if rid in self.finished:
            return None
        seen = self.seen[attempt, rid]
        start, m = seen[0], len(d.output_token_ids)
        seen[0] += m
        skip = max(0, self.tokens[rid] - start)
        text = d.text
        if text is not None:
            cstart = seen[1]
            seen[1] += len(text)
            text = text[max(0, self.chars[rid] - cstart):]
            self.chars[rid] = max(self.chars[rid], seen[1])
        if skip >= m and d.finish_reason is None:
            return None
        self.tokens[rid] = max(self.tokens[rid], start + m)
        if d.finish_reason is not None:
            self.finished.add(rid)
        cut = lambda xs: None if xs is None else xs[skip:]  # noqa: E731
        return replace(d, output_token_ids=d.output_token_ids[skip:], output_logprobs=cut(d.output_logprobs),
                       top_logprobs=cut(d.top_logprobs), output_weight_versions=d.output_weight_versions[skip:],
                       text=text)


def merge_streams(pool, batch, deadline: float) -> Iterator[RolloutOutput]:
    out: queue.Queue = queue.Queue()
    running: dict[int, tuple] = {}  # attempt -> (slot, incarnation, units)
    attempts = iter(range(1 << 62))
    delivered = _Delivered()

    def send(units) -> None:
        for r, part in pool.dispatch(units, deadline).items():
            slot, key = pool.slot(r), next(attempts)
            running[key] = (slot, slot.incarnation, part)
            threading.Thread(target=_pump, args=(slot, batch.part(part), key, out), daemon=True).start()

    send(batch.units)
    try:
        while running:
            try:
                kind, key, value = out.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                names = sorted({slot.index for slot, _, _ in running.values()})
                raise TimeoutError(f"replica(s) {names} did not finish the stream before its deadline") from None
            if kind == "delta":
                piece = delivered.new_part(key, value)
                if piece is not None:
                    yield piece
                continue
            slot, incarnation, units = running.pop(key)
            pool.finished(slot.index, units)
            if kind == "lost":
                pool.recovery.lost(slot, incarnation)
                send(units)
            elif kind == "error":
                raise value
    finally:
        if running:  # closed early, an error or a timeout: stop this call's requests everywhere
            for slot, _, units in running.values():
                pool.finished(slot.index, units)
            pool.abort(batch.sample_ids())
