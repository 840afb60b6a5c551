"""The matrix products of decode batches (2 to a few hundred rows) by launch
shape: each linear layer's `kernels.batch_gemm` at every configuration of a
grid (tile sizes, split of K, warps, stages, swapped operands) against
F.linear (cuBLAS, what the engine ran before), over weight copies that spill
the L2 cache as a model's layers do. Reports, per shape and row count, the
fastest configuration, its time against F.linear's and its largest
difference from F.linear's result, and the time of the configuration the
engine picks (`kernels.batch_gemm.pick`, up to 32 rows). On a CUDA GPU:

    python3 benchmarks/batch_gemm_configs.py --model qwen3-0.6b --rows 64 128 256 --out /tmp/gemm.json
    python3 benchmarks/batch_gemm_configs.py --model llama-3.1-8b --rows 2 8 32 --pick-only
    python3 benchmarks/batch_gemm_configs.py --model qwen3-0.6b --rows 256 --shapes o down --tma both
    python3 benchmarks/batch_gemm_configs.py --rows 128 256 --configs 64,32,64,2,4,4 64,64,128,1,4,3 --tma both
    python3 benchmarks/batch_gemm_configs.py --model llama-3.1-8b --rows 16 128 --shapes gate_up --gated

`--gated` times gate_up as the engine runs it with `GATED_IN_PRODUCT`: SiLU *
mul inside the kernel's launch (`gated_batch_gemm`, a launch shape sizing
the [rows, I] output's tiles; the engine's pick is the whole product's)
against F.linear followed by the SiLU * mul launch.

Beyond 32 rows it prints the table kernels.batch_gemm.WIDE takes (`WIDE=...`,
`WIDE_ROWS=...`, for benchmarks/ab_switch.py; with `--gated`, gate_up's in
`GATED_WIDE=...`): per weight shape, the launch shape of least total time
over the rows, where it beats F.linear (and the SiLU * mul launch) by 5% at
each.
"""
from __future__ import annotations

import argparse
import ast
import itertools
import json

import torch
import torch.nn.functional as F

from gemm_shapes import graph_time_us, shapes, write_out  # benchmarks/, the script's own folder
from rollout_engine.bench.roofline import measure_device
from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script
from rollout_engine.kernels.activation import silu_and_mul
from rollout_engine.kernels.batch_gemm import (MAX_ROWS, GemmConfig, batch_gemm, gated_batch_gemm, new_counters, pick,
                                               use_counters)
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS, PresetConfig

SPILL_BYTES = 256 << 20  # weight copies per shape: past the L2 cache


def grid(m: int, tma: str = "off", only: list[GemmConfig] | None = None) -> list[GemmConfig]:
    """The launch shapes timed at m rows (`only`: these instead of the
    grid's); `tma`: with the x and W tiles through the copy engine's tensor
    descriptors ("on"), through pointer loads ("off"), or each shape both
    ways ("both")."""
    out = list(only or [])
    if m > 32 and not only:
        for bm, bn, bk, split in itertools.product((64, 128), (32, 64, 128), (64, 128), (1, 2, 4, 8)):
            if bm > max(64, m):
                continue
            for warps in (4, 8) if bm * bn >= 128 * 64 else (4,):
                for stages in (3, 4) if bk == 64 else (3,):
                    out.append(GemmConfig(bm, bn, bk, split, warps, stages))
    if m <= 64 and not only:  # the weight's rows on the tensor cores' long side, x's rows on the short one
        bm = max(16, 1 << (m - 1).bit_length())
        for bn, bk, split, stages in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16), (3, 4)):
            if bk * bn <= 128 * 128:
                out.append(GemmConfig(bm, bn, bk, split, 4, stages, swap=True))
    ways = {"off": (False,), "on": (True,), "both": (False, True)}[tma]
    return [cfg._replace(tma=way) for cfg in out for way in ways]


def time_us(fn, copies: int) -> float:
    """Device time per product: `fn` runs `copies` products (one per weight
    copy), captured in a CUDA graph and replayed."""
    return graph_time_us(fn, reps=1) / copies


