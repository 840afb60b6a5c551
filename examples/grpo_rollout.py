"""A GRPO-style rollout: n samples per prompt with per-token logprobs, and
the prefix cache serving the shared prompt to every sample.

    python examples/grpo_rollout.py
"""
from __future__ import annotations

import argparse
import time

from rollout_engine import RolloutEngine, SamplingParams

QUESTIONS = ["What is 12 * 7?", "Name a prime number larger than 20.", "What colour is the sky on a clear day?"]


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    engine = RolloutEngine("smollm2-135m", max_total_tokens=16384)
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=48, seed=0)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, progress=True)
    elapsed = time.perf_counter() - start
    for i, q in enumerate(QUESTIONS):
        group = outs[i * params.n:(i + 1) * params.n]
        print(f"\n{q}")
        for o in group:
            total_lp = sum(o.output_logprobs)
            print(f"  [{total_lp:8.2f}] {o.text[:70]!r}")
    stats = engine.cache_stats()
    tokens = sum(len(o.output_token_ids) for o in outs)
    print(f"\n{tokens} tokens in {elapsed:.2f} s; prompt tokens from the cache: "
          f"{sum(o.num_cached_tokens for o in outs)} of {sum(len(o.prompt_token_ids) for o in outs)}; "
          f"prompt tokens computed: {stats['prompt_tokens_computed']}")


if __name__ == "__main__":
    main()
