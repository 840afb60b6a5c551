"""Where weights_checksum's time goes on the GPU: one kernel on a large
tensor (bandwidth), the same bytes split in many tensors (launch overhead),
and the CPU time of launching alone. On a machine with a CUDA GPU:

    python3 benchmarks/checksum_probe.py --out /tmp/checksum-probe.json

The report is printed; it is written to a file only when --out (or, as
before, a path as the only argument) is given.
"""
from __future__ import annotations

import argparse
import json
import time

from rollout_engine.cli_args import ScriptParser, UsageError, check_out_path, needs_cuda


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("checksum_probe.py", __doc__)
    p.add_argument("--out", help="write the report here (JSON)")
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
    from rollout_engine.kernels.checksum import many_sums, whole

    big = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    many = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(64)]  # 2 GiB in 64
    many_sums([whole(big)]); many_sums([whole(t) for t in many])
    one = timed(lambda: many_sums([whole(big)]))
    split = timed(lambda: many_sums([whole(t) for t in many]))
    torch.cuda.synchronize()
    t = time.perf_counter()
    many_sums([whole(t) for t in many])
    launch_cpu = time.perf_counter() - t
    copy = timed(lambda: big.clone())
    report = {"one_2GiB_ms": round(one * 1e3, 2), "one_GB_per_s": round(2**31 / one / 1e9, 1),
              "64x32MiB_ms": round(split * 1e3, 2), "64_launches_cpu_ms": round(launch_cpu * 1e3, 2),
              "clone_2GiB_ms": round(copy * 1e3, 2)}
    print(json.dumps(report))
    if out:
        with open(out, "w") as f:
            f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