def run(model: str, rows: list[int], only: list[str] | None, pick_only: bool = False, tma: str = "off",
        configs: list[GemmConfig] | None = None, gated: bool = False, dev: str = "cuda") -> dict:
    mc = ModelConfig.from_hf(PresetConfig(**PRESETS[model]))
    limits = measure_device()
    out = {"model": model, "device": torch.cuda.get_device_name() if dev == "cuda" else dev, "rows": []}
    dt = torch.bfloat16
    for name, (n, k, has_bias) in shapes(mc).items():
        if name == "lm_head" or (only and name not in only):
            continue
        copies = max(1, SPILL_BYTES // (2 * n * k))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        b = torch.randn(n, device=dev, dtype=dt) if has_bias else None
        act = gated and name == "gate_up"  # the product with SiLU * mul after it, [m, n / 2] out
        if act:
            def cublas(x, w):
                return silu_and_mul(F.linear(x, w))
            ours = gated_batch_gemm
        else:
            def cublas(x, w):
                return F.linear(x, w, b)

            def ours(x, w, cfg):
                return batch_gemm(x, w, b, cfg)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = cublas(x, ws[0])
            row = {"shape": name, "m": m, "n": n, "k": k, "gated": act,
                   "linear_us": round(time_us(lambda: [cublas(x, w) for w in ws], copies), 2),
                   "floor_us": round(max(2 * m * n * k / limits.flops, 2 * n * k / limits.bandwidth) * 1e6, 2),
                   "configs": {}}
            engine = pick(m, n, k, True) if m <= 32 else None  # gated too: the whole product's shape
            shapes_m = grid(m, tma, configs)
            timed_here = [engine] if pick_only else shapes_m + ([engine] if engine and engine not in shapes_m else [])
            for cfg in timed_here:
                try:
                    got = ours(x, ws[0], cfg)
                    err = (got.float() - ref.float()).abs().max().item()
                    us = time_us(lambda: [ours(x, w, cfg) for w in ws], copies)
                except Exception as e:  # a shape Triton cannot build (shared memory): recorded, skipped
                    row["configs"][",".join(map(str, cfg))] = str(e).splitlines()[0][:120]
                    continue
                row["configs"][",".join(map(str, cfg))] = {"us": round(us, 2), "max_err": round(err, 4)}
            timed = {c: v for c, v in row["configs"].items() if isinstance(v, dict)}
            best = min(timed, key=lambda c: timed[c]["us"])
            row.update(best=best, best_us=timed[best]["us"], best_err=timed[best]["max_err"],
                       speedup=round(row["linear_us"] / timed[best]["us"], 3))
            if engine is not None:  # the shape kernels.batch_gemm.pick chooses
                key = ",".join(map(str, engine))
                row.update(engine=key, engine_us=timed[key]["us"],
                           engine_speedup=round(row["linear_us"] / timed[key]["us"], 3))
            out["rows"].append(row)
            top = sorted(timed, key=lambda c: timed[c]["us"])[:5]
            print(json.dumps({key: row[key] for key in ("shape", "m", "n", "k", "linear_us", "floor_us", "best",
                                                         "best_us", "best_err", "speedup", "engine_us") if key in row}),
                  "| next:", ", ".join(f"{c} {timed[c]['us']}" for c in top[1:]), flush=True)
    return out


def launch_shape(text: str) -> GemmConfig:
    """`--configs`' "64,32,128,2,4,3" or "16,32,128,4,4,4,1" -> GemmConfig."""
    try:
        fields = [int(v) for v in text.split(",")]
    except ValueError:
        fields = []
    if not 6 <= len(fields) <= 7 or min(fields[:6]) < 1 or (len(fields) == 7 and fields[6] not in (0, 1)):
        raise argparse.ArgumentTypeError(f"{text!r} is not BM,BN,BK,SPLIT,WARPS,STAGES[,SWAP] "
                                         "(positive integers, SWAP 0 or 1)")
    return GemmConfig(*fields[:6], swap=bool(fields[6]) if len(fields) == 7 else False)


def wide_table(rows: list[dict], margin: float = 0.05) -> dict:
    """kernels.batch_gemm.WIDE from a sweep's rows beyond MAX_ROWS: per
    weight shape (n, k), the launch shape of least total time over the
    swept row counts, listed where it beats F.linear by `margin` at every
    one of them."""
    table = {}
    for nk in sorted({(r["n"], r["k"]) for r in rows if r["m"] > MAX_ROWS}):
        mine = [r for r in rows if (r["n"], r["k"]) == nk and r["m"] > MAX_ROWS]
        timed = [{c: v["us"] for c, v in r["configs"].items() if isinstance(v, dict)} for r in mine]
        common = set.intersection(*(set(t) for t in timed))
        if not common:
            continue
        best = min(common, key=lambda c: sum(t[c] for t in timed))
        if all(t[best] * (1 + margin) <= r["linear_us"] for t, r in zip(timed, mine)):
            table[nk] = tuple(ast.literal_eval(v) for v in best.split(","))
    return table


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("batch_gemm_configs.py", __doc__)
    p.add_argument("--model", choices=sorted(PRESETS), default="qwen3-0.6b", help="preset whose shapes to time")
    p.add_argument("--rows", type=positive_int, nargs="+",
                   help="row counts (tokens); default 64 128 256, with --pick-only 2 8 32")
    p.add_argument("--shapes", nargs="+", choices=["qkv", "o", "gate_up", "down"], help="only these products")
    p.add_argument("--pick-only", action="store_true",
                   help="time only the shape the engine picks against F.linear (rows up to 32): a quick check "
                        "of the rule on another GPU")
    p.add_argument("--tma", choices=["off", "on", "both"], default="off",
                   help="the grid's x and W tiles through pointer loads (off), the copy engine's tensor "
                        "descriptors (on), or each shape both ways")
    p.add_argument("--configs", type=launch_shape, nargs="+", metavar="BM,BN,BK,SPLIT,WARPS,STAGES[,SWAP]",
                   help="time only these launch shapes (SWAP 0 or 1, default 0), not the grid")
    p.add_argument("--gated", action="store_true",
                   help="gate_up with SiLU * mul in the kernel's launch, against F.linear then the SiLU * mul "
                        "launch (the engine's path with kernels.batch_gemm.GATED_IN_PRODUCT)")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = [2, 8, 32] if args.pick_only else [64, 128, 256]
    if args.pick_only and max(args.rows) > 32:
        p.error(f"argument --rows: --pick-only times the small-batch kernel, which takes up to 32 rows "
                f"(got {max(args.rows)})")
    needs_cuda(p, "the products are timed on the GPU")
    with use_counters(new_counters(torch.device("cuda", torch.cuda.current_device()))):
        out = run(args.model, args.rows, args.shapes, args.pick_only, args.tma, args.configs, args.gated)
    for table, gated in (("WIDE", False), ("GATED_WIDE", True)):
        wide = wide_table([r for r in out["rows"] if r["gated"] == gated])
        out[table.lower()] = [[n, k, list(cfg)] for (n, k), cfg in wide.items()]
        if wide:  # ready for benchmarks/ab_switch.py rollout_engine.kernels.batch_gemm.WIDE=...
            print(f"{table}={wide!r}")
    if out["wide"] or out["gated_wide"]:
        print(f"WIDE_ROWS={(min(r for r in args.rows if r > MAX_ROWS), max(args.rows))!r}")
    write_out(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
