"""The fp8 products of decode batches by launch shape: for each linear
layer of a preset and each row count, the bf16 product (F.linear, or the
engine's one-row gemv), fp8 through `torch._scaled_mm` (row-wise scales;
with use_fast_accum, the engine's default, and without), and the fp8 `kernels.batch_gemm` at the shape the engine picks and over a
grid; each over weight copies that spill the L2 cache, in CUDA graphs, plus
the per-token quantize launch the fp8 products need (timed alone). Reports
the fastest of each and its largest difference from the reference
arithmetic. On a CUDA GPU:

    python3 benchmarks/fp8_gemm_configs.py --model qwen2.5-7b --rows 1 8 64 256 --out /tmp/fp8_gemm.json
"""
from __future__ import annotations

import itertools
import json

import torch

from gemm_shapes import graph_time_us, shapes, write_out  # benchmarks/, the script's own folder
from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script
from rollout_engine.kernels.batch_gemm import (MAX_FP8_ROWS, GemmConfig, fp8_batch_gemm, new_counters, pick,
                                               use_counters)
from rollout_engine.kernels.fp8 import quantize_channels
from rollout_engine.kernels.fp8_quantize import quantize_rows_gpu
from rollout_engine.kernels.gemv import linear
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS, PresetConfig

SPILL_BYTES = 256 << 20  # bytes of fp8 weight copies per shape: past the L2 cache


def gemm_grid(m: int) -> list[GemmConfig]:
    if m > MAX_FP8_ROWS:  # x W^T tiles of 64 or 128 rows, split reductions for the narrow products
        return [GemmConfig(bm, bn, 128, split, warps, 3 if bn == 256 else 4)
                for bm, bn, split, warps in itertools.product((64, 128), (128, 256), (1, 2, 4), (4, 8))
                if bm <= m and not (bm == 128 and bn == 256 and warps == 4)]
    bm = max(16, min(64, 1 << (m - 1).bit_length()))
    return [GemmConfig(bm, bn, bk, split, warps, stages, swap=True)
            for bn, bk, split, warps, stages in itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (4,), (3, 4))
            if bn * bk <= 128 * 256]


def run(model: str, rows: list[int], only: list[str] | None, grid: bool = False) -> dict:
    mc = ModelConfig.from_hf(PresetConfig(**PRESETS[model]))
    out = {"model": model, "device": torch.cuda.get_device_name(), "rows": []}
    for name, (n, k, _) in shapes(mc).items():
        if name == "lm_head" or (only and name not in only):
            continue
        copies = max(2, SPILL_BYTES // (n * k))
        held = [quantize_channels(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
        half = [(q.float() * s).to(torch.bfloat16) for q, s in held[:max(2, copies // 2)]]
        for m in rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            qx, sx = quantize_rows_gpu(x)
            ref = (qx.float() @ held[0][0].float().t()) * sx * held[0][1].t()

            def timed(fn, ws):
                return round(graph_time_us(lambda: [fn(w) for w in ws], reps=1) / len(ws), 2)

            row = {"shape": name, "m": m, "n": n, "k": k,
                   "bf16_us": timed(lambda w: linear(x, w), half),
                   "quantize_us": round(graph_time_us(lambda: quantize_rows_gpu(x), reps=20), 2)}
            for key, fast in (("scaled_mm_us", False), ("scaled_mm_fast_us", True)):  # the engine: FAST_ACCUM (on)
                def scaled_mm(w, fast=fast):
                    return torch._scaled_mm(qx, w[0].t(), scale_a=sx, scale_b=w[1].view(1, -1),
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
                row[key] = timed(scaled_mm, held)
                row[key.replace("_us", "_err")] = (scaled_mm(held[0]).float() - ref).abs().max().item()
            results = {}
            if m <= MAX_FP8_ROWS or grid:
                for cfg in ([pick(m, n, k, True, fp8=True)] if m <= MAX_FP8_ROWS else []) + gemm_grid(m):
                    key = "gemm " + ",".join(map(str, cfg))
                    if key in results:
                        continue
                    try:
                        err = (fp8_batch_gemm(qx, sx, held[0][0], held[0][1], config=cfg).float() - ref).abs().max().item()
                        results[key] = (timed(lambda w: fp8_batch_gemm(qx, sx, w[0], w[1], config=cfg), held), err)
                    except Exception as e:  # noqa: BLE001
                        results[key] = (float("inf"), str(e).splitlines()[0][:80])
                if m <= MAX_FP8_ROWS:
                    row["gemm_pick"] = "gemm " + ",".join(map(str, pick(m, n, k, True, fp8=True)))
            ok = {key: v for key, v in results.items() if v[0] != float("inf")}
            top = sorted(ok, key=lambda c: ok[c][0])[:6]
            row["best"] = {c: ok[c] for c in top}
            row["engine"] = {c: ok[c] for c in ok if c == row.get("gemm_pick")}
            row["ref_max"] = ref.abs().max().item()
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
        del held, half
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("fp8_gemm_configs.py", __doc__)
    p.add_argument("--model", choices=sorted(PRESETS), default="qwen2.5-7b", help="preset whose shapes to time")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 64, 256], help="row counts (tokens)")
    p.add_argument("--shapes", nargs="+", choices=["qkv", "o", "gate_up", "down"], help="only these products")
    p.add_argument("--grid-above-64", action="store_true",
                   help=f"also time the Triton kernel's grid above {MAX_FP8_ROWS} rows (where the engine calls cuBLAS)")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_checked(argv)
    needs_cuda(p, "the products are timed on the GPU")
    with use_counters(new_counters(torch.device("cuda", torch.cuda.current_device()))):
        write_out(args.out, run(args.model, args.rows, args.shapes, args.grid_above_64))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
