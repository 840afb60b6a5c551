"""The batch-invariant matmul against F.linear (cuBLAS) on one GPU, for a
few launch constants, over the shapes of a 7B model and the row counts of
decode and prefill. Also checks, for each, that the split and tiled launches
give the same bits. On a machine with a CUDA GPU:

    python3 benchmarks/invariant_matmul.py --out /tmp/mm.json
    python3 benchmarks/invariant_matmul.py --small --rows 1 8 32 64

`--small`: tiles of 16-32 rows for small decode batches instead of the
default candidates. Every candidate is also checked against DECODE_TILES
bit for bit (configurations that share BLOCK_K must agree).
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from rollout_engine.bench.common import cuda_time_ms
from rollout_engine.cli_args import ScriptParser, needs_cuda, positive_int
from rollout_engine.kernels.invariant_matmul import DECODE_TILES, Tiles, invariant_matmul

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}  # qwen2.5-7b
ROWS = [1, 32, 128, 256, 1024, 4096, 8192]
CANDIDATES = [Tiles(64, 128, 64, 4, 3), Tiles(128, 128, 128, 8, 3), Tiles(64, 128, 64, 4, 3, tma=True),
              Tiles(128, 128, 64, 8, 3, tma=True), Tiles(128, 256, 64, 8, 3, tma=True),
              Tiles(128, 128, 128, 8, 3, tma=True), Tiles(128, 128, 64, 4, 4, tma=True)]
SMALL = [DECODE_TILES, Tiles(16, 128, 64, 4, 3), Tiles(16, 64, 64, 4, 4), Tiles(16, 256, 64, 8, 3),
         Tiles(32, 128, 64, 4, 3), Tiles(16, 128, 64, 4, 5), Tiles(32, 64, 64, 4, 4)]


def label_of(t: Tiles) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k}w{t.warps}s{t.stages}" + ("tma" if t.tma else "")


def time_ms(fn) -> float:
    return cuda_time_ms(fn, reps=20)


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("invariant_matmul.py", __doc__)
    p.add_argument("--out", help="write the rows here (JSON)")
    p.add_argument("--rows", type=positive_int, nargs="+", default=ROWS, help="rows of the activation")
    p.add_argument("--small", action="store_true", help="small-row tiles (decode at small batches)")
    args = p.parse_checked(argv)
    needs_cuda(p, "the kernels are Triton's")
    candidates = SMALL if args.small else CANDIDATES
    ref_w = torch.randn(3584, 3584, device="cuda", dtype=torch.bfloat16)
    ref_x = torch.randn(300, 3584, device="cuda", dtype=torch.bfloat16)
    reference = invariant_matmul(ref_x, ref_w, tiles=DECODE_TILES, split=False)
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        x = torch.randn(max(args.rows), k, device="cuda", dtype=torch.bfloat16)
        for m in args.rows:
            base = time_ms(lambda: F.linear(x[:m], w))
            row = {"shape": name, "m": m, "cublas_ms": round(base, 4)}
            for t in candidates:
                label = label_of(t)
                try:
                    row[label] = round(time_ms(lambda: invariant_matmul(x[:m], w, tiles=t)) / base, 3)
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
    # Summary: time relative to cuBLAS, summed over the shapes, at decode (256 rows) and prefill (8192 rows).
    for m in sorted({args.rows[0], *(r for r in (256, 8192) if r in args.rows)}):
        base = sum(r["cublas_ms"] for r in rows if r["m"] == m)
        print(f"m={m}:", {lab: round(sum(r[lab] * r["cublas_ms"] for r in rows if r["m"] == m) / base, 3)
                          for lab in rows[0] if "x" in lab and all(isinstance(r[lab], float) for r in rows)})
    errors = {label_of(t): r[label_of(t)] for r in rows for t in candidates if isinstance(r[label_of(t)], str)}
    if errors:
        print("errors:", errors)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "split_equals_tiled": same}, f, indent=1)


if __name__ == "__main__":
    main()
