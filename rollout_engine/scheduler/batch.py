"""What one step computes, as CPU data: the runner turns it into tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollout_engine.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    """Extend `req` by all_ids[start:start+extend_len]; its KV goes to `slots`."""

    req: Request
    start: int
    extend_len: int
    slots: np.ndarray
    # Where the sampled token goes when the next step was scheduled before
    # this one's result arrived (a placeholder in output_ids); None: appended.
    fill_index: int | None = None
    # The extend reaches the last known token, so the step samples the next
    # one (fixed when scheduled: placeholders added later do not change it).
    # None: worked out from the request.
    samples: bool | None = None

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = self.end == self.req.seq_len

    @property
    def end(self) -> int:
        return self.start + self.extend_len

    @property
    def prompt_logprob_end(self) -> int:
        """Prompt-logprob targets are positions [start, prompt_logprob_end):
        logits at p score token p+1."""
        if not self.req.wants_prompt_logprobs():
            return self.start
        return max(self.start, min(self.end, len(self.req.prompt_ids) - 1))


@dataclass
class Batch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    weight_version: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_decode(self) -> bool:
        return all(s.extend_len == 1 for s in self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(s.extend_len for s in self.seqs)

    @property
    def prompt_tokens(self) -> int:
        """Positions of the batch inside their prompts (prefill); the rest of
        `num_tokens` are decode positions."""
        total = 0
        for s in self.seqs:  # per step, over every sequence: kept to one comparison for a decode past its prompt
            n = len(s.req.prompt_ids)
            if s.start < n:
                total += min(s.start + s.extend_len, n) - s.start
        return total

    def input_ids(self) -> np.ndarray:
        if self.is_decode:  # one token each
            return np.fromiter((s.req.token_at(s.start) for s in self.seqs), dtype=np.int64, count=len(self.seqs))
        return np.fromiter(
            (t for s in self.seqs for t in s.req.tokens(s.start, s.end)), dtype=np.int64, count=self.num_tokens
        )

    def positions(self) -> np.ndarray:
        if self.is_decode:
            return np.fromiter((s.start for s in self.seqs), dtype=np.int64, count=len(self.seqs))
        return np.concatenate([np.arange(s.start, s.end, dtype=np.int64) for s in self.seqs])

    def out_cache_loc(self) -> np.ndarray:
        if self.is_decode:
            return np.fromiter((s.slots[0] for s in self.seqs), dtype=np.int64, count=len(self.seqs))
        return np.concatenate([s.slots for s in self.seqs]).astype(np.int64)
