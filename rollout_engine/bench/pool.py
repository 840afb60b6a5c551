"""`bench --workload grpo --replicas R`: the grpo workload through a
RolloutPool of R replicas against a pool of one, in the same run (each
replica gets `tp_size` GPUs of its own, or CPUs)."""
from __future__ import annotations

import time
from typing import Any

from rollout_engine.bench import workloads
from rollout_engine.bench.common import engine_kwargs


def _run(pool, wl: workloads.Workload) -> dict[str, Any]:
    start = time.perf_counter()
    outs = pool.generate(input_ids=wl.input_ids, sampling_params=wl.params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.output_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"seconds": round(elapsed, 3), "output_tokens": out_tokens,
            "output_tok_per_s": round(out_tokens / elapsed, 1), "prompt_tokens": wl.prompt_tokens,
            "prompt_tokens_cached": cached, "cache_hit_rate": round(cached / wl.prompt_tokens, 4),
            "ideal_hit_rate": round(1 - len(wl.input_ids) / wl.num_samples, 4)}


def bench_grpo_pool(args) -> dict[str, Any]:
    from rollout_engine.integrations.ray import RolloutPool

    results: dict[str, Any] = {}
    for replicas in (1, args.replicas):
        kw = {**engine_kwargs(args), "tp_size": getattr(args, "tp_size", 1)}
        with RolloutPool(args.model, num_replicas=replicas, **kw) as pool:
            vocab = pool.model_config.vocab_size
            warm = workloads.grpo(vocab, 2 * replicas, 2, 16, 32, 8, seed=99)
            pool.generate(input_ids=warm.input_ids, sampling_params=warm.params)
            wl = workloads.grpo(vocab, args.num_prompts, args.n, args.prompt_min, args.prompt_max, args.output_len)
            results[f"replicas_{replicas}"] = _run(pool, wl)
    one, many = results["replicas_1"], results[f"replicas_{args.replicas}"]
    results["speedup"] = round(many["output_tok_per_s"] / one["output_tok_per_s"], 3)
    return results
