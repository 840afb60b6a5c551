"""What `RolloutEngine.generate` returns (public API)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RolloutOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float] | None  # one per output token
    top_logprobs: list[list[tuple[int, float]]] | None
    prompt_logprobs: list[float | None] | None  # first entry None (no context)
    finish_reason: str  # "stop" | "length" | "abort"
    text: str | None  # decoded output, when a tokenizer is loaded
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    weight_version: int  # version of the weights when the request finished
    # Per output token, the weight version that produced it (differs from
    # weight_version only across an update made while the request ran).
    output_weight_versions: list[int] = field(default_factory=list)
