"""Per-step RL metrics from what the engine already measures, to wandb.

    from rollout_engine.integrations.wandb import RolloutLogger
    logger = RolloutLogger(wandb.init(project="grpo", mode="offline"))   # or RolloutLogger(None): no-op
    row = logger.step(engine, outputs, timings={"generate": 3.1, "sync": 0.2}, extra={"reward_mean": 0.4})
    logger.log(row, step)

`step` reads `engine.metrics()` (the same source as the server's
/metrics) and reports what changed since the previous call: output tokens
per second of generation, prompt tokens computed vs served from the prefix
cache, retractions, response lengths, the time of each phase, and the
weight version. wandb is optional: without it (or with run=None) nothing is
logged and `step` still returns the row.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence


class RolloutLogger:
    def __init__(self, run: Any = None, prefix: str = "rollout/"):
        self.run = run
        self.prefix = prefix
        self._last: dict | None = None

    def step(self, engine, outputs: Sequence, timings: Mapping[str, float] | None = None,
             extra: Mapping[str, float] | None = None) -> dict[str, float]:
        """This step's row: engine counters since the previous call, response
        lengths of `outputs`, `timings` (seconds per phase) and `extra`."""
        m = engine.metrics()
        cache = m["cache"]
        last = self._last or {"output_tokens": 0, "computed": 0, "cached": 0, "retractions": 0}
        now = {"output_tokens": m["output_tokens"], "computed": cache["prompt_tokens_computed"],
               "cached": cache["matched_tokens"], "retractions": cache["retractions"]}
        self._last = now
        delta = {k: now[k] - last[k] for k in now}
        lengths = [len(o.output_token_ids) for o in outputs] or [0]
        timings = dict(timings or {})
        row: dict[str, float] = {
            "output_tokens": delta["output_tokens"],
            "prompt_tokens_computed": delta["computed"],
            "prompt_tokens_cached": delta["cached"],
            "prefix_hit_rate": delta["cached"] / max(1, delta["computed"] + delta["cached"]),
            "retractions": delta["retractions"],
            "response_length_mean": sum(lengths) / len(lengths),
            "response_length_max": max(lengths),
            "weight_version": m["weight_version"],
        }
        if timings.get("generate"):
            row["output_tokens_per_s"] = delta["output_tokens"] / timings["generate"]
        row.update({f"time/{k}": v for k, v in timings.items()})
        row.update(extra or {})
        return row

    def log(self, row: Mapping[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log({self.prefix + k: v for k, v in row.items()}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
