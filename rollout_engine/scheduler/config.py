"""The scheduler's settings, frozen and passed in by whoever builds it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    # Admission keeps room for this share of the running requests' remaining
    # new tokens; it rises to 1 after a retraction and decays back.
    init_new_token_ratio: float = 0.5
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    # Schedule step N+1 while step N runs on the device.
    overlap: bool = True
    # Decode plans name the sequences that hold the same prefix-cache node
    # (StepPlan.share_keys): on where the attention backend reads a shared
    # prefix once (`AttentionBackend.reads_shared_prefixes`).
    share_prefixes: bool = False
