"""What fp8 costs in fidelity: an engine with fp8 weights
(`--quantization fp8`, the default), an e4m3 KV cache (`--kv-cache-dtype
fp8_e4m3`) or both, against the same model with neither, on the same prompts.

- Greedy: each engine decodes the prompts greedily; the share of sequences
  that come out identical, and the mean position of the first difference.
- Logprobs: the unquantized engine samples (temperature 1, seeded), and the
  fp8 engine scores those very tokens (fidelity.score, teacher forced): the
  per-token gap |logp_fp8 - logp_ref| (mean, 99th percentile, max) and the
  k1 estimate of KL(ref || fp8) per sequence, which is what an RL trainer
  sees as the train-inference mismatch when it trains on fp8 rollouts.

    python3 benchmarks/fp8_fidelity.py --model smollm2-135m --device cpu --out fidelity.json
    python3 benchmarks/fp8_fidelity.py --model qwen2.5-7b --load-format dummy   # GPU, random 7B shapes
    python3 benchmarks/fp8_fidelity.py --quantization none --kv-cache-dtype fp8_e4m3   # the KV cache alone
"""
from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.bench import workloads
from rollout_engine.script_args import ScriptParser, positive_int, run_script
from rollout_engine.config import DTYPES, KV_CACHE_DTYPES
from rollout_engine.fidelity import score
from rollout_engine.model_zoo import resolve_model_path


def prompts(engine: RolloutEngine, count: int, length: int, seed: int) -> list[list[int]]:
    """Chat-free text prompts through the tokenizer when there is one, else
    random token ids."""
    rng = random.Random(seed)
    if engine.tokenizer is not None:
        words = ["the", "model", "rolls", "out", "samples", "for", "a", "policy", "that", "learns", "to", "add",
                 "numbers", "and", "write", "short", "answers", "in", "plain", "text"]
        texts = [" ".join(rng.choice(words) for _ in range(length)) for _ in range(count)]
        return [engine.tokenizer.encode(t)[:length] for t in texts]
    return [workloads._random_ids(rng, length, engine.model_config.vocab_size) for _ in range(count)]


def main(argv: list[str] | None = None) -> dict:
    p = ScriptParser("fp8_fidelity.py", __doc__)
    p.add_argument("--model", default="smollm2-135m", help="zoo name, Hugging Face folder, or a preset")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES), help="the dtype of both engines")
    p.add_argument("--prompts", type=positive_int, default=32)
    p.add_argument("--prompt-len", type=positive_int, default=24)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", default="fp8", choices=["fp8", "none"], help="the weights of the engine compared")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the KV cache of the engine compared")
    p.add_argument("--out", help="write the report here (JSON)")
    args = p.parse_args(argv)
    quantization = None if args.quantization == "none" else args.quantization
    if quantization is None and args.kv_cache_dtype == "auto":
        p.error("--quantization none with --kv-cache-dtype auto compares the model with itself")
    folder = resolve_model_path(args.model, args.load_format)
    kw = dict(load_format=args.load_format, device=args.device, dtype=args.dtype, max_total_tokens=16384,
              seed=args.seed)
    what = " + ".join(x for x in (quantization and f"{quantization} weights",
                                  args.kv_cache_dtype != "auto" and f"{args.kv_cache_dtype} KV") if x)
    step(f"1/4 loading {args.model} unquantized (the reference)")
    ref = RolloutEngine(folder, **kw)
    ids = prompts(ref, args.prompts, args.prompt_len, args.seed)
    greedy = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    sample = SamplingParams(max_new_tokens=args.output_len, temperature=1.0, seed=args.seed, ignore_eos=True,
                            logprobs=True, logprob_mode="raw")
    start = time.perf_counter()
    step("2/4 the reference's greedy and sampled rollouts")
    ref_greedy = [o.output_token_ids for o in ref.generate(input_ids=ids, sampling_params=greedy, progress=True)]
    sampled = ref.generate(input_ids=ids, sampling_params=sample, progress=True)
    device, dtype = str(ref.device), str(ref.dtype)
    ref.shutdown()
    step(f"3/4 loading {args.model} with {what}")
    fp8 = RolloutEngine(folder, quantization=quantization, kv_cache_dtype=args.kv_cache_dtype, **kw)
    step("4/4 its greedy rollouts, and its logprobs of the reference's samples")
    fp8_greedy = [o.output_token_ids for o in fp8.generate(input_ids=ids, sampling_params=greedy, progress=True)]
    scored = score(fp8, [(p_, o.output_token_ids) for p_, o in zip(ids, sampled)])
    fp8.shutdown()
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                  for x, y in zip(ref_greedy, fp8_greedy)]
    gaps = np.concatenate([np.abs(np.array(s) - np.array(o.output_logprobs)) for s, o in zip(scored, sampled)])
    k1 = [float(np.sum(np.array(o.output_logprobs) - np.array(s))) for s, o in zip(scored, sampled)]
    report = {
        "model": args.model, "load_format": args.load_format, "device": device, "dtype": dtype,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "prompts": len(ids), "prompt_len": args.prompt_len, "output_len": args.output_len,
        "greedy_identical_share": sum(a == b for a, b in zip(ref_greedy, fp8_greedy)) / len(ids),
        "greedy_first_difference_mean": float(np.mean(first_diff)),
        "logprob_gap_mean": float(gaps.mean()), "logprob_gap_p99": float(np.quantile(gaps, 0.99)),
        "logprob_gap_max": float(gaps.max()), "k1_kl_per_seq_mean": float(np.mean(k1)),
        "k1_kl_per_token": float(np.sum(k1) / gaps.size), "seconds": round(time.perf_counter() - start, 1),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


def step(text: str) -> None:
    """One line of progress on stderr (the report goes to stdout)."""
    print(f"fp8_fidelity.py: {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
