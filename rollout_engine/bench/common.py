"""Helpers every benchmark uses: building the engine from the CLI arguments,
device-synchronised timing, and handing device memory back between engines."""
from __future__ import annotations

import gc
import sys
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Mean device time of `fn()` in ms, between CUDA events around `reps` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


# Engine fields a benchmark passes on when its flags set them.
OPTIONAL_FIELDS = ("tp_size", "deterministic", "page_size", "max_running_requests", "max_prefill_tokens",
                   "cuda_graph_max_batch_size", "enable_return_routed_experts", "quantization", "kv_cache_dtype")


def engine_kwargs(args) -> dict:
    """RolloutEngine keyword arguments (all but the model) from the bench flags."""
    kw = dict(load_format=args.load_format, attention_backend=args.attention_backend,
              max_total_tokens=args.max_total_tokens, seed=args.seed, cuda_graph=args.cuda_graph)
    kw.update({f: getattr(args, f) for f in OPTIONAL_FIELDS if hasattr(args, f)})
    return kw


def make_engine(args, **overrides):
    from rollout_engine import RolloutEngine

    return RolloutEngine(args.model, **{**engine_kwargs(args), **overrides})


def timed(fn) -> float:
    """Seconds `fn()` takes, the device synchronised on both sides."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def free_device_memory(engine=None) -> None:
    """Shut `engine` down (if given), collect what is left of it and return
    its memory to the device, so the next engine sizes its KV cache from the
    whole GPU."""
    if engine is not None:
        engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def show_progress() -> bool:
    """A progress bar on a terminal; none in logs, whose lines would add nothing to the report."""
    return sys.stderr.isatty()
