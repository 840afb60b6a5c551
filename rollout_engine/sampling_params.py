"""Per-request sampling parameters (public API)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from rollout_engine.suggest import keywords_checked, unknown_keyword

LOGPROB_MODES = ("processed", "raw")
MAX_SEED = 1 << 63


@dataclass(frozen=True)
class SamplingParams:
    """How one prompt is sampled. Validated on construction: a bad value raises
    `ValueError` naming the field.

    `logprob_mode="processed"` reports logprobs of the distribution actually
    sampled from (after temperature, top-k, top-p and min-p, renormalised); at
    temperature 0 (greedy) that distribution is taken at temperature 1 with the
    same filters. `"raw"` reports the model's unmodified log-softmax.
    `prompt_logprob_mode` does the same for prompt logprobs (default "raw"):
    "processed" scores each prompt token under this request's temperature
    and filters, as a sampled token would be reported: -inf for a token that
    top-k, top-p or min-p exclude (rollout_engine.fidelity uses it to score
    sequences under sampling parameters).
    `return_routed_experts` (MoE, an engine built with
    enable_return_routed_experts=True): `RolloutOutput.routed_experts` holds
    the experts every MoE layer chose for each token that went through the
    model (routing replay in the trainer).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop: list[str] | None = None
    ignore_eos: bool = False
    logprobs: bool = True
    top_logprobs: int = 0
    logprob_mode: str = "processed"
    prompt_logprobs: bool = False
    prompt_logprob_mode: str = "raw"
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"sampling_params.{field} {why}, got {getattr(self, field)!r}")

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0 (0: the prompt alone, for its prompt_logprobs or to "
                "fill the prefix cache)")
        if not is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            bad("temperature", "must be a finite number >= 0")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (-1 or 0 disable it)")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            bad("seed", "must be None or an integer >= 0")
        if is_int(self.n) and self.seed is not None and self.seed + self.n - 1 >= MAX_SEED:
            # The sampler hashes seeds as signed 64-bit integers; sample i uses seed + i.
            raise ValueError(f"sampling_params.seed plus n - 1 must be below 2**63 (sample i of n uses seed + i), "
                             f"got seed={self.seed} and n={self.n}")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, (list, tuple))
            or not all(is_int(t) and t >= 0 for t in self.stop_token_ids)
        ):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.stop is not None and (
            not isinstance(self.stop, (list, tuple))
            or not all(isinstance(s, str) and s for s in self.stop)
        ):
            bad("stop", "must be a list of non-empty strings")
        if not is_int(self.top_logprobs) or self.top_logprobs < 0:
            bad("top_logprobs", "must be an integer >= 0")
        for mode in ("logprob_mode", "prompt_logprob_mode"):
            if getattr(self, mode) not in LOGPROB_MODES:
                bad(mode, f"must be one of {LOGPROB_MODES}")
        for flag in ("ignore_eos", "logprobs", "prompt_logprobs", "return_routed_experts"):
            if not isinstance(getattr(self, flag), bool):
                bad(flag, "must be a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        """0 means no top-k filter."""
        return max(self.top_k, 0)

    @functools.cached_property
    def plan_row(self) -> tuple[float, float, float, int, bool, int]:
        """(temperature, top_p, min_p, effective top-k, raw logprobs, top
        logprobs): this request's columns of a step's sampling plan, built
        once (the params are frozen)."""
        return (self.temperature, self.top_p, self.min_p, self.effective_top_k, self.logprob_mode == "raw",
                self.top_logprobs)


def _unknown_fields(kwargs) -> None:
    """`SamplingParams(...)` with a keyword it does not take names the closest
    field (the dataclass's own error does not)."""
    known = [f.name for f in fields(SamplingParams)]
    for name in kwargs:
        if name not in known:
            raise unknown_keyword("SamplingParams()", name, known, "rollout_engine.SamplingParams")


SamplingParams.__init__ = keywords_checked(SamplingParams.__init__, _unknown_fields)  # type: ignore[method-assign]


def is_int(x: object) -> bool:
    """An integer, not a bool (which Python counts as one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
