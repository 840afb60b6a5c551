"""Counters and timings the scheduler keeps for `engine.metrics()`."""
from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

from rollout_engine.request import Request


# Upper bounds in seconds; a last bucket (+inf) takes the rest.
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), the last one for +inf
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": round(self.total, 6),
                "count": sum(self.counts)}


@dataclass
class StepStats:
    output_tokens: int = 0  # sampled tokens handed to requests
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    step_seconds: float = 0.0  # host time inside step(), device waits included
    timed_steps: int = 0
    ttft_seconds: float = 0.0  # summed over requests: arrival to first sampled token
    ttft_count: int = 0
    step_histogram: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    ttft_histogram: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))

    def on_token(self, req: Request) -> None:
        self.output_tokens += 1
        if req.num_output_tokens == 1 and req.num_retractions == 0:
            ttft = time.monotonic() - req.arrival_time
            self.ttft_seconds += ttft
            self.ttft_count += 1
            self.ttft_histogram.observe(ttft)

    def on_finish(self, reason: str) -> None:
        self.finished[reason] += 1

    def on_step(self, seconds: float) -> None:
        self.step_seconds += seconds
        self.timed_steps += 1
        self.step_histogram.observe(seconds)

    def snapshot(self) -> dict:
        return {"output_tokens": self.output_tokens, "finished": dict(self.finished),
                "steps_timed": self.timed_steps, "step_seconds_total": round(self.step_seconds, 6),
                "step_seconds_mean": self.step_seconds / self.timed_steps if self.timed_steps else None,
                "ttft_seconds_mean": self.ttft_seconds / self.ttft_count if self.ttft_count else None,
                "ttft_count": self.ttft_count, "step_seconds_histogram": self.step_histogram.snapshot(),
                "ttft_seconds_histogram": self.ttft_histogram.snapshot()}


def counters(prefix_cache, scheduler) -> dict:
    """Prefix-cache and scheduler counters since the engine started
    (`engine.cache_stats()`)."""
    st = prefix_cache.stats
    return {"queried_tokens": st.queried_tokens, "matched_tokens": st.matched_tokens,
            "hit_rate": st.hit_rate, "evicted_tokens": st.evicted_tokens,
            "cached_tokens": prefix_cache.cached_tokens, "retractions": scheduler.num_retractions,
            "steps": scheduler.num_steps, "ahead_steps": scheduler.num_ahead_steps,
            "prompt_tokens_computed": scheduler.prompt_tokens_computed,
            "decode_tokens": scheduler.decode_tokens}
