"""`rollout-engine bench`: run a workload, print and write JSON."""
from __future__ import annotations

import gc
import json
import platform
import time
from typing import Any

import torch

from rollout_engine.bench import workloads


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def run_workload(engine, wl: workloads.Workload) -> dict[str, Any]:
    before = engine.cache_stats()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(input_ids=wl.input_ids, sampling_params=wl.params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    after = engine.cache_stats()
    out_tokens = sum(len(o.output_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {
        "seconds": round(elapsed, 3),
        "output_tokens": out_tokens,
        "output_tok_per_s": round(out_tokens / elapsed, 1),
        "prompt_tokens": wl.prompt_tokens,
        "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
        "prompt_tokens_cached": cached,
        "cache_hit_rate": round(cached / wl.prompt_tokens, 4),
        "ideal_hit_rate": round(1 - len(wl.input_ids) / wl.num_samples, 4),
        "steps": after["steps"] - before["steps"],
        "retractions": after["retractions"] - before["retractions"],
    }


def bench_grpo(args) -> dict[str, Any]:
    from rollout_engine import RolloutEngine

    results: dict[str, Any] = {}
    for cache_on in (False, True):
        engine = RolloutEngine(args.model, load_format=args.load_format, attention_backend=args.attention_backend,
                               enable_prefix_cache=cache_on, max_total_tokens=args.max_total_tokens, seed=args.seed)
        vocab = engine.model_config.vocab_size
        wl = workloads.grpo(vocab, args.num_prompts, args.n, args.prompt_min, args.prompt_max, args.output_len)
        warm = workloads.grpo(vocab, 2, 2, 16, 32, 8, seed=99)
        engine.generate(input_ids=warm.input_ids, sampling_params=warm.params)  # warm-up
        results["cache_on" if cache_on else "cache_off"] = run_workload(engine, wl)
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    on, off = results["cache_on"], results["cache_off"]
    results["speedup_cache_on"] = round(off["seconds"] / on["seconds"], 3)
    return results


WORKLOADS = {"grpo": bench_grpo}


def main(args) -> int:
    report = {
        "workload": args.workload, "model": args.model, "load_format": args.load_format,
        "attention_backend": args.attention_backend, "device": _device_name(),
        "date": time.strftime("%Y-%m-%d"), "config": {k: v for k, v in vars(args).items() if k != "func"},
    }
    report["results"] = WORKLOADS[args.workload](args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0
