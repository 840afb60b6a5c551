"""All-reduce latency inside a CUDA graph, NCCL vs the engine's one-shot
path, over the GPUs of one host (one process per GPU); and the all-reduce
with the residual add and RMSNorm after it (rows of `--hidden` columns):
NCCL or the one-shot kernel then the norm kernel, against the fused kernel
(`distributed/fused_norm.py`).

    python benchmarks/tp_allreduce.py --gpus 2 --out /tmp/allreduce.json

Each graph holds `--ops` back-to-back all-reduces of one size (what a decode
step's layers do); the time per all-reduce is the graph's replay time over
`--ops`.
"""
from __future__ import annotations

import json
import os
import time

from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script


def _time_graph(fn, x, ops: int, replays: int) -> float:
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            y = x
            for _ in range(ops):
                y = fn(y)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(ops):
            y = fn(y)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays / ops


def _rank(rank: int, size: int, port: int, args, queue) -> None:
    import torch
    import torch.distributed as dist

    from rollout_engine.distributed.fast_allreduce import OneShotAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    dtype = torch.bfloat16
    fast = OneShotAllReduce(group, dtype, torch.device("cuda", rank), max_bytes=max(args.sizes_kib) * 1024)

    def nccl(t):
        dist.all_reduce(t, group=group)
        return t

    from rollout_engine.distributed.comm import TPComm
    from rollout_engine.kernels.rmsnorm import rmsnorm

    os.environ["ROLLOUT_ENGINE_ALLREDUCE"] = "fused"  # opt-in; its first use on a machine builds the kernels (minutes)
    fused = TPComm(rank, size, group).with_fused_norm(args.hidden, dtype, torch.device("cuda", rank)).fused
    eps = 1e-5
    rows = []
    for kib in args.sizes_kib:
        x = torch.full((kib * 1024 // 2,), 1.0 / 64, dtype=dtype, device="cuda")
        check = fast(x)
        assert torch.allclose(check.float(), x.float() * size), "one-shot sum is wrong"
        # scale down after each op so repeated sums stay finite
        row = {"kib": kib,
               "nccl_us": _time_graph(lambda t: nccl(t).mul_(1.0 / size), x.clone(), args.ops, args.replays) * 1e6,
               "one_shot_us": _time_graph(lambda t: fast(t).mul_(1.0 / size), x.clone(), args.ops,
                                          args.replays) * 1e6,
               "scale_only_us": _time_graph(lambda t: t.mul_(1.0 / size), x.clone(), args.ops, args.replays) * 1e6}
        tokens = kib * 1024 // dtype.itemsize // args.hidden
        if tokens and tokens * args.hidden * dtype.itemsize == kib * 1024:  # whole rows: with the norm after it
            h = x.view(tokens, args.hidden)
            residual, w = torch.randn_like(h), torch.ones(args.hidden, dtype=dtype, device="cuda")
            row["rows"] = tokens
            row["nccl_norm_us"] = _time_graph(lambda t: rmsnorm(nccl(t), w, eps, residual)[0], h.clone(), args.ops,
                                              args.replays) * 1e6
            row["one_shot_norm_us"] = _time_graph(lambda t: rmsnorm(fast(t), w, eps, residual)[0], h.clone(),
                                                  args.ops, args.replays) * 1e6
            if fused is not None and fused.fits(h, residual):
                row["fused_us"] = _time_graph(lambda t: fused(t, residual, w, eps)[0], h.clone(), args.ops,
                                              args.replays) * 1e6
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import multiprocessing as mp

    from rollout_engine.distributed.tp_group import free_port

    p = ScriptParser("tp_allreduce.py", __doc__)
    p.add_argument("--gpus", type=positive_int, default=2, help="ranks, one per GPU")
    p.add_argument("--sizes-kib", type=positive_int, nargs="+", default=[8, 32, 128, 512, 1024, 4096],
                   help="message sizes")
    p.add_argument("--hidden", type=positive_int, default=4096, help="columns of a row (the norm's width)")
    p.add_argument("--ops", type=positive_int, default=64, help="all-reduces per captured graph")
    p.add_argument("--replays", type=positive_int, default=50, help="graph replays timed")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_checked(argv)
    needs_cuda(p, "one per rank, --gpus", args.gpus)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.gpus, port, args, queue)) for r in range(args.gpus)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=300)
    for proc in procs:
        proc.join(60)
    print(f"{'KiB':>6} {'nccl us':>9} {'one-shot us':>12} {'scale us':>9} {'rows':>5} {'nccl+norm':>10} "
          f"{'one-shot+norm':>14} {'fused':>7}")
    for r in rows:
        print(f"{r['kib']:>6} {r['nccl_us']:>9} {r['one_shot_us']:>12} {r['scale_only_us']:>9} {r.get('rows', '-'):>5} "
              f"{r.get('nccl_norm_us', '-'):>10} {r.get('one_shot_norm_us', '-'):>14} {r.get('fused_us', '-'):>7}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpus": args.gpus, "ops": args.ops, "rows": rows,
                       "nvls": os.environ.get("NCCL_NVLS_ENABLE")}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
