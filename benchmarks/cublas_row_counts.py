"""Host time of a cuBLAS product the first time a row count is seen, and
after: why steps off the CUDA graphs run on padded row counts
(`rollout_engine.forward_batch.padded_tokens`). Qwen3-0.6B's shapes: the LM
head over 1 to 400 rows, and each layer product over 8,100 to 8,500 rows
(a mixed step's token count), first seen, seen again, and padded to a
multiple of --multiple (the engine pads to `forward_batch.PAD_TOKENS`, 64;
the kept log is of 128). Each call is timed on the host with the device
idle before it. The activations are row slices of one wide buffer (row
stride 3,072), not the engine's contiguous tensors. Prints a text report;
on a CUDA GPU:

    python3 benchmarks/cublas_row_counts.py
    CUDA_MODULE_LOADING=EAGER python3 benchmarks/cublas_row_counts.py   # kernels loaded at start
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script


def host_us(fn) -> float:
    """Host time of one call of `fn`, the device idle before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) * 1e6


def summary(times: list[float]) -> str:
    t = sorted(times)
    return (f"median {t[len(t) // 2]:7.1f} p90 {t[int(len(t) * .9)]:8.1f} max {t[-1]:8.1f} "
            f"sum {sum(t) / 1e3:7.2f} ms")


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("cublas_row_counts.py", __doc__)
    p.add_argument("--multiple", type=positive_int, default=128, help="pad the row counts to a multiple of this")
    args = p.parse_checked(argv, outs=())
    needs_cuda(p, "it times cuBLAS products")
    dev, bf = "cuda", torch.bfloat16
    print("CUDA_MODULE_LOADING", os.environ.get("CUDA_MODULE_LOADING"))
    head = torch.randn(151936, 1024, device=dev, dtype=bf)
    h = torch.randn(9000, 3072, device=dev, dtype=bf)
    mats = {"qkv": torch.randn(4096, 1024, device=dev, dtype=bf), "o": torch.randn(1024, 2048, device=dev, dtype=bf),
            "gu": torch.randn(6144, 1024, device=dev, dtype=bf), "down": torch.randn(1024, 3072, device=dev, dtype=bf)}
    for _ in range(3):
        host_us(lambda: h[:64, :1024] @ head.t())
    rows = list(range(1, 400, 3))
    print("lm head first ", summary([host_us(lambda: h[:m, :1024] @ head.t()) for m in rows]))
    print("lm head again ", summary([host_us(lambda: h[:m, :1024] @ head.t()) for m in rows]))
    for name, w in mats.items():
        k = w.shape[1]
        counts = range(8100, 8500, 3)
        first = [host_us(lambda: F.linear(h[:m, :k], w)) for m in counts]
        again = [host_us(lambda: F.linear(h[:m, :k], w)) for m in counts]
        padded = [host_us(lambda: F.linear(h[:-(-m // args.multiple) * args.multiple, :k], w)) for m in counts]
        print(f"{name:5s} first {summary(first)} | again {summary(again)} | padded{args.multiple} {summary(padded)}")
    x, w = h[:8233, :1024], mats["qkv"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        F.linear(x, w)
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(f"200 repeated linears: host {1e6 * (queued - start) / 200:.1f} us each, "
          f"device {1e6 * (done - start) / 200:.1f} us each")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
