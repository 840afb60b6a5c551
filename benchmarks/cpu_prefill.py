"""CPU prefill of one long prompt: the engine vs a Hugging Face forward, on
the built-in smollm2-135m (real weights; fetched on first use).

    python benchmarks/cpu_prefill.py [--tokens 4000] [--threads N] [--repeats 2] [--rounds 1] [--only ...]

Each configuration runs in its own subprocess (so every peak RSS is that
configuration's own), with the same `torch.set_num_threads` and fp32:

- engine, one chunk: `RolloutEngine(..., enable_prefix_cache=False,
  max_prefill_tokens=8192)` (8192 is also the default, so this is the default
  chunking for a 4,000-token prompt), `generate(max_new_tokens=1)`;
- engine, chunked: the same with `max_prefill_tokens=1024`, so later chunks
  attend to a cached prefix (kv_len > q_len);
- hf: `AutoModelForCausalLM` (default attention, sdpa) forward of the same
  ids under `torch.no_grad()`: logits for every position (what a plain
  forward does), and with `logits_to_keep=1` (what the engine computes).

Timings: a short warm-up, then the best of `--repeats` runs, and the best
of `--rounds` subprocesses per configuration (run round-robin). RSS: `rss_before`
is the resident set just before the timed runs (weights, KV pool), `peak_rss`
the high-water mark of the process (ru_maxrss). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from rollout_engine.script_args import ScriptParser, positive_int, run_script

MODEL = "smollm2-135m"


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(n)]  # clear of the special tokens at the ends


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def best_of(fn, repeats: int) -> dict:
    """Wall time (best of `repeats`) and the process's CPU time (user + sys)
    of that run: on a shared machine the CPU time is the steadier figure."""
    runs = []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), cpu_seconds()
        fn()
        runs.append((time.perf_counter() - t0, cpu_seconds() - c0))
    best = min(runs)
    return {"seconds": round(best[0], 3), "cpu_seconds": round(best[1], 2),
            "times": [round(t, 3) for t, _ in runs], "load_avg_1m": round(os.getloadavg()[0], 2)}


def run_engine(args) -> dict:
    import torch

    from rollout_engine import RolloutEngine, SamplingParams
    from rollout_engine.model_zoo import ensure_model

    torch.set_num_threads(args.threads)
    engine = RolloutEngine(ensure_model(MODEL, quiet=True), device="cpu", dtype="float32",
                           enable_prefix_cache=False, max_prefill_tokens=args.max_prefill_tokens)
    ids = prompt_ids(args.tokens, engine.model_config.vocab_size)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(input_ids=[ids[:64]], sampling_params=params)  # warm-up
    before = rss_mb()
    out: list = []
    timing = best_of(lambda: out.append(engine.generate(input_ids=[ids], sampling_params=params)[0]),
                     args.repeats)
    return {**timing, "first_token": out[-1].output_token_ids[0],
            "rss_before_mb": round(before), "peak_rss_mb": round(peak_rss_mb())}


def run_hf(args) -> dict:
    import torch
    import transformers

    from rollout_engine.model_zoo import ensure_model

    torch.set_num_threads(args.threads)
    net = transformers.AutoModelForCausalLM.from_pretrained(ensure_model(MODEL, quiet=True),
                                                           dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(args.tokens, net.config.vocab_size)])
    kw = {"logits_to_keep": 1} if args.logits_to_keep else {}
    out: list = []

    def forward(x):
        with torch.no_grad():
            out.append(int(net(x, **kw).logits[0, -1].argmax()))  # the logits are freed here

    forward(ids[:, :64])  # warm-up
    before = rss_mb()
    timing = best_of(lambda: forward(ids), args.repeats)
    return {**timing, "first_token": out[-1],
            "attn_implementation": net.config._attn_implementation,
            "rss_before_mb": round(before), "peak_rss_mb": round(peak_rss_mb())}


CONFIGS = {
    "engine_one_chunk": ["--role", "engine", "--max-prefill-tokens", "8192"],
    "engine_chunked_1024": ["--role", "engine", "--max-prefill-tokens", "1024"],
    "hf_forward": ["--role", "hf"],
    "hf_forward_last_logits": ["--role", "hf", "--logits-to-keep"],
}


def main() -> None:
    import torch

    ap = ScriptParser("cpu_prefill.py", __doc__)
    ap.add_argument("--tokens", type=positive_int, default=4000, help="prompt tokens prefilled")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads(), help="torch threads")
    ap.add_argument("--repeats", type=positive_int, default=2, help="timed runs per subprocess")
    ap.add_argument("--rounds", type=positive_int, default=1, help="subprocesses per configuration, run round-robin")
    ap.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="run only these configurations")
    ap.add_argument("--role", choices=("engine", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--max-prefill-tokens", type=positive_int, default=8192, help=argparse.SUPPRESS)
    ap.add_argument("--logits-to-keep", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:  # a child: one configuration, its result as JSON on the last line
        print(json.dumps(run_engine(args) if args.role == "engine" else run_hf(args)))
        return
    report = {"model": MODEL, "prompt_tokens": args.tokens, "threads": args.threads, "dtype": "float32",
              "torch": torch.__version__, "repeats": args.repeats, "rounds": args.rounds}
    common = ["--tokens", str(args.tokens), "--threads", str(args.threads), "--repeats", str(args.repeats)]
    names = args.only or list(CONFIGS)
    results: dict[str, list[dict]] = {name: [] for name in names}
    # Round-robin over the configurations, so that a burst of load from
    # elsewhere on a shared machine hits all of them rather than one.
    for _ in range(args.rounds):
        for name in names:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), *CONFIGS[name], *common],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"{name} failed ({proc.returncode})")
            results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{name}: {results[name][-1]}", file=sys.stderr)
    for name, runs in results.items():  # the best round, with every timed run listed
        best = min(runs, key=lambda r: r["seconds"])
        report[name] = {**best, "times": [t for r in runs for t in r["times"]],
                        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
    if "engine_one_chunk" in report and "hf_forward" in report:
        report["engine_over_hf"] = round(report["engine_one_chunk"]["seconds"] / report["hf_forward"]["seconds"], 3)
    print(json.dumps(report))


if __name__ == "__main__":
    raise SystemExit(run_script(main))
