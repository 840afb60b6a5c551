"""Benchmark workloads (docs/benchmarks.md): seeded request sets, independent of the engine."""
from __future__ import annotations

import random
from dataclasses import dataclass

from rollout_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    input_ids: list[list[int]]
    params: list[SamplingParams]

    @property
    def num_samples(self) -> int:
        return sum(p.n for p in self.params)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) * p.n for ids, p in zip(self.input_ids, self.params))


def _random_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    margin = min(1000, vocab // 4)  # keep clear of special tokens at both ends
    return [rng.randrange(margin, vocab - margin) for _ in range(length)]


def grpo(vocab: int, num_prompts: int = 64, n: int = 8, prompt_min: int = 256, prompt_max: int = 1024,
         output_len: int = 1024, seed: int = 0) -> Workload:
    """num_prompts groups of n samples sharing a prompt; fixed output length."""
    rng = random.Random(seed)
    ids = [_random_ids(rng, rng.randint(prompt_min, prompt_max), vocab) for _ in range(num_prompts)]
    params = [SamplingParams(n=n, max_new_tokens=output_len, temperature=1.0, ignore_eos=True, seed=seed + 1000 * i)
              for i in range(num_prompts)]
    return Workload("grpo", ids, params)


def offline(vocab: int, num_requests: int = 256, in_min: int = 100, in_max: int = 1024, out_min: int = 100,
            out_max: int = 1024, seed: int = 0) -> Workload:
    """Independent requests of random input and output lengths."""
    rng = random.Random(seed)
    ids = [_random_ids(rng, rng.randint(in_min, in_max), vocab) for _ in range(num_requests)]
    params = [SamplingParams(max_new_tokens=rng.randint(out_min, out_max), temperature=0.6, ignore_eos=True)
              for _ in range(num_requests)]
    return Workload("offline", ids, params)


# Mean output length of the long tail at scale 1 (0.70 x 2,560 + 0.25 x 8,192 + 0.05 x 16,384).
LONGTAIL_MEAN_OUTPUT = 0.70 * 2560 + 0.25 * 8192 + 0.05 * 16384


def longtail(vocab: int, scale: float = 1.0, n: int = 16, seed: int = 0, context: int | None = None) -> Workload:
    """docs/benchmarks.md's long tail: 64 prompts of 1,024 tokens x n samples, each
    sample with its own length: 70% U[1k, 4k], 25% U[4k, 12k], 5% 16k.
    `scale` in (0, 1] shrinks it to fit one run: round(64 * scale) prompts,
    lengths times sqrt(scale) (0.25: 16 prompts, tails of 8k). Samples are
    separate requests with the same prompt (the prefix cache shares it).
    `context`: the model's, to which prompt + output lengths are capped."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale: must be in (0, 1], got {scale}")
    rng = random.Random(seed)
    f = scale ** 0.5
    num_prompts = max(1, round(64 * scale))
    prompt_len = max(8, round(1024 * f))

    def length() -> int:
        u = rng.random()
        lo, hi = (1024, 4096) if u < 0.70 else (4096, 12288) if u < 0.95 else (16384, 16384)
        out = max(1, round(rng.randint(lo, hi) * f))
        return out if context is None else max(1, min(out, context - prompt_len))

    ids, params = [], []
    for i in range(num_prompts):
        prompt = _random_ids(rng, prompt_len, vocab)
        for j in range(n):
            ids.append(prompt)
            params.append(SamplingParams(max_new_tokens=length(), temperature=1.0, ignore_eos=True,
                                         seed=seed + 1000 * i + j))
    return Workload("longtail", ids, params)
