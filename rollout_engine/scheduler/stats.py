"""Counters and timings the scheduler keeps for `engine.metrics()`."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rollout_engine.request import Request


@dataclass
class StepStats:
    output_tokens: int = 0  # sampled tokens handed to requests
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    step_seconds: float = 0.0  # host time inside step(), device waits included
    timed_steps: int = 0
    ttft_seconds: float = 0.0  # summed over requests: arrival to first sampled token
    ttft_count: int = 0

    def on_token(self, req: Request) -> None:
        self.output_tokens += 1
        if req.num_output_tokens == 1 and req.num_retractions == 0:
            self.ttft_seconds += time.monotonic() - req.arrival_time
            self.ttft_count += 1

    def on_finish(self, reason: str) -> None:
        self.finished[reason] += 1

    def on_step(self, seconds: float) -> None:
        self.step_seconds += seconds
        self.timed_steps += 1

    def snapshot(self) -> dict:
        return {"output_tokens": self.output_tokens, "finished": dict(self.finished),
                "steps_timed": self.timed_steps, "step_seconds_total": round(self.step_seconds, 6),
                "step_seconds_mean": self.step_seconds / self.timed_steps if self.timed_steps else None,
                "ttft_seconds_mean": self.ttft_seconds / self.ttft_count if self.ttft_count else None,
                "ttft_count": self.ttft_count}


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
