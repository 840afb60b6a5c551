"""The matrix products of one decode step, alone: each linear layer's shape at
the row counts a running batch has, timed as the engine runs them (replayed
in a CUDA graph), by the ways torch can call cuBLAS. Reports each product's
share of the measured bf16 peak and of the weight-read floor, so a slow shape
(too few tiles for the GPU, a poor kernel choice) stands out. On a CUDA GPU:

    python3 benchmarks/gemm_shapes.py --model qwen2.5-7b --rows 128 256 512 --out /tmp/gemm.json

Variants: `linear` (what the engine runs: F.linear with the bias fused, the
gemv kernel at one row), `mm_bias`
(the product, then the bias added), `lt` (cuBLASLt preferred for every
product: torch.backends.cuda.preferred_blas_library("cublaslt")). For the LM
head also the fp32 logits the sampler reads: `bf16_then_float` (the product
in bf16, widened by a second kernel) against `fp32_out` (the engine's
`kernels.gemv.logits`: the product writes fp32).
"""
from __future__ import annotations

import json

import torch

from rollout_engine.bench.roofline import measure_device
from rollout_engine.kernels.gemv import linear, logits
from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS, PresetConfig


def shapes(mc: ModelConfig) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, has bias) of each product of a layer, and the LM head."""
    h, i = mc.hidden_size, mc.intermediate_size
    return {"qkv": (mc.q_size + 2 * mc.kv_size, h, mc.qkv_bias), "o": (h, mc.q_size, False),
            "gate_up": (2 * i, h, False), "down": (h, i, False), "lm_head": (mc.vocab_size, h, False)}


def graph_time_us(fn, reps: int = 50) -> float:
    """Device time per call of `fn`, `reps` calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (5 * reps)


def run(model: str, rows: list[int]) -> dict:
    mc = ModelConfig.from_hf(PresetConfig(**PRESETS[model]))
    limits = measure_device()
    out = {"model": model, "device": torch.cuda.get_device_name(), "bf16_TFLOPs": round(limits.flops / 1e12, 1),
           "bandwidth_TBps": round(limits.bandwidth / 1e12, 3), "rows": []}
    dev, dt = "cuda", torch.bfloat16
    for name, (n, k, has_bias) in shapes(mc).items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(n, device=dev, dtype=dt) if has_bias else None
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            variants = {"linear": lambda: linear(x, w, b),
                        "mm_bias": lambda: x @ w.t() + b if b is not None else x @ w.t()}
            if name == "lm_head":
                variants.update(bf16_then_float=lambda: linear(x, w).float(), fp32_out=lambda: logits(x, w))
            row = {"shape": name, "m": m, "n": n, "k": k}
            for label, fn in variants.items():
                row[f"{label}_us"] = round(graph_time_us(fn), 2)
            prior = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                row["lt_us"] = round(graph_time_us(variants["linear"]), 2)
            finally:
                torch.backends.cuda.preferred_blas_library(prior)
            best = min(row[f"{key}_us"] for key in ("linear", "mm_bias", "lt"))
            compute_us = 2 * m * n * k / limits.flops * 1e6
            read_us = 2 * n * k / limits.bandwidth * 1e6
            row["floor_us"] = round(max(compute_us, read_us), 2)
            row["linear_of_floor"] = round(row["floor_us"] / row["linear_us"], 3)
            row["best_of_floor"] = round(row["floor_us"] / best, 3)
            out["rows"].append(row)
            print(json.dumps(row))
    return out


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("gemm_shapes.py", __doc__)
    p.add_argument("--model", choices=sorted(PRESETS), default="qwen2.5-7b", help="preset whose shapes to time")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 32, 128, 256, 512], help="row counts (tokens)")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_args(argv)
    needs_cuda(p, "the products are timed on the GPU")
    write_out(args.out, run(args.model, args.rows))
    return 0


def write_out(path: str | None, result: dict) -> None:
    """The script's result as JSON at `path` (nothing when None)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
