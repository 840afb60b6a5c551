"""A one-shot all-reduce for small messages over symmetric memory (CUDA).

Decode at small batch sizes is latency-bound on the two all-reduces per
layer. NCCL's ring pays several hops of latency per message; the one-shot
kernel copies this rank's input into a buffer every rank of the group can
read over NVLink (peer-to-peer mapped, no NVLink multicast), waits on a
barrier and has each rank sum all the buffers itself: one kernel, one hop.
Each rank reads `k` times the message, so it pays off for small messages
only; larger ones stay on NCCL.

Set up once per engine rank (a collective over the group), before CUDA
graphs are captured; the buffer lives outside the engine's releasable memory.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("rollout_engine")

# Group names this process has set up symmetric memory for. torch keeps its
# rendezvous state per group name for the life of the process, and a group
# made after an engine's teardown can get the same name again (a second
# standalone engine's world is "0" again in rank 0's process, while its fresh
# workers know nothing of the first): a rendezvous under a reused name would
# wait forever, so a reused name means NCCL for every message.
_SET_UP: set[str] = set()

MAX_BYTES = 64 << 10  # one-shot up to this size: past ~128 KiB NCCL is as fast (BENCHMARKS.md, "Tensor parallelism")
ENV = "ROLLOUT_ENGINE_ALLREDUCE"
MODES = ("one-shot", "nccl", "fused")
DEFAULT = "fused"  # the norms take the all-reduce (fused_norm.py); measured in BENCHMARKS.md, "Tensor parallelism"


def allreduce_mode() -> str:
    """The all-reduce path `ROLLOUT_ENGINE_ALLREDUCE` asks for: 'fused'
    (also when unset: the norms take the all-reduce, `fused_norm`, and this
    kernel the other small messages), 'one-shot' (this kernel for small
    messages, NCCL above, each norm its own kernel) or 'nccl' (NCCL for every
    message); any other value is a ValueError naming the variable and its
    values."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower() or DEFAULT
    if value not in MODES:
        raise ValueError(f"{ENV} must be 'fused', 'one-shot' or 'nccl' (or unset: {DEFAULT!r}), got {raw!r}")
    return value


def allreduce_mode_is_set() -> bool:
    """Whether `ROLLOUT_ENGINE_ALLREDUCE` names a path (a path asked for by
    name that cannot be set up is a warning; the default's fallback is not)."""
    return bool(os.environ.get(ENV, "").strip())


class OneShotAllReduce:
    def __init__(self, group, dtype: torch.dtype, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.align = max(1, 16 // dtype.itemsize)  # the kernel moves 16-byte vectors
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        n = x.numel()
        return (x.dtype == self.dtype and x.is_cuda and x.is_contiguous() and 0 < n <= self.max_numel
                and n % self.align == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        view = self.buffer[: x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", self.group_name, out)
        return out


def make_fast_all_reduce(group, tp_size: int, dtype: torch.dtype, device: torch.device):
    """A OneShotAllReduce for this group, or None (CPU, one rank, turned off
    with ROLLOUT_ENGINE_ALLREDUCE=nccl, or symmetric memory unavailable).
    Every rank of the group calls this together; an all-reduce of the
    outcome makes every rank take the same answer."""
    if tp_size == 1:
        return None
    mode = allreduce_mode_everywhere(group, device)
    if device.type != "cuda":  # gloo for every all-reduce
        if mode != "fused":  # (fused_norm says it, with the norms)
            log.info("tensor parallelism on the CPU: all-reduces over gloo")
        return None
    if mode == "nccl":
        log.info("tensor parallelism: NCCL for every all-reduce (%s=nccl)", ENV)
        return None
    # Only the setup is tried: once a rank has entered a one-shot kernel it
    # waits for every other rank's signal, so a probe that fails on one rank
    # would leave the others spinning.
    if not first_use_everywhere(group, device):
        log.info("one-shot all-reduce not set up: a rank has used this group's name before; NCCL for every message")
        return None
    fast, error = None, None
    try:
        fast = OneShotAllReduce(group, dtype, device)
    except Exception as e:  # noqa: BLE001 - an optional fast path: NCCL still works
        error = e
    if not agree_everywhere(fast is not None, group, device):
        log.warning("one-shot all-reduce unavailable (%s); using NCCL for every message", error or "another rank")
        return None
    log.info("tensor parallelism: a one-shot kernel for all-reduces up to %d KiB, NCCL above", MAX_BYTES >> 10)
    return fast


def first_use_everywhere(group, device: torch.device) -> bool:
    """True when no rank of the group has set up symmetric memory under the
    group's name before (every rank calls this together); the name then
    counts as used."""
    name = group.group_name
    fresh = agree_everywhere(name not in _SET_UP, group, device)
    _SET_UP.add(name)
    return fresh


def allreduce_mode_everywhere(group, device: torch.device, alike: bool | None = None) -> str:
    """`allreduce_mode()`, read by every rank of the group together (ranks of
    an engine inside a torch.distributed job each read their own
    environment): a ValueError on every rank when one rank's value is not a
    path (that rank's names the value), or, where the paths must be `alike`
    (by default on GPUs), when the ranks' paths differ: their setup
    collectives would fall out of step and hang (on the CPU every path runs
    the same collectives). Raised by one rank alone, the others would wait in
    their next collective."""
    import torch.distributed as dist

    try:
        mode, problem = allreduce_mode(), None
    except ValueError as e:
        mode, problem = None, e
    index = torch.tensor([MODES.index(mode) if mode else -1], device=device)
    low, high = index.clone(), index.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if problem is not None:
        raise problem
    if low.item() < 0:
        raise ValueError(f"{ENV} on another rank of this engine is not 'fused', 'one-shot' or 'nccl' (that rank's "
                         f"error names it; this rank: {mode!r})")
    if low.item() != high.item() and (device.type == "cuda" if alike is None else alike):
        raise ValueError(f"{ENV} differs between the ranks of one engine (this rank: {mode!r}); set it alike "
                         "on every rank")
    return mode


def agree_everywhere(ok, group, device: torch.device) -> bool:
    """True when `ok` holds on every rank of the group."""
    import torch.distributed as dist

    flag = torch.tensor([int(bool(ok))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
