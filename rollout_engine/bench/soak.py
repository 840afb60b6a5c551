"""`soak` workload: the RL weight lifecycle, many times over on one engine.
Each cycle: release every tag -> the trainer allocates (and touches) what
was released, then frees it -> resume -> a full update from the trainer's
tensors -> a greedy generate. Recorded per cycle: device memory used after
the resume and after the generate (`torch.cuda.mem_get_info`: run with the
GPU to yourself), the cycle's seconds, and whether the outputs equal the
first cycle's. The checks: memory flat within 64 MB from cycle 10 on, every
output equal, no cycle slower than 2x the median."""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from rollout_engine.bench.common import free_device_memory, make_engine
from rollout_engine.sampling_params import SamplingParams

FLAT_BYTES = 64 << 20
WARM_CYCLES = 10


def _used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_soak(engine, cycles: int, prompts: list[list[int]], max_new_tokens: int = 16) -> dict[str, Any]:
    """The cycles on `engine` (built with the memory saver); returns the
    per-cycle figures and the three checks."""
    trainer = [(n, engine.get_weight(n)) for n in engine.weight_names()]  # the trainer's copy, on its device
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    first = [o.output_token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    after_resume, after_generate, seconds, equal = [], [], [], []
    for _ in range(cycles):
        start = time.perf_counter()
        freed = sum(engine.release_memory().values())
        scratch = torch.empty(max(1, int(freed * 0.9)), dtype=torch.uint8, device=engine.device)
        scratch.fill_(1)  # the trainer uses the memory
        del scratch
        torch.cuda.empty_cache()
        engine.resume_memory()
        after_resume.append(_used())
        engine.update_weights(trainer)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        equal.append([o.output_token_ids for o in outs] == first)
        after_generate.append(_used())
        seconds.append(time.perf_counter() - start)
    steady = after_resume[WARM_CYCLES:] or after_resume
    median = statistics.median(seconds)
    return {
        "cycles": cycles, "outputs_equal": all(equal), "unequal_cycles": [i for i, ok in enumerate(equal) if not ok],
        "resume_used_MiB": {"first": after_resume[0] >> 20, "min_steady": min(steady) >> 20,
                            "max_steady": max(steady) >> 20, "last": after_resume[-1] >> 20},
        "generate_used_MiB_max": max(after_generate) >> 20,
        "resume_spread_MiB": (max(steady) - min(steady)) / 2**20,
        "memory_flat": max(steady) - min(steady) <= FLAT_BYTES,
        "cycle_s": {"median": round(median, 4), "max": round(max(seconds), 4), "min": round(min(seconds), 4)},
        "slowest_over_median": round(max(seconds) / median, 3), "slowest_cycle": seconds.index(max(seconds)),
        "cycles_over_1.5x_median": sum(t > 1.5 * median for t in seconds),
        "no_slow_cycle": max(seconds) <= 2 * median,
    }


def bench_soak(args) -> dict[str, Any]:
    torch.zeros(1, device="cuda")
    free_device_memory()
    engine = make_engine(args, enable_memory_saver=True, weights_cpu_backup=False)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (32, 100, 7, 250)]
    report = run_soak(engine, args.cycles, prompts)
    free_device_memory(engine)
    return report
