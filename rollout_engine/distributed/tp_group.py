"""A tensor-parallel group for one engine, standalone: the engine's process
is rank 0 and spawns `tp_size - 1` worker processes; together they form
their own process group (NCCL on the GPU, gloo on the CPU) plus a gloo group
for replies to rank 0; rank 0's messages (step plans, RL controls) travel
over one socket per rank (`messages.py`).

Rank 0 plans; every rank runs each StepPlan on its shard of the model and
samples the same tokens (the logits are gathered, so every rank samples
from identical inputs). Workers die with the engine: they exit on a
"stop" message, when the control channel breaks, and, on Linux, when their
parent process dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout_engine.distributed import fused_norm, messages
from rollout_engine.distributed.comm import TPComm
from rollout_engine.interrupts import ctrl_c_ignored

TIMEOUT = timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TPChannel:
    """Rank 0's side of the control group."""

    comm: TPComm
    control: Any  # the gloo group for replies
    outbox: messages.Outbox  # to every other rank
    processes: list  # standalone: the spawned ranks
    embedded: bool = False  # the ranks are a torch.distributed job's: leave its default group alone

    def send(self, message: tuple) -> None:
        self.outbox.send(message)

    def call(self, op: str, args: tuple, local) -> Any:
        """Run rank operation `op(*args)` on every rank (here: `local()`);
        returns rank 0's result, or raises the first rank's error."""
        return self.call_all(op, args, local)[0]

    def call_all(self, op: str, args: tuple, local) -> list:
        """`call`, returning every rank's result (rank 0's first)."""
        self.send(("call", op, args))
        try:
            mine = ("ok", local())
        except Exception as e:  # noqa: BLE001 - the other ranks still answer first
            mine = ("error", e)
        results = self.gather(mine)
        for status, value in results:
            if status == "error":
                raise value
        return [value for _, value in results]

    def stream_tensors(self, named_tensors, device: torch.device):
        """Rank 0's side of a weight update that the other ranks receive by
        broadcast over the engine's group (NCCL on GPUs), not pickled: each
        tensor is announced, broadcast, then yielded to rank 0's own update.
        The caller sends ("end",) when its update stops, however it stops."""
        for name, tensor in named_tensors:
            tensor = tensor.detach().to(device).contiguous()
            self.send(("tensor", name, tensor.dtype, tuple(tensor.shape)))
            dist.broadcast(tensor, group=self.comm.group, group_src=0)
            yield name, tensor

    def gather(self, result: Any) -> list:
        """Every rank's result of the last call (rank 0's first)."""
        out = [None] * self.comm.tp_size
        dist.gather_object(result, out, group=self.control, group_dst=0)
        return out

    def close(self, timeout: float = 30.0) -> None:
        """Every rank leaves at the same time (NCCL's teardown is collective:
        a rank destroying its communicator alone waits for the others), then
        the spawned ranks are joined."""
        global _STANDALONE_WORLD
        try:
            self.send(("stop",))
            leave(self.comm, self.control, self.embedded)
        finally:
            if not self.embedded:  # its world is gone, unless the teardown failed
                _STANDALONE_WORLD = dist.is_initialized()
            self.outbox.close()
            for p in self.processes:
                p.join(timeout)
                if p.is_alive():
                    p.kill()


@dataclass
class RankLink:
    """Ranks 1..k-1's side: rank 0's messages in, replies out."""

    comm: TPComm
    control: Any
    inbox: messages.Inbox
    embedded: bool = False

    def receive(self) -> tuple:
        return self.inbox.receive()

    def receive_tensors(self, device: torch.device):
        """The other side of `TPChannel.stream_tensors`: (name, tensor) until
        rank 0 ends the stream."""
        while (message := self.receive())[0] == "tensor":
            _, name, dtype, shape = message
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, group=self.comm.group, group_src=0)
            yield name, tensor

    def reply(self, result: Any) -> None:
        dist.gather_object(result, None, group=self.control, group_dst=0)

    def leave(self) -> None:
        try:
            leave(self.comm, self.control, self.embedded)
        finally:
            self.inbox.close()


def channel_of(comm: TPComm, control, processes: list, embedded: bool) -> TPChannel | RankLink:
    """Connect rank 0 with the others (every rank calls this together): rank 0
    gets the TPChannel, the others their RankLink."""
    box = messages.connect(comm.tp_rank, comm.tp_size, control)
    if comm.tp_rank == 0:
        return TPChannel(comm, control, box, processes, embedded)
    return RankLink(comm, control, box, embedded)


def leave(comm: TPComm, control, embedded: bool) -> None:
    """Drop the engine's groups (standalone: its whole process group).

    NCCL communicators are aborted, not destroyed: destroying one waits on
    the other ranks' teardown (seen hanging on two GPUs at shutdown), and
    aborting is local. This rank's steps have all finished by now (rank 0
    collects each step; the others collect before leaving), so no collective
    is in flight."""
    from torch.distributed.distributed_c10d import _abort_process_group

    groups = list({id(g): g for g in (comm.group, control)}.values())
    nccl = [g for g in groups if dist.get_backend(g) == "nccl"]
    if nccl:
        torch.cuda.synchronize()
    fused_norm.close_for(comm.group)
    if not embedded:
        for group in groups:  # the gloo control group, then the world
            if group is not dist.group.WORLD:
                dist.destroy_process_group(group)
        if nccl:
            _abort_process_group()
        else:
            dist.destroy_process_group()
        return
    for group in groups:
        if group in nccl:
            _abort_process_group(group)
        else:
            dist.destroy_process_group(group)


