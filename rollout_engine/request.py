"""A request's whole state: the single source of truth the scheduler, the KV
manager and the output builder read and update."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rollout_engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # this sample's RNG stream; the token at position p draws from (seed, p)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_weight_versions: list[int] = field(default_factory=list)  # per sampled token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    text: str | None = None  # kept up to date only when stop strings need it
    # KV state. Invariant: the KV of all_ids[:kv_len] is stored at
    # table[row, :kv_len]; the first `locked_len` of those slots belong to
    # the prefix cache (under `cache_node`'s lock), the rest to this request.
    row: int | None = None
    kv_len: int = 0
    locked_len: int = 0
    cache_node: Any = None
    kv_epoch: int = 0  # the prefix cache's weight epoch when this KV started; another epoch's KV is never cached
    num_cached_tokens: int = 0
    weight_version: int = 0
    num_retractions: int = 0
    # Samples 1..n-1 of this prompt, waiting to be forked from this request's
    # first sampling step (they share its prompt KV through the prefix cache).
    fork_siblings: list["Request"] = field(default_factory=list)
    # Output positions scheduled ahead whose token is still being sampled
    # (PLACEHOLDER in output_ids until filled, in order).
    pending_tokens: int = 0
    # Set by an abort; the scheduler finishes the request before its next step.
    abort_requested: bool = False
    # return_routed_experts: the routing of its tokens, copied out when it finished (runner/routes.py)
    routes: Any = None
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens actually sampled (placeholders excluded)."""
        return len(self.output_ids) - self.pending_tokens

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """all_ids[i] without building all_ids."""
        n = len(self.prompt_ids)
        return self.output_ids[i - n] if i >= n else self.prompt_ids[i]

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (decode needs one token)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n: end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """More than the last sampled token still lacks KV."""
        return self.kv_len < self.seq_len - 1

    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)


PLACEHOLDER = -1  # an output token scheduled ahead, not sampled yet
