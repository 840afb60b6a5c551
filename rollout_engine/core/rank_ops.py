"""What every rank of an engine applies to its own parts: weight updates
(each rank keeps its shard of full tensors) and memory release/resume. Rank 0
runs these from its controls and tells the other ranks to run the same, with
the same arguments, between the same two steps."""
from __future__ import annotations

from typing import Sequence

from rollout_engine.core.build import EngineParts


class RankOps:
    def __init__(self, parts: EngineParts, tp_rank: int = 0, link=None):
        self.parts = parts
        self.tp_rank = tp_rank
        self.link = link  # ranks 1..k-1: the way to rank 0
        self._checksums = None  # weights/checksum.py's RankChecksums, made on first use

    def update_weights(self, named_tensors, version) -> int:
        return self.parts.updater.update(named_tensors, version)

    def update_weights_broadcast(self, version) -> int:
        """Ranks 1..k-1 of a standalone engine: the tensors come by broadcast
        from rank 0 (see TPChannel.stream_tensors)."""
        stream = self.link.receive_tensors(self.parts.device)
        try:
            return self.parts.updater.update(stream, version)
        finally:
            for _ in stream:  # after an error here, keep taking rank 0's broadcasts until it ends
                pass

    def update_from_disk(self, path: str, version) -> int:
        return self.parts.updater.update_from_disk(path, version)

    def update_from_distributed(self, *args) -> int:
        return self.parts.updater.update_from_distributed(*args)

    def init_weight_sync_group(self, address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                               backend: str) -> None:
        # Engine rank r joins the sync group as rank_offset + r.
        self.parts.updater.receiver.init_group(address, port, rank_offset + self.tp_rank, world_size, group_name,
                                               backend)

    def destroy_weight_sync_group(self, group_name: str) -> None:
        self.parts.updater.receiver.destroy(group_name)

    def release_memory(self, tags: Sequence[str], paused: bool) -> dict[str, int]:
        return self.parts.controller.release(tags, paused)

    def resume_memory(self, tags: Sequence[str]) -> None:
        self.parts.controller.resume(tags)

    def checksum_sums(self, names):
        """This rank's checksum sums of `names` (weights/checksum.py)."""
        if self._checksums is None:
            from rollout_engine.weights.checksum import RankChecksums

            comm = self.parts.comm
            self._checksums = RankChecksums(self.parts.updater.loader, comm.tp_rank, comm.tp_size)
        return self._checksums.sums(names)

    def read_weight(self, name: str):
        """This rank's part of weight `name`, on the host."""
        return self.parts.updater.loader.read(name).cpu()