def embedded_group(k: int, device: torch.device) -> tuple[TPComm, Any]:
    """Inside an initialised torch.distributed job: consecutive blocks of k
    ranks form one engine each, with groups of their own (every rank creates
    every block's groups, in the same order, as new_group requires)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % k:
        raise ValueError(f"tp_size {k} must divide the world size {world} (consecutive groups of tp_size ranks "
                         "form one engine each)")
    mine = None
    for block in range(world // k):
        ranks = list(range(block * k, (block + 1) * k))
        group = dist.new_group(ranks, timeout=TIMEOUT)
        control = dist.new_group(ranks, backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else group
        if rank in ranks:
            mine = (group, control)
    return TPComm(rank % k, k, mine[0]), mine[1]


# Whether torch.distributed's default group in this process is a standalone engine's (its rank 0 formed it).
_STANDALONE_WORLD = False


def in_distributed_job() -> bool:
    """Whether this process is a rank of a torch.distributed job, so that a
    tp_size > 1 engine is embedded in it. A live standalone engine's own
    group is not one: another engine with tp_size > 1 beside it is refused
    (it took that group for a job and waited for ranks that never came)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if _STANDALONE_WORLD:
        raise RuntimeError("a tensor-parallel engine is already running in this process (its ranks form "
                           "torch.distributed's default group): shut it down before building another with "
                           "tp_size > 1, or build each in a process of its own")
    return True


class TPStepRunner:
    """Rank 0's step runner: each plan goes to every other rank, then runs
    here; this rank's results are the engine's."""

    def __init__(self, local, channel: TPChannel):
        self.local = local
        self.channel = channel

    def launch(self, plan, prev=None):
        self.channel.send(("plan", plan))
        return self.local.launch(plan, prev)

    def collect(self, handle):
        return self.local.collect(handle)

    def routes_of(self, slot_lists):
        return self.local.routes_of(slot_lists)  # every rank routes alike: this rank's record is the engine's


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(rank: int, size: int, port: int, device: torch.device, procs=()) -> tuple[TPComm, Any]:
    """Join the engine's process group; returns the TP comm and the control
    group. Rank 0 hosts the rendezvous and, before forming the group, waits
    for every worker (`procs`) to check in, so that a worker that dies on the
    way is reported instead of waited for."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=TIMEOUT,
                          wait_for_workers=False)
    if rank == 0:
        _wait_for_workers(store, procs)
    else:
        store.set(f"checked-in/{rank}", "1")
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else dist.group.WORLD
    return TPComm(rank, size, dist.group.WORLD), control


def _wait_for_workers(store, procs) -> None:
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    for rank, proc in enumerate(procs, start=1):
        while not store.check([f"checked-in/{rank}"]):
            if not proc.is_alive():
                raise RuntimeError(
                    f"tensor-parallel worker {rank} exited (code {proc.exitcode}) before joining the engine's "
                    "group; its error is printed above. Workers are started with multiprocessing's spawn, which "
                    "imports the main script again: a script that builds an engine with tp_size > 1 must do "
                    "it under `if __name__ == \"__main__\":`")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel worker {rank} did not join within {TIMEOUT}")
            time.sleep(0.05)


@dataclass
class Started:
    """Ranks 1..k-1 of a standalone engine, started (`start_workers`), not
    yet joined (`join_workers`)."""

    port: int
    device: torch.device
    procs: list

    def terminate(self) -> None:
        for p in self.procs:
            p.terminate()


def start_workers(cfg, device: torch.device, worker_main) -> Started:
    """Start ranks 1..k-1 (running `worker_main(cfg, rank, k, port, device)`).
    Called on the thread a Ctrl-C lands on (the constructor's): they start
    ignoring it."""
    import multiprocessing as mp

    k, port = cfg.tp_size, free_port()
    ctx = mp.get_context("spawn")
    base = device.index or 0
    started = Started(port, device, [])
    try:
        # Ctrl-C ignored while the workers start: a spawned process keeps an ignored signal through exec, so a
        # Ctrl-C while it imports torch, this package and the main script (seconds) prints no traceback from
        # every worker; `deaf_to_ctrl_c` then keeps ignoring it. One within the starts' milliseconds is dropped.
        with ctrl_c_ignored():
            for rank in range(1, k):
                worker_device = torch.device("cuda", base + rank) if device.type == "cuda" else device
                p = ctx.Process(target=worker_main, args=(cfg, rank, k, port, str(worker_device)), daemon=True,
                                name=f"rollout-engine-tp{rank}")
                p.start()
                started.procs.append(p)
    except BaseException:
        started.terminate()
        raise
    return started


def join_workers(started: Started) -> TPChannel:
    """Join the group of the workers `start_workers` started, as rank 0."""
    global _STANDALONE_WORLD
    try:
        comm, control = join_group(0, len(started.procs) + 1, started.port, started.device, started.procs)
    except BaseException:
        started.terminate()
        raise
    _STANDALONE_WORLD = True
    return channel_of(comm, control, started.procs, embedded=False)


def deaf_to_ctrl_c() -> None:
    """A worker ignores Ctrl-C: it reaches the whole process group, and rank
    0 handles it and stops this rank (or this rank dies with it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def die_with_parent() -> None:
    """Linux: get SIGTERM when the parent process dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before we got here
        os._exit(1)
