"""One side of an A/B of programmatic dependent launch in the MoE kernels
alone (kernels/moe.py, moe_align.py, moe_route.py, moe_row.py); every other
kernel keeps its own. `off` launches the MoE kernels without it, then runs
`rollout-engine <args>` or `benchmarks/moe_kernel.py <args>` in this process.
Alternate the sides in one device call:

    python3 benchmarks/moe_pdl_ab.py off rollout-engine bench --workload decode --model qwen3-30b-a3b \\
        --batch-sizes 1 8 --graphs-only --out /tmp/off.json
    python3 benchmarks/moe_pdl_ab.py on rollout-engine bench ... --out /tmp/on.json
    python3 benchmarks/moe_pdl_ab.py off moe_kernel.py --shape qwen3-30b-a3b --tokens 1,8,64,2048"""
from __future__ import annotations

import sys

from ab_switch import run_program  # benchmarks/, the script's own folder
from rollout_engine.script_args import ScriptParser, run_script
from rollout_engine.suggest import unrecognized


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("moe_pdl_ab.py", __doc__)
    p.add_argument("side", choices=["on", "off"], help="the MoE kernels with dependent launch, or without")
    p.add_argument("program", choices=["rollout-engine", "moe_kernel.py"],
                   help="what runs then, in this process, with the arguments that follow")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        p.error(unrecognized(p, argv[:1]))
    args = p.parse_args(argv[:2])  # what follows is the program's, flags included
    args.args = argv[2:]
    from rollout_engine.kernels import moe, moe_align, moe_route, moe_row

    if args.side == "off":
        for module in (moe, moe_align, moe_route, moe_row):
            module.pdl_args = lambda x: {"PDL": False}
    return run_program(args.program, args.args)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
