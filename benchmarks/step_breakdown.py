"""Where a rollout's time goes: GPU busy vs idle, and GPU time by kind of
kernel (matmul, attention, sampling, all-reduce, norms and the rest), over
one run of the grpo, offline or decode workload (decode: a batch of short
prompts generating many tokens, so nearly every step is a decode step), from a torch.profiler trace of the
whole process (every thread's launches land on the device timeline). On a machine with a CUDA GPU (two
for --tp 2):

    python3 benchmarks/step_breakdown.py --workload grpo --model qwen2.5-7b \\
        --num-prompts 16 -n 8 --output-len 256 --out /tmp/breakdown.json [--deterministic] [--trace /tmp/trace.json]
    python3 benchmarks/step_breakdown.py --workload decode --batch-size 1 --tp 2 ...
    python3 benchmarks/step_breakdown.py --model qwen3-30b-a3b --enable-return-routed-experts ...  # MoE capture
    python3 benchmarks/step_breakdown.py --workload grpo --no-enable-prefix-cache ...  # every sample prefills its prompt

With --tp k the trace is rank 0's (its GPU's kernels); the other ranks run
the same steps.

Kernels launched with programmatic dependent launch (the fused one-row
products) start before the kernel they follow has ended and wait inside
until it has: their durations in the trace include that wait, so time by
kind counts some of the previous kernel's time twice, and busy time (the
union of kernel spans) is the figure to compare across runs.

Needs a CUDA GPU (two for --tp 2): the device timeline holds the kernels of every thread,
while the profiler would see only this thread's CPU operators (the engine
runs its steps on a thread of its own).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.bench import workloads
from rollout_engine.cli_args import add_engine_args, build_config, check_engine_args, check_tp_args, engine_kwargs
from rollout_engine.script_args import ScriptParser, UsageError, needs_cuda, positive_int, run_script

KINDS = [  # first match wins, on the lower-cased kernel or operator name
    ("all_reduce", ("nccl", "all_reduce", "allreduce", "one_shot")),
    ("attention", ("attention", "flashinfer", "prefill", "decode", "attend", "invariant_kernel", "extend_kernel")),
    ("sampling", ("argmax", "logsumexp", "softmax", "sort", "cumsum", "scan", "topk", "searchsorted", "partial_kernel",
                  "combine_kernel", "row_cumsum")),
    ("matmul", ("gemm", "gemv", "matmul", "sm90", "cutlass", "cublas", "tile_kernel", "split_kernel", "reduce_kernel",
                "addmm", "aten::mm", "linear")),
    ("norm", ("rmsnorm", "norm")),
    ("rope_activation", ("rope", "rotary", "silu", "act_and_mul")),
    ("copy_index", ("copy", "index", "gather", "scatter", "fill", "cat", "kv_indices", "page_indices")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


GAP_BUCKETS_US = (2, 5, 10, 100, 1000)  # idle gaps: < 2 us (between kernels of a graph), ..., longer


def idle_gaps(events) -> dict:
    """The device's idle gaps between kernels, by length: how many and how
    long in all, and which kernels start after the gaps of 10-100 us (a step
    launched late) and of 100 us or more (the step kind that waited on the
    host), and in which tenth of the run the long ones fall (the prompts'
    steps at its start, the shrinking batches at its end)."""
    buckets = [[0, 0.0] for _ in range(len(GAP_BUCKETS_US) + 1)]
    after: dict[str, dict[str, list]] = {"10-100us": {}, ">=100us": {}}
    tenths = [[0, 0.0] for _ in range(10)]  # gaps of 100 us or more by where in the run they start
    ordered = sorted(events, key=lambda e: e[1])
    first = ordered[0][1] if ordered else 0.0
    span = max((s + d for _, s, d in ordered), default=first) - first or 1.0
    end = None
    for name, s, d in ordered:
        if end is not None and s > end:
            gap = s - end
            i = sum(gap >= b for b in GAP_BUCKETS_US)
            buckets[i][0] += 1
            buckets[i][1] += gap
            if gap >= 10:
                entry = after["10-100us" if gap < 100 else ">=100us"].setdefault(name[:80], [0, 0.0])
                entry[0] += 1
                entry[1] += gap
            if gap >= 100:
                tenth = tenths[min(9, int(10 * (end - first) / span))]
                tenth[0] += 1
                tenth[1] += gap
        end = s + d if end is None else max(end, s + d)
    labels = [f"<{GAP_BUCKETS_US[0]}us"] + [f"{a}-{b}us" for a, b in zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:])] + [
        f">={GAP_BUCKETS_US[-1]}us"]

    def top(table: dict[str, list]) -> dict:
        return {n: {"count": c, "ms": round(t / 1e3, 1)} for n, (c, t) in sorted(table.items(), key=lambda kv: -kv[1][1])[:8]}

    return {"by_length": {lab: {"count": c, "ms": round(t / 1e3, 1)} for lab, (c, t) in zip(labels, buckets)},
            "gaps_10_100us_before": top(after["10-100us"]), "long_gaps_before": top(after[">=100us"]),
            "long_gaps_by_tenth_of_run": [{"count": c, "ms": round(t / 1e3, 1)} for c, t in tenths]}


def breakdown(events, wall_us: float, steps: int) -> dict:
    """events: (name, start_us, duration_us) of the device's kernels."""
    by_kind: dict[str, float] = {}
    for name, _, dur in events:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + dur
    busy = busy_time([(s, s + d) for _, s, d in events])
    total = sum(by_kind.values()) or 1.0
    by_name: dict[str, float] = {}
    for name, _, dur in events:
        by_name[name] = by_name.get(name, 0.0) + dur
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    return {
        "wall_ms": round(wall_us / 1e3, 1), "steps": steps,
        "busy_ms": round(busy / 1e3, 1), "busy_share": round(busy / wall_us, 4),
        "idle_ms_per_step": round((wall_us - busy) / 1e3 / max(steps, 1), 4),
        "busy_ms_per_step": round(busy / 1e3 / max(steps, 1), 4),
        "share_by_kind": {k: round(v / total, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "ms_by_kind": {k: round(v / 1e3, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "us_per_step_by_kernel": {n[:120]: round(v / max(steps, 1), 1) for n, v in top},
        "idle_gaps": idle_gaps(events),
    }


def device_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of every kernel, copy and fill on the
    device, read from the profiler's raw results (its `events()` builds a
    Python object per event with their nesting: minutes for a whole run)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name(), e.start_ns() / 1e3, e.duration_ns() / 1e3)
            for e in prof.profiler.kineto_results.events() if e.device_type() == cuda]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, each bad value named by its flag (before the GPU check,
    so that a typo is told on any machine, and before a model is loaded)."""
    p = ScriptParser("step_breakdown.py", __doc__)
    p.add_argument("--workload", choices=["grpo", "offline", "decode"], default="grpo",
                   help="grpo: prompts x samples; offline: independent requests; decode: one batch of short prompts")
    add_engine_args(p, ("model", "load_format", "tp_size", "deterministic", "page_size", "max_running_requests",
                        "enable_return_routed_experts", "quantization", "kv_cache_dtype", "enable_prefix_cache"),
                    defaults={"model": "qwen3-0.6b", "load_format": "dummy"})
    p.add_argument("--num-prompts", type=positive_int, default=16, help="grpo, offline: prompts")
    p.add_argument("-n", type=positive_int, default=8, help="grpo: samples per prompt")
    p.add_argument("--output-len", type=positive_int, default=256, help="tokens generated per sample (offline: the most)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="decode: requests in the batch")
    p.add_argument("--out", help="write the breakdown here (JSON)")
    p.add_argument("--trace", help="also write the Chrome trace here")
    args = p.parse_checked(argv, outs=("out", "trace"))
    try:
        config = build_config(args)
        check_engine_args(config)
        check_tp_args(config)
    except UsageError as e:
        p.error(str(e))
    needs_cuda(p, "the profiler reads the device timeline", args.tp_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine = RolloutEngine(**engine_kwargs(args))
    vocab = engine.model_config.vocab_size
    if args.workload == "grpo":
        wl = workloads.grpo(vocab, args.num_prompts, args.n, 256, 1024, args.output_len)
    elif args.workload == "offline":
        wl = workloads.offline(vocab, args.num_prompts, out_max=args.output_len)
    else:
        wl = workloads.grpo(vocab, args.batch_size, 1, 16, 16, args.output_len)
        wl = workloads.Workload("decode", wl.input_ids, [SamplingParams(max_new_tokens=args.output_len, temperature=0,
                                                                        ignore_eos=True)] * args.batch_size)
    if args.enable_return_routed_experts:  # every request asks for its routing: the copy-out is in the trace
        wl = dataclasses.replace(wl, params=[dataclasses.replace(p, return_routed_experts=True) for p in wl.params])
    warm = workloads.grpo(vocab, 2, 2, 16, 32, 8, seed=99)
    engine.generate(input_ids=warm.input_ids, sampling_params=warm.params)
    # The device's activity alone unless a trace is asked for: the host's operators
    # of a whole run are millions of events that the profiler would record and sort.
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if args.trace else [])
    steps_before = engine.cache_stats()["steps"]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.generate(input_ids=wl.input_ids, sampling_params=wl.params)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    steps = engine.cache_stats()["steps"] - steps_before
    engine.shutdown()
    events = device_events(prof)
    res = {"workload": args.workload, "model": args.model, "deterministic": args.deterministic, "tp": args.tp_size,
           "routing_capture": args.enable_return_routed_experts,
           "device": torch.cuda.get_device_name(), **breakdown(events, wall_us, steps)}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
