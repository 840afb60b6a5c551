"""`rollout-engine bench`: run a workload (docs/benchmarks.md), print and write JSON."""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import sys
import time
from typing import Any

import torch

from rollout_engine.bench import workloads
from rollout_engine.bench.common import free_device_memory, make_engine, show_progress, sync
from rollout_engine.bench.roofline import (ModelCosts, decode_step_floor, measure_device, prefill_ceiling,
                                           workload_roofline)


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def engine_costs(engine) -> ModelCosts:
    """What a step of this engine reads and computes (its quantization and KV cache dtype counted)."""
    cfg = engine.config
    return ModelCosts.of(engine.model_config, fp8=cfg.quantization == "fp8", kv_fp8=cfg.kv_cache_dtype == "fp8_e4m3")


def run_workload(engine, wl: workloads.Workload) -> dict[str, Any]:
    # an engine that captures routing: every request asks for it (its cost is what is measured)
    routed = getattr(getattr(engine, "config", None), "enable_return_routed_experts", False)
    params = [dataclasses.replace(p, return_routed_experts=True) for p in wl.params] if routed else wl.params
    before = engine.cache_stats()
    sync()
    start = time.perf_counter()
    outs = engine.generate(input_ids=wl.input_ids, sampling_params=params, progress=show_progress())
    sync()
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
        "kv_capacity_tokens": engine.limits.kv_capacity,  # the KV cache's room (fp8_e4m3: one byte per element)
    } | ({"routed_experts_bytes": sum(o.routed_experts.nbytes for o in outs)} if routed else {})


def _warm(engine) -> None:
    warm = workloads.grpo(engine.model_config.vocab_size, 2, 2, 16, 32, 8, seed=99)
    engine.generate(input_ids=warm.input_ids, sampling_params=warm.params)


def bench_grpo(args) -> dict[str, Any]:
    if getattr(args, "replicas", 1) > 1:
        from rollout_engine.bench.pool import bench_grpo_pool

        return bench_grpo_pool(args)
    results: dict[str, Any] = {}
    limits = measure_device().times(getattr(args, "tp_size", 1)) if torch.cuda.is_available() else None
    for cache_on in (False, True):  # cache-off first: the first engine pays allocator warm-up
        engine = make_engine(args, enable_prefix_cache=cache_on)
        wl = workloads.grpo(engine.model_config.vocab_size, args.num_prompts, args.n, args.prompt_min,
                            args.prompt_max, args.output_len)
        _warm(engine)
        res = results["cache_on" if cache_on else "cache_off"] = run_workload(engine, wl)
        if limits is not None:  # samples as separate requests; with the cache, each prompt computed once
            input_lens = [len(ids) for ids, p in zip(wl.input_ids, wl.params) for _ in range(p.n)]
            output_lens = [p.max_new_tokens for p in wl.params for _ in range(p.n)]
            computed = sum(map(len, wl.input_ids)) if cache_on else sum(input_lens)
            _add_roofline(res, engine, limits, input_lens, output_lens, computed)
        free_device_memory(engine)
        del engine
    results["speedup_cache_on"] = round(results["cache_off"]["seconds"] / results["cache_on"]["seconds"], 3)
    return results


def _add_roofline(res: dict, engine, limits, input_lens: list[int], output_lens: list[int],
                  prefill_tokens: int | None = None) -> None:
    """The run's share of its workload roofline (docs/benchmarks.md)."""
    costs = engine_costs(engine)
    roof = workload_roofline(costs, limits, input_lens, output_lens, engine.config.max_running_requests,
                             prefill_tokens)
    res.update(roofline_tok_per_s=round(roof, 1), pct_of_roofline=round(100 * res["output_tok_per_s"] / roof, 1),
               bandwidth_TBps=round(limits.bandwidth / 1e12, 3), bf16_TFLOPs=round(limits.flops / 1e12, 1))


def bench_offline(args) -> dict[str, Any]:
    limits = measure_device().times(getattr(args, "tp_size", 1))
    engine = make_engine(args)
    wl = workloads.offline(engine.model_config.vocab_size, args.num_prompts)
    _warm(engine)
    res = run_workload(engine, wl)
    out_lens = [p.max_new_tokens for p in wl.params]
    _add_roofline(res, engine, limits, [len(x) for x in wl.input_ids], out_lens)
    free_device_memory(engine)
    del engine
    if args.baseline == "hf":
        from rollout_engine.bench.hf_baseline import hf_model, run_hf

        net = hf_model(args.model)
        k = args.hf_requests
        res["hf"] = run_hf(net, wl.input_ids[:k], out_lens[:k], 0.6, args.hf_batch_size)
        res["x_hf"] = round(res["output_tok_per_s"] / res["hf"]["output_tok_per_s"], 2)
        del net
    return res


