"""A RolloutPool call's prompts, checked and cut into routing units."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable

from rollout_engine.integrations.ray.routing import Unit
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.validation import resolve_params


@dataclass(frozen=True)
class Batch:
    """One pool call's prompts, as the replicas get them."""
    prompts: list[str] | None
    input_ids: list[list[int]] | None
    params: list[SamplingParams]
    request_ids: list[str]
    units: list[Unit]

    def sample_ids(self) -> list[str]:
        return [rid if p.n == 1 else f"{rid}-{j}" for rid, p in zip(self.request_ids, self.params)
                for j in range(p.n)]

    def part(self, units: list[Unit]) -> tuple:
        """The arguments of a replica's generate/stream for these units."""
        idx = [u.index for u in units]
        return ([self.prompts[i] for i in idx] if self.prompts is not None else None,
                [self.input_ids[i] for i in idx] if self.input_ids is not None else None,
                [self.params[i] for i in idx], [self.request_ids[i] for i in idx])


def make_batch(prompts, input_ids, sampling_params, request_ids, session_ids, rng: random.Random,
               new_id: Callable[[], str]) -> Batch:
    """The call's prompts checked and made into units; prompts that bring no
    seed get one from `rng`, so that a re-run elsewhere gives the same samples."""
    if (prompts is None) == (input_ids is None):
        raise ValueError("give exactly one of prompts and input_ids")
    if input_ids is not None and hasattr(input_ids, "tolist"):  # a 2-D numpy array or tensor
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (list, tuple)):  # rows may be numpy arrays or tensors, as the engine takes them
        input_ids = [x.tolist() if hasattr(x, "tolist") else x for x in input_ids]
    items = prompts if prompts is not None else input_ids
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise ValueError(f"{'prompts' if prompts is not None else 'input_ids'} must be a list")
    if input_ids is not None and not all(isinstance(x, (list, tuple)) for x in input_ids):
        raise ValueError("input_ids must be a list of token-id lists")
    num = len(items)
    params = [p if p.seed is not None else replace(p, seed=rng.getrandbits(62))
              for p in resolve_params(sampling_params, num)]
    if request_ids is None:
        request_ids = [new_id() for _ in range(num)]
    elif isinstance(request_ids, str) or not isinstance(request_ids, (list, tuple)) or len(request_ids) != num:
        raise ValueError(f"request_ids must be a list of {num} strings")
    elif len(set(map(str, request_ids))) != num:
        raise ValueError("request_ids must be distinct")
    if session_ids is not None and (isinstance(session_ids, str) or not isinstance(session_ids, (list, tuple))
                                    or len(session_ids) != num):
        raise ValueError(f"session_ids must be None or a list of {num} ids (one per prompt)")
    if session_ids is not None and not all(s is None or isinstance(s, (str, int)) for s in session_ids):
        raise ValueError("session_ids: each must be a string, an integer or None")
    units = []
    for i, (item, p) in enumerate(zip(items, params)):
        size = len(item) // 3 + 1 if isinstance(item, str) else len(item)
        key = item if isinstance(item, str) else tuple(item)
        session = session_ids[i] if session_ids is not None else None
        units.append(Unit(index=i, cost=size + p.n * p.max_new_tokens, session=session, prompt_key=key))
    return Batch(list(prompts) if prompts is not None else None,
                 [list(x) for x in input_ids] if input_ids is not None else None,
                 params, list(request_ids), units)
