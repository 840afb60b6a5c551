"""The trainer side of the weight-sync group: packs named tensors into
buckets and broadcasts them to the engine's ranks, which call
`RolloutEngine.update_weights_from_distributed` with the same metadata."""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from rollout_engine.distributed.weight_sync import (DEFAULT_BUCKET_BYTES, WeightSyncGroup, pack, plan_buckets,
                                                    specs_of)


class WeightSender:
    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str = "weight_sync",
                 backend: str = "nccl", bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str | None = None):
        self.group = WeightSyncGroup(master_address, master_port, 0, world_size, group_name, backend)
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))

    @staticmethod
    def metadata(named_tensors: Sequence[tuple[str, torch.Tensor]]):
        """(names, dtypes, shapes): what the engine must be told to receive."""
        return ([n for n, _ in named_tensors], [t.dtype for _, t in named_tensors],
                [tuple(t.shape) for _, t in named_tensors])

    def send(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Broadcast bucket by bucket; only one packed bucket exists at a time."""
        self.send_stream(iter(named_tensors), self.metadata(named_tensors))

    def send_stream(self, named_tensors: Iterator[tuple[str, torch.Tensor]], metadata):
        """The same from an iterator (e.g. tensors gathered one at a time),
        given its (names, dtypes, shapes) up front. Returns the metadata."""
        names, dtypes, shapes = metadata
        for bucket in plan_buckets(specs_of(names, dtypes, shapes), self.bucket_bytes):
            part = []
            for spec, _ in bucket.entries:
                name, tensor = next(named_tensors)
                if name != spec.name or tuple(tensor.shape) != spec.shape:
                    raise ValueError(f"stream gave {name} {tuple(tensor.shape)}, metadata says {spec.name} {spec.shape}")
                part.append(tensor)
            self.group.broadcast(pack(bucket, part, self.device), src=0)
        return metadata

    def close(self) -> None:
        self.group.destroy()