def _decode_step_times(engine, batch: int, context: int, steps: int) -> list[float]:
    """Mean step time of the steady decode phase, timed as one block (a sync
    per step would serialise the overlap of host work and device work)."""
    from rollout_engine import SamplingParams

    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    ids = [[rng.randrange(1000, vocab - 1000) for _ in range(context)] for _ in range(batch)]
    engine.core.set_manual(True)
    reqs = engine.core.add_requests(None, ids, SamplingParams(max_new_tokens=steps + 1, temperature=0,
                                                             ignore_eos=True))
    sched = engine.core.scheduler

    def run() -> list[float]:  # on the engine's loop thread, as its own steps run
        while not all(r.row is not None and not r.is_prefilling and r.num_output_tokens >= 2 for r in reqs):
            sched.step()  # admission and prefill
        sync()
        start, first = time.perf_counter(), sched.num_steps
        while not all(r.finished for r in reqs):
            sched.step()
        sync()
        taken = sched.num_steps - first
        return [(time.perf_counter() - start) / taken] if taken else []

    try:
        return engine.core.call(run)
    finally:
        engine.core.set_manual(False)


def bench_decode(args) -> dict[str, Any]:
    limits = measure_device()
    rows: dict[str, Any] = {}
    modes = (False,) if args.no_cuda_graph else (True,) if getattr(args, "graphs_only", False) else (True, False)
    for graphs in modes:
        engine = make_engine(args, cuda_graph=graphs, enable_prefix_cache=False)
        costs = engine_costs(engine)
        _decode_step_times(engine, 2, 64, 4)  # warm-up
        for batch in args.batch_sizes:
            steps_before = engine.cache_stats()["steps"]
            times = _decode_step_times(engine, batch, args.context, args.steps)
            if not times:
                rows[f"bs{batch}_graphs_{'on' if graphs else 'off'}"] = {
                    "error": "no pure decode step observed",
                    "steps": engine.cache_stats()["steps"] - steps_before}
                print(rows, file=sys.stderr, flush=True)
                continue
            med = times[0]
            # TP=k: each GPU reads 1/k of the weights and of the KV (heads split k ways)
            floor = decode_step_floor(costs, limits, batch, args.context + args.steps / 2) / getattr(args, "tp_size", 1)
            rows[f"bs{batch}_graphs_{'on' if graphs else 'off'}"] = {
                "batch": batch, "cuda_graph": graphs, "mean_step_ms": round(med * 1e3, 3),
                "floor_ms": round(floor * 1e3, 3), "x_floor": round(med / floor, 2),
                "tok_per_s": round(batch / med, 1)}
            print(f"decode bs={batch} graphs={graphs}: {med * 1e3:.3f} ms/step ({med / floor:.2f}x floor)",
                  file=sys.stderr, flush=True)
        free_device_memory(engine)
        del engine
    rows["bandwidth_TBps"] = round(limits.bandwidth / 1e12, 3)
    return rows


def bench_prefill(args) -> dict[str, Any]:
    from rollout_engine import SamplingParams

    limits = measure_device()
    engine = make_engine(args, enable_prefix_cache=False, max_prefill_tokens=args.num_prompts * args.prompt_max)
    costs = engine_costs(engine)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=1, temperature=0)
    results = []
    for seed in range(3):  # the first run compiles and warms up
        rng = random.Random(seed)
        ids = [[rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_max)] for _ in range(args.num_prompts)]
        sync()
        t = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params=params)
        sync()
        results.append(time.perf_counter() - t)
    seconds = min(results[1:])
    tokens = args.num_prompts * args.prompt_max
    ceiling = prefill_ceiling(costs, limits)
    free_device_memory(engine)
    del engine
    return {"tokens": tokens, "seconds": round(seconds, 4), "tok_per_s": round(tokens / seconds, 1),
            "ceiling_tok_per_s": round(ceiling, 1), "pct_of_ceiling": round(100 * tokens / seconds / ceiling, 1),
            "bf16_TFLOPs": round(limits.flops / 1e12, 1)}


def _workloads():
    from rollout_engine.bench.longtail import bench_longtail
    from rollout_engine.bench.memory import bench_memory
    from rollout_engine.bench.serve import bench_serve
    from rollout_engine.bench.soak import bench_soak
    from rollout_engine.bench.weights import bench_weights

    return {"grpo": bench_grpo, "offline": bench_offline, "decode": bench_decode, "prefill": bench_prefill,
            "weights": bench_weights, "memory": bench_memory, "serve": bench_serve,
            "longtail": bench_longtail, "soak": bench_soak}


# JSON {"module.NAME": repr(value)} of the switches benchmarks/ab_switch.py set
# for this run; the report carries them as "switches".
SWITCHES_ENV = "ROLLOUT_ENGINE_SWITCHES"


def _config(args) -> dict[str, Any]:
    """The flags as the run used them: graphs only where CUDA runs them, and
    not the derived no_cuda_graph."""
    config = {k: v for k, v in vars(args).items() if k not in ("func", "no_cuda_graph", "bench_defaults")}
    config["cuda_graph"] = bool(args.cuda_graph) and torch.cuda.is_available()
    return config


def main(args) -> int:
    report = {
        "workload": args.workload, "model": args.model, "load_format": args.load_format,
        "attention_backend": args.attention_backend, "device": _device_name(),
        "date": time.strftime("%Y-%m-%d"), "config": _config(args),
    }
    if os.environ.get(SWITCHES_ENV):  # the module switches an A/B side set (benchmarks/ab_switch.py)
        try:
            report["switches"] = json.loads(os.environ[SWITCHES_ENV])
        except ValueError:
            report["switches"] = os.environ[SWITCHES_ENV]
    report["results"] = _workloads()[args.workload](args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0
