"""A tensor-parallel worker process (ranks 1..k-1 of a standalone engine):
builds its shard of the engine, then runs what rank 0 sends, in order: step
plans (the same tokens come out on every rank), rank operations (weights,
memory), stop."""
from __future__ import annotations

import dataclasses
import os

import torch

from rollout_engine.config import EngineConfig
from rollout_engine.core.build import EngineParts, build_parts
from rollout_engine.core.rank_ops import RankOps
from rollout_engine.distributed import tp_group


def worker_main(cfg: EngineConfig, rank: int, size: int, port: int, device: str) -> None:
    tp_group.die_with_parent()
    tp_group.deaf_to_ctrl_c()  # without a traceback from every rank
    if torch.device(device).type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    comm, control = tp_group.join_group(rank, size, port, torch.device(device))
    link = tp_group.channel_of(comm, control, [], embedded=False)
    parts = build_parts(dataclasses.replace(cfg, device=device), comm)
    serve(parts, link, local_call=None)


def serve(parts: EngineParts, link: tp_group.RankLink, local_call=None, on_result=None) -> None:
    """Run what rank 0 sends until it says stop. Embedded ranks take a rank
    operation's arguments from their own caller (`local_call(op)` returns a
    function to run, the caller's own call), and get each front-end call's
    result (`on_result(kind, value)`)."""
    ops = RankOps(parts, parts.comm.tp_rank, link)
    prev = None  # the last step launched here
    while True:
        try:
            message = link.receive()
        except Exception:  # the engine is gone
            return
        kind = message[0]
        if kind == "plan":
            # Launch only: rank 0 waits for each step's results, this rank
            # never does, so its next plan is queued on the device behind the
            # step in flight (waiting here would leave the device idle while
            # the next plan travels, and rank 0's collectives would wait).
            prev = parts.runner.launch(message[1], prev, to_host=False)
            continue
        parts.runner.settle()  # operations and stop see this rank's steps finished
        if kind == "call":
            op, args = message[1], message[2]
            try:
                run = local_call(op) if link.embedded else (lambda: getattr(ops, op)(*args))
                result = ("ok", run())
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                result = ("error", e)
            link.reply(result)
        elif kind == "result":
            on_result(message[1], message[2])
        elif kind == "stop":
            drop_graphs(parts)
            link.leave()
            return


def drop_graphs(parts: EngineParts) -> None:
    """Destroy the CUDA graphs before the groups: a communicator whose
    collectives are captured in live graphs cannot be torn down (NCCL waits
    for those graphs), and every rank would hang at shutdown."""
    if parts.runner.graphs is not None:
        parts.runner.settle()  # no replay in flight
        parts.runner.graphs.destroy()
        parts.runner.graphs = None
