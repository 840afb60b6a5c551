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

MAX_BYTES = 64 << 10  # one-shot up to this size: past ~128 KiB NCCL is as fast (BENCHMARKS.md, "Tensor parallelism")
ENV = "ROLLOUT_ENGINE_ALLREDUCE"  # "nccl": never use the one-shot path


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
    if device.type != "cuda" or tp_size == 1 or os.environ.get(ENV, "").lower() == "nccl":
        return None
    import torch.distributed as dist

    # Only the setup is tried: once a rank has entered a one-shot kernel it
    # waits for every other rank's signal, so a probe that fails on one rank
    # would leave the others spinning.
    fast, error = None, None
    try:
        fast = OneShotAllReduce(group, dtype, device)
    except Exception as e:  # noqa: BLE001 - an optional fast path: NCCL still works
        error = e
    ok = fast is not None
    agreed = torch.tensor([int(ok)], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not agreed.item():
        log.warning("one-shot all-reduce unavailable (%s); using NCCL for every message", error or "another rank")
        return None
    return fast
