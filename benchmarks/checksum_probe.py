"""Where weights_checksum's time goes on the GPU, and which kernel shape
(words per block x blocks per program x warps) is fastest: for each shape,
one 2 GiB tensor (bandwidth) and the 291 tensors of Llama-3.1-8B's shapes
(one launch over a table: the table's host work, then the kernel alone),
next to a 2 GiB copy. On a machine with a CUDA GPU:

    python3 benchmarks/checksum_probe.py --out /tmp/checksum-probe.json

The report is printed; it is written to a file only when --out (or, as
before, a path as the only argument) is given.
"""
from __future__ import annotations

import argparse
import json

from rollout_engine.script_args import ScriptParser, UsageError, check_out_path, needs_cuda, run_script


def _shape(text: str) -> tuple[int, int, int]:
    try:
        block, iters, warps = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WORDSxITERSxWARPS, e.g. 1024x16x4") from None
    return block, iters, warps


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("checksum_probe.py", __doc__)
    p.add_argument("--out", help="write the report here (JSON)")
    p.add_argument("--shapes", nargs="+", type=_shape, default=[(1024, 16, 4), (2048, 8, 8), (512, 16, 4),
                   (2048, 8, 4), (4096, 4, 8)], help="kernel shapes WORDSxITERSxWARPS (the first is the default)")
    p.add_argument("path", nargs="?", help=argparse.SUPPRESS)  # the older form: the path alone
    args = p.parse_args(argv)
    out = args.out or args.path
    try:
        check_out_path("--out", out)
    except UsageError as e:
        p.error(str(e))
    needs_cuda(p, "the checksum kernels run on the GPU")
    import torch

    from lifecycle_costs import timed  # a sibling script
    from rollout_engine.kernels import checksum

    big = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    layer = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
             (4096, 14336), (4096,), (4096,)]
    shapes = [(128256, 4096)] + layer * 32 + [(4096,), (128256, 4096)]
    model = [checksum.whole(torch.randn(s, device="cuda", dtype=torch.bfloat16)) for s in shapes]
    nbytes = sum(b[0].numel() * 2 for b in model)
    report = {"device": torch.cuda.get_device_name(), "model_GiB": round(nbytes / 2**30, 3),
              "clone_2GiB_ms": round(1e3 * timed(lambda: big.clone()), 3), "shapes": {}}
    first = None
    for block, iters, warps in args.shapes:
        checksum.BLOCK_WORDS, checksum.ITERS, checksum.NUM_WARPS = block, iters, warps
        one, plan = checksum.SumPlan([checksum.whole(big)]), checksum.SumPlan(model)
        sums = plan.run()
        first = sums if first is None else first
        run = timed(plan.run)
        report["shapes"][f"{block}x{iters}x{warps}"] = {
            "one_2GiB_ms": round(1e3 * timed(one.run), 3), "model_run_ms": round(1e3 * run, 3),
            "model_plan_and_run_ms": round(1e3 * timed(lambda: checksum.SumPlan(model).run()), 3),
            "model_GB_per_s": round(nbytes / run / 1e9), "same_sums": bool(torch.equal(sums, first))}
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
