"""The engine's side of weight-sync groups: receive broadcast buckets and
hand their views to the weight loader, one bucket in memory at a time."""
from __future__ import annotations

import time
from typing import Iterator, Sequence

import torch

from rollout_engine.distributed.weight_sync import TensorSpec, WeightSyncGroup, plan_buckets, unpack


class WeightReceiver:
    def __init__(self):
        self.groups: dict[str, WeightSyncGroup] = {}

    def init_group(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   backend: str) -> None:
        if group_name in self.groups:
            raise RuntimeError(f"weight-sync group {group_name!r} already exists; destroy it first")
        self.groups[group_name] = WeightSyncGroup(master_address, master_port, rank, world_size, group_name, backend)

    def group(self, group_name: str) -> WeightSyncGroup:
        if group_name not in self.groups:
            raise RuntimeError(f"no weight-sync group {group_name!r}: call init_weight_sync_group() first")
        return self.groups[group_name]

    def receive(self, specs: Sequence[TensorSpec], src_rank: int, group_name: str, bucket_bytes: int,
                device: torch.device, timeout_s: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive every bucket (a generator: each arrives when the previous
        one has been consumed), all within `timeout_s` of the first."""
        group = self.group(group_name)
        buffer_device = device if group.backend == "nccl" else torch.device("cpu")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for bucket in plan_buckets(specs, bucket_bytes):
            flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=buffer_device)
            group.broadcast(flat, src=src_rank, deadline=deadline)
            yield from unpack(bucket, flat)

    def destroy(self, group_name: str) -> None:
        self.group(group_name).destroy()
        del self.groups[group_name]
