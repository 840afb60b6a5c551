"""From `generate` arguments to Requests: validation (every error a
ValueError naming the request and field), request ids, seeds, and the n
samples of a prompt."""
from __future__ import annotations

import random
from typing import Any, Sequence

from rollout_engine.request import Request
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.validation import Limits, check_request, resolve_params, resolve_prompts, resolve_request_ids


class RequestFactory:
    def __init__(self, tokenizer: Any, limits: Limits, seed: int):
        self.tokenizer = tokenizer
        self.limits = limits
        self._rng = random.Random(seed)  # seeds of requests that bring none
        self._next_id = 0

    def validate(self, prompts: Sequence[str] | None, input_ids: Sequence[Sequence[int]] | None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                 ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Token ids and parameters per prompt; raises before anything is created."""
        token_lists = resolve_prompts(prompts, input_ids, self.tokenizer, self.limits)
        params = resolve_params(sampling_params, len(token_lists))
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            check_request(i, ids, p, self.limits, self.tokenizer is not None)
        return token_lists, params

    def create(self, token_lists: list[list[int]], params: list[SamplingParams],
               request_ids: Sequence[str] | None, taken: set[str]) -> list[list[Request]]:
        """One group of n requests per prompt (sample j: id `base-j` when
        n > 1, seed `seed + j`). `taken`: ids of live requests."""
        names = resolve_request_ids(request_ids, len(token_lists), taken)
        groups, seen = [], set(taken)
        for i, (ids, p) in enumerate(zip(token_lists, params)):
            base = names[i] if names else f"req-{self._next_id}"
            self._next_id += 1
            sample_ids = [base] if p.n == 1 else [f"{base}-{j}" for j in range(p.n)]
            clash = next((s for s in sample_ids if s in seen), None)
            if clash is not None:  # e.g. "a" with n=2 next to a request named "a-0"
                raise ValueError(f"request {i}: request_ids {clash!r} is already in use")
            seen.update(sample_ids)
            first_seed = p.seed if p.seed is not None else self._rng.getrandbits(62)
            groups.append([Request(request_id=rid, prompt_ids=list(ids), params=p, seed=first_seed + j,
                                   prompt_logprobs=[None] if p.prompt_logprobs else None)
                           for j, rid in enumerate(sample_ids)])
        return groups
