"""The weight-sync group: the trainer's sender rank and the engine's ranks,
with their own rendezvous (independent of any default process group), and
the bucket layout both sides derive from the same (names, dtypes, shapes)."""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 512 << 20
DEFAULT_TIMEOUT_S = 300.0  # one update_weights_from_distributed call, every bucket included
_ALIGN = 256  # byte alignment of each tensor inside a bucket


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    entries: tuple[tuple[TensorSpec, int], ...]  # (spec, byte offset)


def specs_of(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[TensorSpec]:
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    return [TensorSpec(n, d, tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Tensors in order, packed greedily; one larger than a bucket gets its own."""
    buckets, entries, used = [], [], 0
    for spec in specs:
        size = -(-spec.nbytes // _ALIGN) * _ALIGN
        if entries and used + size > bucket_bytes:
            buckets.append(Bucket(used, tuple(entries)))
            entries, used = [], 0
        entries.append((spec, used))
        used += size
    if entries:
        buckets.append(Bucket(used, tuple(entries)))
    return buckets


def unpack(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of a received bucket, one per tensor."""
    for spec, offset in bucket.entries:
        yield spec.name, flat[offset: offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for (spec, offset), t in zip(bucket.entries, tensors):
        flat[offset: offset + spec.nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    return flat


class WeightSyncGroup:
    """A process group of its own: rank 0 is the trainer's sender."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_sync", backend: str = "nccl", timeout_s: float = 300.0):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError("backend 'nccl' needs CUDA GPUs and a torch built with NCCL; on the CPU use "
                             "backend='gloo'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
        self.store = dist.PrefixStore(group_name, store)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
        self.name = group_name
        self.broken: str | None = None  # why the group can no longer be used

    def broadcast(self, tensor: torch.Tensor, src: int, deadline: float | None = None) -> None:
        """Receive (or send) `tensor`; a peer that has not sent by `deadline`
        (time.monotonic()) or has died breaks the group: TimeoutError or
        RuntimeError, never a hang. A broken group refuses further use."""
        if self.broken:
            raise RuntimeError(f"weight-sync group {self.name!r} is broken ({self.broken}): "
                               "destroy_weight_sync_group() and init a new one")
        work = self.pg.broadcast(tensor, src)
        if deadline is None:
            work.wait()
            return
        # Poll rather than wait: a wait on a dead peer's collective can block
        # past any timeout it is given (and for NCCL only the stream waits).
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                self._break(f"the sender (rank {src}) sent nothing in time")
                raise TimeoutError(f"weight-sync group {self.name!r}: the broadcast from rank {src} did not arrive "
                                   "in time; the group is broken: destroy_weight_sync_group() and init a new one")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        try:
            work.wait()  # completed: raises the collective's own error, if any
        except Exception as e:
            self._break(f"the broadcast from rank {src} failed: {e}")
            raise RuntimeError(f"weight-sync group {self.name!r}: the broadcast from rank {src} failed ({e}); "
                               "the group is broken: destroy_weight_sync_group() and init a new one") from None

    def _break(self, why: str) -> None:
        self.broken = why
        abort = getattr(self.pg, "abort", None)  # NCCL: frees the kernels waiting on the dead peer
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - the group is given up either way
                pass

    def destroy(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None and not self.broken:
            shutdown()
        self.pg = None
