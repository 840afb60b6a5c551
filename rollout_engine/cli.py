"""`rollout-engine` command line: download, generate, demo."""
from __future__ import annotations

import argparse
import sys
import time

from rollout_engine.model_zoo import DEFAULT_MODEL, ZOO

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to program.",
    "Explain what a prime number is in one sentence.",
]


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"folder, zoo name {sorted(ZOO)}, or preset (with --load-format dummy)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)


def _make_engine(args):
    from rollout_engine import RolloutEngine

    return RolloutEngine(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                         attention_backend=args.attention_backend, max_total_tokens=args.max_total_tokens,
                         seed=args.seed)


def _sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("-n", type=int, default=1, help="samples per prompt")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")


def cmd_download(args) -> int:
    from rollout_engine.model_zoo import ensure_model

    print(ensure_model(args.name))
    return 0


def cmd_generate(args) -> int:
    from rollout_engine import SamplingParams

    engine = _make_engine(args)
    prompts = args.prompts or DEMO_PROMPTS
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, n=args.n)
    if args.chat:
        ids = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        kwargs = {"input_ids": ids}
    else:
        kwargs = {"prompts": prompts}
    start = time.perf_counter()
    outs = engine.generate(sampling_params=params, progress=True, **kwargs)
    elapsed = time.perf_counter() - start
    for i, out in enumerate(outs):
        prompt = prompts[i // args.n]
        lps = out.output_logprobs or []
        mean_lp = sum(lps) / len(lps) if lps else float("nan")
        print(f"--- [{out.request_id}] {prompt!r}")
        print(f"{out.text!r}")
        print(f"    {len(out.output_token_ids)} tokens, finish={out.finish_reason}, mean logprob={mean_lp:.3f}, "
              f"first logprobs={[round(x, 3) for x in lps[:5]]}")
    total = sum(len(o.output_token_ids) for o in outs)
    print(f"{len(outs)} samples, {total} output tokens in {elapsed:.2f} s: {total / elapsed:.1f} tok/s")
    return 0


def cmd_demo(args) -> int:
    args.prompts, args.chat = [], True
    return cmd_generate(args)


def cmd_run(args) -> int:
    from rollout_engine.memory.launch import run

    argv = args.program[1:] if args.program[:1] == ["--"] else args.program
    return run(argv)


def cmd_bench(args) -> int:
    from rollout_engine.bench.run import main as bench_main

    return bench_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("download", help="fetch and convert a zoo model once")
    p.add_argument("name", choices=sorted(ZOO))
    p.set_defaults(func=cmd_download)
    p = sub.add_parser("generate", help="one-shot generation")
    _engine_args(p)
    _sampling_args(p, 64)
    p.add_argument("prompts", nargs="*")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("demo", help="a rollout on chat prompts: n samples each, texts, logprobs, tok/s")
    _engine_args(p)
    _sampling_args(p, 64)
    p.set_defaults(func=cmd_demo, n=4)
    p = sub.add_parser("run", help="start a program with the memory-saver preload hook: run -- python train.py")
    p.add_argument("program", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("bench", help="benchmark workloads (see BENCHMARKS.md)")
    p.add_argument("--workload", choices=["grpo", "offline", "decode", "prefill", "weights", "memory"], default="grpo")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=64, help="grpo: prompts; offline: requests; prefill: prompts")
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=256)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--baseline", choices=["none", "hf"], default="none", help="offline: also run HF generate")
    p.add_argument("--hf-requests", type=int, default=64, help="offline: requests given to the HF baseline")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128, 256], help="decode")
    p.add_argument("--context", type=int, default=1024, help="decode: context length")
    p.add_argument("--steps", type=int, default=128, help="decode: steps measured")
    p.add_argument("--nccl", action="store_true", help="weights: broadcast GPU 0 -> GPU 1 (two processes)")
    p.add_argument("--bucket-mb", type=int, default=512, help="weights --nccl: bucket size in MiB")
    p.add_argument("--cycles", type=int, default=5, help="memory: release/resume cycles timed")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
