"""What the host pays for the CUDA calls a step makes outside its graph, and
which of them wait for the device: each call is timed on the host three
times right after a ~5 ms sleep kernel was queued (a call that waits for the
device takes ~5 ms; the first time also loads and plans its kernel or size),
then once with the device idle.

    python3 benchmarks/host_calls.py --out /tmp/calls.json

Needs a CUDA GPU.
"""
from __future__ import annotations

import json
import time

import numpy as np

from rollout_engine.script_args import ScriptParser, needs_cuda, run_script

SLEEP_S = 5e-3


def calls(torch, dev) -> dict:
    """name -> a callable making the call, with the inputs of a step's sizes (qwen3-0.6b's LM head)."""
    import torch.nn.functional as F

    x0 = torch.randn(300, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(151936, 1024, device=dev, dtype=torch.bfloat16)
    pinned = torch.empty(4096, dtype=torch.float64, pin_memory=True)
    out = {}
    for b in (7, 64, 200, 201):
        x = x0[:b].contiguous()
        out[f"mm_fp32_out_rows{b}"] = lambda x=x: torch.mm(x, w.t(), out_dtype=torch.float32)
        out[f"linear_bf16_rows{b}"] = lambda x=x: F.linear(x, w)
    out["pageable_copy_8KB"] = lambda: torch.from_numpy(np.arange(1024, dtype=np.int64)).to(dev, non_blocking=True)
    out["pageable_copy_100KB"] = lambda: torch.from_numpy(np.arange(12800, dtype=np.int64)).to(dev, non_blocking=True)
    out["pageable_copy_1MB"] = lambda: torch.from_numpy(np.arange(131072, dtype=np.int64)).to(dev, non_blocking=True)
    out["pinned_copy_8KB"] = lambda: pinned[:1024].to(dev, non_blocking=True)
    out["pinned_alloc_and_copy_back"] = lambda: torch.empty(512, dtype=torch.float64, pin_memory=True).copy_(
        torch.zeros(512, dtype=torch.float64, device=dev), non_blocking=True)
    out["empty_new_size"] = lambda: torch.empty(123457 * 64, device=dev)
    out["index_with_host_rows"] = lambda: x0[torch.as_tensor(np.arange(5)).to(dev, non_blocking=True)]
    out["cat_of_conversions"] = lambda: torch.cat([x0[:5, 0].double(), x0[:5, 1].double()])
    out["event_record"] = lambda: torch.cuda.Event().record()
    return out


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("host_calls.py", __doc__)
    p.add_argument("--out", help="write the timings here (JSON)")
    args = p.parse_checked(argv)
    needs_cuda(p, "it times CUDA calls")
    import torch

    dev = torch.device("cuda")
    cycles = int(SLEEP_S * torch.cuda.get_device_properties(0).clock_rate * 1e3)

    def host_us(fn, busy: bool) -> float:
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(cycles)
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return round(elapsed * 1e6, 1)

    res = {}
    for name, fn in calls(torch, dev).items():
        res[name] = {"first_busy": host_us(fn, True), "busy": host_us(fn, True), "busy_again": host_us(fn, True),
                     "idle": host_us(fn, False)}
        print(name, res[name], flush=True)
    report = {"device": torch.cuda.get_device_name(), "sleep_us": SLEEP_S * 1e6, "us": res}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
