"""StepPlan: everything one step computes, as plain data.

The scheduler emits a plan per step; a runner (`StepRunner`) turns it into
tensors, runs the model and samples, and answers with a StepOutput. Neither side sees the
other's objects: a plan holds numpy arrays and numbers only, so it pickles,
can be broadcast to tensor-parallel ranks, and replays on another runner
built on the same weights (same plans in, same tokens out).

Rows: a plan extends B sequences by T tokens in total (decode: one each).
Logits are computed for `logit_rows` only; sampling rows index into those
(fork siblings sample from their leader's row with their own seeds), as do
prompt-logprob rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass
class SamplingPlan:
    """Per sampling row: parameters, the RNG stream (seed, position of the
    token drawn) and the logprob options."""

    temperatures: np.ndarray  # float32; 0 = greedy
    top_ps: np.ndarray  # float32
    min_ps: np.ndarray  # float32
    top_ks: np.ndarray  # int64; 0 = off
    seeds: np.ndarray  # int64
    positions: np.ndarray  # int64
    raw_logprobs: np.ndarray  # bool: logprob_mode == "raw"
    top_logprobs: np.ndarray  # int64: top logprobs wanted

    def __len__(self) -> int:
        return len(self.seeds)

    def row(self, i: int) -> "SamplingPlan":
        """Row i alone (its own filter flags, as if sampled by itself)."""
        return self.rows(i, i + 1)

    def rows(self, start: int, end: int) -> "SamplingPlan":
        return SamplingPlan(**{name: value[start: end] for name, value in vars(self).items()})

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperatures == 0).all())

    @property
    def use_sort_filters(self) -> bool:
        return bool(((self.top_ks > 0) | (self.top_ps < 1.0)).any())

    @property
    def use_min_p(self) -> bool:
        return bool((self.min_ps > 0).any())

    @property
    def max_top_logprobs(self) -> int:
        return int(self.top_logprobs.max(initial=0))

    @property
    def plain(self) -> bool:
        """Every row samples at its temperature (or greedily) without top-k,
        top-p or min-p and asks for no top logprobs."""
        return not (self.use_sort_filters or self.use_min_p or self.max_top_logprobs)


@dataclass
class StepPlan:
    # Per token [T]. Under the overlap schedule a step is planned before the
    # previous step's tokens are known: then `prev_rows` names, per sequence,
    # the previous plan's sampling row whose token is the sequence's last
    # input (input_ids holds a placeholder there), or -1 where the input is
    # known.
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray  # KV slot of each new token
    # Per sequence [B].
    extend_lens: np.ndarray
    seq_lens: np.ndarray  # context length after the step
    rows: np.ndarray  # request-table row
    prev_rows: np.ndarray | None
    # Request-table cells written since the previous plan: [3, N] (row,
    # column, slot), or None. A runner applies them before the step.
    table_writes: np.ndarray | None
    # Hidden rows that need logits, and what they are for.
    logit_rows: np.ndarray
    sample_rows: np.ndarray  # per sampling row: index into logit_rows
    prompt_rows: np.ndarray  # per prompt-logprob target: index into logit_rows
    prompt_targets: np.ndarray  # the token each prompt row scores
    sampling: SamplingPlan | None
    is_decode: bool
    # Per prompt row, when some request of the step wants processed prompt
    # logprobs (prompt_logprob_mode): its parameters (raw rows marked raw).
    prompt_sampling: SamplingPlan | None = None
    # Decode steps where sequences hold the same prefix-cache node (the n
    # samples of one prompt): per sequence a key (equal keys: the same node;
    # -1: none) and how many tokens of its context that node covers, so that
    # attention may read those once for all of them; None when no two share.
    share_keys: np.ndarray | None = None
    share_lens: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def logits_for_all_rows(self) -> bool:
        return len(self.logit_rows) == self.num_tokens

    @property
    def samples_every_logit_row(self) -> bool:
        return self.sampling is not None and np.array_equal(self.sample_rows, np.arange(len(self.logit_rows)))


@dataclass
class StepOutput:
    """A runner's answer to a plan, per sampling row and prompt row."""

    tokens: np.ndarray  # int64 [S]
    logprobs: np.ndarray  # float64 [S]
    top_ids: np.ndarray | None  # int64 [S, k]
    top_logprobs: np.ndarray | None  # float64 [S, k]
    prompt_logprobs: np.ndarray  # float64 [P]


class StepRunner(Protocol):
    def launch(self, plan: StepPlan, prev: Any = None) -> Any:
        """Start the step; `prev` is the previous launch's handle (its sampled
        tokens are the inputs of a plan with `prev_rows`)."""

    def collect(self, handle: Any) -> StepOutput:
        """Wait for a launched step's results."""

    def routes_of(self, slot_lists: list[np.ndarray]) -> list[Any]:
        """The routing recorded in each list's KV slots, on its way to the
        host in one copy (runner/routes.py); only with routing capture."""
