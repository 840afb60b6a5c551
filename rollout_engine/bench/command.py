"""`rollout-engine bench`: the workloads of rollout_engine/bench/ from the
command line. The flags each workload reads are said in their help; a flag
the chosen workload does not read is noted, not silently dropped."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from rollout_engine.cli_args import add_engine_args, build_config, check_engine_args, check_tp_args
from rollout_engine.script_args import UsageError, check_out_path, missing_extra, positive_int, unit_fraction

PROG = "rollout-engine"
BENCH_WORKLOADS = ["grpo", "offline", "decode", "prefill", "weights", "memory", "serve", "longtail", "soak"]
CPU_WORKLOADS = ("grpo", "weights", "serve", "longtail")  # the others measure the device with torch.cuda
# Engine fields that bench/run.py's engine factory passes on; other engine
# flags would be accepted and silently ignored, so bench does not offer them.
BENCH_ENGINE_FIELDS = ("model", "load_format", "attention_backend", "max_total_tokens", "seed", "cuda_graph",
                       "tp_size", "deterministic", "page_size", "max_running_requests", "max_prefill_tokens",
                       "cuda_graph_max_batch_size", "enable_return_routed_experts", "quantization", "kv_cache_dtype")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=BENCH_WORKLOADS, default="grpo",
                   help=f"what to measure; all but {', '.join(CPU_WORKLOADS)} need a CUDA GPU")
    add_engine_args(p, BENCH_ENGINE_FIELDS, defaults={"model": "qwen3-0.6b", "load_format": "dummy"})
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=positive_int, default=64,
                   help="grpo: prompts; offline, serve: requests; prefill: prompts")
    g.add_argument("-n", type=positive_int, default=None, help="grpo, longtail: samples per prompt (8, 16)")
    g.add_argument("--prompt-min", type=positive_int, default=256, help="grpo, serve: shortest prompt in tokens")
    g.add_argument("--prompt-max", type=positive_int, default=1024, help="grpo, serve: longest prompt; prefill: prompt length")
    g.add_argument("--output-len", type=positive_int, default=1024, help="grpo: tokens generated per sample; serve: longest output")
    g.add_argument("--baseline", choices=["none", "hf"], default="none", help="offline: also run HF generate")
    g.add_argument("--hf-requests", type=positive_int, default=64, help="offline: requests given to the HF baseline")
    g.add_argument("--hf-batch-size", type=positive_int, default=64, help="offline: HF baseline batch size")
    g.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32, 128, 256],
                   help="decode: batch sizes measured")
    g.add_argument("--context", type=positive_int, default=1024, help="decode: context length")
    g.add_argument("--steps", type=positive_int, default=128, help="decode: steps measured")
    g.add_argument("--graphs-only", action="store_true", help="decode: skip the rows without CUDA graphs")
    g.add_argument("--nccl", action="store_true", help="weights: broadcast GPU 0 -> GPU 1 (two processes)")
    g.add_argument("--bucket-mb", type=positive_int, default=512, help="weights --nccl: bucket size in MiB")
    g.add_argument("--cycles", type=positive_int, default=5, help="memory: release/resume cycles timed; soak: lifecycle cycles run")
    g.add_argument("--concurrency", type=positive_int, default=64, help="serve: requests in flight at a time")
    g.add_argument("--scale", type=unit_fraction, default=1.0,
                   help="longtail: in (0, 1]; round(64 * scale) prompts, lengths times sqrt(scale) "
                        "(0.25: 16 prompts, tails of 8k tokens)")
    g.add_argument("--replicas", type=positive_int, default=1,
                   help="grpo: run through a Ray RolloutPool of this many replicas, against one replica "
                        "(needs the ray extra)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.set_defaults(bench_defaults={d: p.get_default(d) for d in WORKLOAD_FLAGS})


def cmd_bench(args: argparse.Namespace) -> int:
    config = build_config(args)
    check_engine_args(config)
    check_tp_args(config)
    _check_bench_args(args)
    _note_unused_bench_flags(args, args.bench_defaults)
    if args.n is None:
        args.n = 16 if args.workload == "longtail" else 8
    args.no_cuda_graph = not args.cuda_graph  # the name bench/run.py reads
    _warn_if_long_on_cpu(args)
    from rollout_engine.bench.run import main as bench_main

    return bench_main(args)


CPU_QUICK_TOKENS = 20_000  # output tokens the CPU makes in a minute or so on the small presets


def _warn_if_long_on_cpu(args: argparse.Namespace) -> None:
    """The workloads are sized for a GPU: on the CPU say so before an hour goes by."""
    import torch

    if torch.cuda.is_available() or args.workload not in ("grpo", "longtail"):
        return
    if args.workload == "grpo":
        tokens = args.num_prompts * args.n * args.output_len * 2  # cache off, then on
        size = f"{args.num_prompts} prompts x {args.n} samples x {args.output_len} tokens, run twice"
    else:
        from rollout_engine.bench.workloads import LONGTAIL_MEAN_OUTPUT

        tokens = max(1, round(64 * args.scale)) * args.n * LONGTAIL_MEAN_OUTPUT * args.scale ** 0.5
        size = f"--scale {args.scale} and {args.n} samples per prompt"
    if tokens > CPU_QUICK_TOKENS:
        quick = ("--num-prompts 2 -n 2 --output-len 32 --prompt-min 32 --prompt-max 64" if args.workload == "grpo"
                 else "--scale 0.001 -n 2")  # as docs/benchmarks.md says
        print(f"{PROG} bench: note: on the CPU, {args.workload} with {size} generates ~{tokens:,.0f} tokens "
              f"and can take hours; for a quick look: {quick}", file=sys.stderr)


# The workloads each workload flag sizes; given to any other, a flag does nothing.
WORKLOAD_FLAGS = {
    "num_prompts": ("grpo", "offline", "serve", "prefill"), "n": ("grpo", "longtail"),
    "prompt_min": ("grpo", "serve"), "prompt_max": ("grpo", "serve", "prefill"), "output_len": ("grpo", "serve"),
    "baseline": ("offline",), "hf_requests": ("offline",), "hf_batch_size": ("offline",),
    "batch_sizes": ("decode",), "context": ("decode",), "steps": ("decode",), "graphs_only": ("decode",),
    "nccl": ("weights",), "bucket_mb": ("weights",), "cycles": ("memory", "soak"), "concurrency": ("serve",),
    "scale": ("longtail",), "replicas": ("grpo",),
}
# Engine flags that shape generation: the weights workload only copies weights (and prefill's engine takes
# all its prompts in one step).
GENERATING = ("grpo", "offline", "decode", "prefill", "memory", "serve", "longtail", "soak")
WORKLOAD_FLAGS.update({f: GENERATING for f in ("page_size", "max_running_requests", "cuda_graph_max_batch_size")})
WORKLOAD_FLAGS["max_prefill_tokens"] = tuple(w for w in GENERATING if w != "prefill")


def _note_unused_bench_flags(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """A flag the chosen workload does not read is said, not silently dropped."""
    for dest, used_by in WORKLOAD_FLAGS.items():
        if args.workload not in used_by and getattr(args, dest) != defaults[dest]:
            flag = "-n" if dest == "n" else "--" + dest.replace("_", "-")
            print(f"{PROG} bench: note: {flag} does nothing for --workload {args.workload} "
                  f"(it applies to --workload {', '.join(used_by)})", file=sys.stderr)
    if args.workload == "weights" and not args.nccl and args.bucket_mb != defaults["bucket_mb"]:
        print(f"{PROG} bench: note: --bucket-mb does nothing for --workload weights without --nccl "
              "(it sizes the broadcast's buckets)", file=sys.stderr)


def _check_extra(args: argparse.Namespace) -> None:
    """A workload (or flag) whose extra is missing, refused before the engine starts: one line, not a traceback
    after the model has loaded. --replicas does something only for grpo (elsewhere a note says so)."""
    from rollout_engine.server import NEEDS

    if args.workload == "serve":
        flag, what, missing = "--workload", "serve", missing_extra((*NEEDS, "httpx"), "server")
    elif args.workload == "grpo" and args.replicas > 1:
        flag, what, missing = "--replicas", "--replicas > 1", missing_extra(("ray",), "ray")
    else:
        return
    if missing:
        raise UsageError(f"argument {flag}: {what} needs {missing}")


def _check_bench_args(args: argparse.Namespace) -> None:
    import torch

    if args.workload not in CPU_WORKLOADS and not torch.cuda.is_available():
        raise UsageError(f"argument --workload: {args.workload} needs a CUDA GPU and torch sees none "
                         f"(on the CPU: {', '.join(CPU_WORKLOADS)})")
    if args.workload == "weights" and args.nccl and torch.cuda.device_count() < 2:
        raise UsageError("argument --nccl: broadcasting GPU 0 -> GPU 1 needs two CUDA GPUs")
    if args.prompt_min > args.prompt_max:
        raise UsageError(f"argument --prompt-min: {args.prompt_min} is above --prompt-max {args.prompt_max}")
    _check_extra(args)
    # The report is written after the run: a bad path should not cost the run.
    check_out_path("--out", args.out)
