"""Waiting on replicas: every remote call of the pool has a deadline, and
its errors name the replica."""
from __future__ import annotations

from typing import Any, Callable


def ray_module():
    try:
        import ray
    except ImportError:
        raise ImportError('RolloutPool needs Ray: pip install -e ".[ray]"') from None
    return ray


def lift_task_error(error, index: int) -> Exception:
    """The engine's own exception (ValueError naming the field, ...) out of
    Ray's wrapper, noting which replica raised it."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, Exception):
        cause.add_note(f"(raised on replica {index})")
        return cause
    return RuntimeError(f"replica {index}: {error}")


def gather(refs: dict[int, Any], what: str, timeout_s: float,
           on_lost: Callable[[int], None] | None = None) -> dict[int, Any]:
    """Results by replica index. A replica that died is left out (and
    reported to `on_lost`, which brings it back); an engine error is raised
    as itself; a replica past the deadline raises TimeoutError naming it."""
    ray = ray_module()
    if not refs:
        return {}
    by_ref = {ref: index for index, ref in refs.items()}
    done, late = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout_s)
    if late:
        names = sorted(by_ref[r] for r in late)
        raise TimeoutError(f"replica(s) {names} did not answer {what} within {timeout_s} s")
    out = {}
    for ref in done:
        index = by_ref[ref]
        try:
            out[index] = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            if on_lost is None:
                raise RuntimeError(f"replica {index} died during {what}: {_why(e)}") from None
            on_lost(index)
        except ray.exceptions.RayTaskError as e:
            raise lift_task_error(e, index) from None
    return out


def _why(error) -> str:
    """The useful line of an actor's death (its constructor's exception),
    with the first exception of its chain where that one differs: a
    wrapper's message ("Could not import module ...") names the cause only
    there."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    raised = [ln for ln in lines if ("Error:" in ln or "Exception:" in ln) and not ln.startswith("ray.")]
    if not raised:
        return lines[0] if lines else type(error).__name__
    return raised[-1] if raised[0] == raised[-1] else f"{raised[-1]} (caused by {raised[0]})"


class PoolCall:
    """A control running on every replica while the caller does its part
    (the trainer's broadcast); `wait()` returns when all are done."""

    def __init__(self, pool, what: str, refs: dict[int, Any], timeout_s: float, result: Any = None,
                 world_size: int | None = None):
        self.pool, self.what, self.refs, self.timeout_s = pool, what, refs, timeout_s
        self.result, self.world_size = result, world_size

    def wait(self, timeout_s: float | None = None) -> Any:
        gather(self.refs, self.what, self.timeout_s if timeout_s is None else timeout_s,
               on_lost=self.pool.recovery.lost_slot)
        return self.result
