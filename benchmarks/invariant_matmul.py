"""The batch-invariant matmul against F.linear (cuBLAS) on one GPU, for a
few launch constants, over the products of a model (`--model`, a preset)
and the row counts of decode and prefill. Every product is timed as the
engine runs it: replayed in a CUDA graph, over copies of the weight that
together pass the L2 cache. Also checks, for each candidate, that the
split and tiled launches give the same bits. On a machine with a CUDA GPU:

    python3 benchmarks/invariant_matmul.py --out /tmp/mm.json
    python3 benchmarks/invariant_matmul.py --small --launches --rows 1 8 32 64 128 256

`--small`: the candidates for decode batches (up to DECODE_MAX_ROWS rows)
instead of the prompt-sized ones. `--launches`: time each candidate with
both launch shapes (split over the reduction's chunks, and one program per
tile) as well as the automatic choice. `--engine`: the engine's own choice
(`pick_tiles`) too. Every candidate is also checked against DECODE_TILES
bit for bit (configurations that share BLOCK_K must agree). `--fixed-rows`:
instead of the candidates, the engine's two paths side by side: cuBLAS
called at `layers.fixed_rows.ROWS` rows (with its check per shape) and the
Triton kernels' own choice (`engine`).

    python3 benchmarks/invariant_matmul.py --fixed-rows --rows 1 32 128 256 512 2048
"""
from __future__ import annotations

import dataclasses
import json

import torch
import torch.nn.functional as F

from gemm_shapes import graph_time_us, shapes  # benchmarks/, the script's own folder
from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script
from rollout_engine.kernels.invariant_matmul import DECODE_TILES, Tiles, invariant_matmul
from rollout_engine.layers import fixed_rows
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS, PresetConfig

ROWS = [1, 32, 128, 256, 1024, 4096, 8192]
SPILL_BYTES = 256 << 20  # weight copies per shape: past the L2 cache
CANDIDATES = [Tiles(64, 128, 64, 4, 3), Tiles(128, 128, 128, 8, 3), Tiles(64, 128, 64, 4, 3, tma=True),
              Tiles(128, 128, 64, 8, 3, tma=True), Tiles(128, 256, 64, 8, 3, tma=True),
              Tiles(128, 128, 128, 8, 3, tma=True), Tiles(128, 128, 64, 4, 4, tma=True)]
SMALL = [DECODE_TILES, Tiles(16, 128, 64, 4, 3), Tiles(16, 64, 64, 4, 4), Tiles(16, 256, 64, 8, 3),
         Tiles(32, 128, 64, 4, 3), Tiles(16, 128, 64, 4, 5), Tiles(32, 64, 64, 4, 4),
         Tiles(64, 64, 64, 4, 4), Tiles(128, 64, 64, 4, 4), Tiles(128, 128, 64, 8, 4), Tiles(64, 256, 64, 8, 3),
         Tiles(128, 128, 64, 8, 4, tma=True), Tiles(64, 128, 64, 4, 4, tma=True)]


def label_of(t: Tiles) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k}w{t.warps}s{t.stages}" + ("tma" if t.tma else "") + (
        "flat" if t.flat else "")


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("invariant_matmul.py", __doc__)
    p.add_argument("--model", default="qwen2.5-7b", choices=sorted(PRESETS), help="the products of this preset")
    p.add_argument("--out", help="write the rows here (JSON)")
    p.add_argument("--rows", type=positive_int, nargs="+", default=ROWS, help="rows of the activation")
    p.add_argument("--small", action="store_true", help="small-row tiles (decode at small batches)")
    p.add_argument("--launches", action="store_true", help="also time the split and the tiled launch apart")
    p.add_argument("--engine", action="store_true", help="also time the engine's own choice of tiles")
    p.add_argument("--flat", action="store_true",
                   help="also each candidate's tiled launch with its chunks in one loop (Tiles.flat)")
    p.add_argument("--fixed-rows", action="store_true",
                   help="time cuBLAS at a fixed row count (layers.fixed_rows) and the engine's Triton choice only")
    args = p.parse_checked(argv)
    needs_cuda(p, "the kernels are Triton's")
    candidates = [] if args.fixed_rows else SMALL if args.small else CANDIDATES
    args.engine = args.engine or args.fixed_rows
    if args.flat:
        candidates = [dataclasses.replace(t, flat=f) for t in candidates for f in (False, True)]
    launches = ((None, ""), (True, "/split"), (False, "/tiled"))[:3 if args.launches else 1]
    ref_w = torch.randn(3584, 3584, device="cuda", dtype=torch.bfloat16)
    ref_x = torch.randn(300, 3584, device="cuda", dtype=torch.bfloat16)
    reference = invariant_matmul(ref_x, ref_w, tiles=DECODE_TILES, split=False)
    torch.manual_seed(0)
    mc = ModelConfig.from_hf(PresetConfig(**PRESETS[args.model]))
    rows = []
    checks = {}
    for name, (n, k, _) in shapes(mc).items():
        copies = max(1, SPILL_BYTES // (2 * n * k))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(max(args.rows), k, device="cuda", dtype=torch.bfloat16)
        if args.fixed_rows:
            checks[name] = fixed_rows.verify(ws[0], None)
            print(f"{name}: cuBLAS at {fixed_rows.ROWS} rows invariant: {checks[name]}", flush=True)
        for m in args.rows:
            base = graph_time_us(lambda: [F.linear(x[:m], w) for w in ws], reps=1) / copies
            row = {"shape": name, "m": m, "n": n, "k": k, "cublas_us": round(base, 2)}
            if args.fixed_rows:
                us = graph_time_us(lambda: [fixed_rows.linear(x[:m], w) for w in ws], reps=1)
                row["fixed_rows"] = round(us / copies / base, 3)
            variants = [(label_of(t) + suffix, t, split) for t in candidates for split, suffix in launches
                        if not (t.flat and split)]
            if args.engine:
                variants.append(("engine", None, None))
            for label, t, split in variants:
                try:
                    us = graph_time_us(lambda: [invariant_matmul(x[:m], w, tiles=t, split=split) for w in ws], reps=1)
                    row[label] = round(us / copies / base, 3)
                except Exception as e:  # noqa: BLE001 - a config the GPU cannot run
                    row[label] = f"error: {type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    same = {}
    for t in candidates:
        label = label_of(t)
        try:
            same[label] = all(torch.equal(invariant_matmul(ref_x[:m], ref_w, tiles=t, split=s), reference[:m])
                              for m in (1, 77, 300) for s in (True, False))
        except Exception as e:  # noqa: BLE001
            same[label] = f"error: {type(e).__name__}: {str(e)[:300]}"
    print("split and tiled == DECODE_TILES bitwise:", same)
    # Summary: time relative to cuBLAS, summed over the shapes, at each row count.
    for m in args.rows:
        at_m = [r for r in rows if r["m"] == m]
        base = sum(r["cublas_us"] for r in at_m)
        print(f"m={m}:", {lab: round(sum(r[lab] * r["cublas_us"] for r in at_m) / base, 3)
                          for lab in at_m[0] if "x" in lab or lab in ("engine", "fixed_rows")
                          if all(isinstance(r[lab], float) for r in at_m)})
    errors = {lab: r[lab] for r in rows for lab in r if isinstance(r[lab], str) and lab != "shape"}
    if errors:
        print("errors:", errors)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows,
                       "split_equals_tiled": same, "fixed_rows": fixed_rows.ROWS, "fixed_rows_invariant": checks},
                      f, indent=1)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
