"""The one-row products (batch-1 decode) by launch shape: each linear layer's
gemv at every (BLOCK_N, BLOCK_K, warps) of a grid, against cuBLAS
and against a plain streaming read of the same bytes (the read bandwidth a
kernel can reach on this GPU). Each shape runs over enough copies of its
weight to spill the L2 cache, as the engine's layers do (a 32 MB weight
timed alone would be read from L2). On a CUDA GPU:

    python3 benchmarks/gemv_configs.py --model llama-3.1-8b --out /tmp/gemv.json

Variants: `engine` (the launch shape `kernels.gemv` picks), the grid (BLOCK_N x
BLOCK_K x warps; and the engine's shape with one pipeline stage), and
`rowsum` (the same tiles, each K block summed into a [BLOCK_N] accumulator
right away: fewer registers per program).
"""
from __future__ import annotations

import functools
import itertools
import json

import torch
import torch.nn.functional as F

from gemm_shapes import graph_time_us, shapes, write_out  # benchmarks/, the script's own folder
from rollout_engine.bench.roofline import measure_device
from rollout_engine.script_args import ScriptParser, needs_cuda, run_script
from rollout_engine.kernels.gemv import _config, gemv
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS, PresetConfig

SPILL_BYTES = 768 << 20  # bytes of weight copies per shape: well past the L2 cache


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(src, out, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src + i, mask=i < n, other=0.0)
        tl.store(out + tl.program_id(0), tl.sum(v.to(tl.float32)))

    @triton.jit
    def rowsum_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < K
            w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)
            x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)

    return read_kernel, rowsum_kernel


def read_all(w: torch.Tensor, out: torch.Tensor, block: int) -> None:
    n = w.numel()
    _kernels()[0][(-(-n // block),)](w, out, n, BLOCK=block, num_warps=8)


def rowsum(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int]) -> torch.Tensor:
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    bn, bk, warps = cfg
    _kernels()[1][(-(-n // bn),)](x, w, y, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y


def time_over_copies(fn, copies: list[torch.Tensor], reps: int = 4) -> float:
    """Device us per call of fn(w), over every copy, `reps` passes captured in one CUDA graph."""

    def every_copy():
        for w in copies:
            fn(w)

    return graph_time_us(every_copy, reps) / len(copies)


GRID = [(bn, bk, warps) for bn, bk, warps in itertools.product((2, 4, 8, 16, 32), (256, 512, 1024), (4, 8))
        if bn * bk <= 16384]


def run(model: str, quick: bool, only: list[str] | None = None) -> dict:
    mc = ModelConfig.from_hf(PresetConfig(**PRESETS[model]))
    limits = measure_device()
    out = {"model": model, "device": torch.cuda.get_device_name(),
           "copy_bandwidth_TBps": round(limits.bandwidth / 1e12, 3), "rows": []}
    dt = torch.bfloat16
    for name, (n, k, _) in shapes(mc).items():
        if only and name not in only:
            continue
        count = max(2, -(-SPILL_BYTES // (2 * n * k)))
        copies = [torch.randn(n, k, device="cuda", dtype=dt) * 0.02 for _ in range(count)]
        x = torch.randn(1, k, device="cuda", dtype=dt)
        sink = torch.empty(-(-n * k // 2048), device="cuda", dtype=torch.float32)
        nbytes = 2 * n * k
        row = {"shape": name, "n": n, "k": k, "copies": count, "engine_config": list(_config(n, k))}
        timed = {"engine": lambda w: gemv(x, w), "cublas": lambda w: F.linear(x, w),
                 "read_2048": lambda w: read_all(w, sink, 2048), "read_8192": lambda w: read_all(w, sink, 8192)}
        for label, fn in timed.items():
            us = time_over_copies(fn, copies)
            row[label] = {"us": round(us, 2), "TBps": round(nbytes / us / 1e6, 3)}
        grid = {}
        for cfg in ([] if quick else GRID + [_config(n, k) + (1,)]):  # the last: the engine's, one stage
            us = time_over_copies(lambda w: gemv(x, w, config=cfg), copies)
            grid["x".join(map(str, cfg))] = round(nbytes / us / 1e6, 3)
        for cfg in ([] if quick else GRID):
            us = time_over_copies(lambda w: rowsum(x, w, cfg), copies)
            grid["rowsum_" + "x".join(map(str, cfg))] = round(nbytes / us / 1e6, 3)
        best = sorted(grid.items(), key=lambda kv: -kv[1])[:6]
        row["best_TBps"] = dict(best)
        row["grid_TBps"] = grid
        out["rows"].append(row)
        print(json.dumps({key: v for key, v in row.items() if key != "grid_TBps"}), flush=True)
        del copies
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("gemv_configs.py", __doc__)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-3.1-8b", help="preset whose shapes to time")
    p.add_argument("--quick", action="store_true", help="only the engine's shape, cuBLAS and the read")
    p.add_argument("--shapes", nargs="+", choices=["qkv", "o", "gate_up", "down", "lm_head"],
                   help="only these products (default: all)")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_args(argv)
    needs_cuda(p, "the products are timed on the GPU")
    write_out(args.out, run(args.model, args.quick, args.shapes))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
