"""RL controls, run by the step loop between two steps (EngineCore.call).

Each method here runs on the loop thread, so it sees the scheduler settled
or with at most one step in flight, and settles that step itself before it
touches weights or memory."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from rollout_engine.core.build import EngineParts
from rollout_engine.core.rank_ops import RankOps
from rollout_engine.scheduler.stats import counters

if TYPE_CHECKING:
    from rollout_engine.core.engine_core import EngineCore

PAUSE_MODES = ("abort", "keep", "retract")


class Controls:
    def __init__(self, core: "EngineCore", parts: EngineParts):
        self.core = core
        self.parts = parts
        self.scheduler = parts.scheduler
        self.ops = RankOps(parts)

    # ---- generation state -------------------------------------------------------
    def pause(self, mode: str) -> None:
        self.scheduler.settle()
        if mode == "abort":
            self.core.abort_now()
        elif mode == "retract":
            self.scheduler.retract_all()
        self.core.paused = True
        self.core.dispatch()

    def resume_generation(self) -> None:
        self.core.paused = False

    def abort(self, request_ids: list[str] | None) -> int:
        return self.scheduler.abort(request_ids)

    def num_unfinished(self) -> int:
        return len(self.scheduler.live_requests())

    # ---- weights (on every rank) ----------------------------------------------------
    def _on_every_rank(self, op: str, *args):
        """Rank operation `op` here and, with tensor parallelism, on every
        other rank between the same two steps."""
        local = lambda: getattr(self.ops, op)(*args)  # noqa: E731
        channel = self.parts.channel
        if channel is None:
            return local()
        # Embedded ranks bring their own arguments (every rank made the call).
        return channel.call(op, None if channel.embedded else args, local)

    def _update(self, op: str, *args, everywhere=None) -> int:
        self.scheduler.settle()  # the step in flight reads the weights
        version = (everywhere or self._on_every_rank)(op, *args)
        self.scheduler.weight_version = version  # tokens sampled from here on carry it
        return version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None) -> int:
        channel = self.parts.channel
        if channel is None or channel.embedded:  # embedded: every rank passed its own full tensors
            return self._update("update_weights", named_tensors, version)
        # Standalone: the other ranks get each tensor by broadcast, streamed.
        if isinstance(named_tensors, (list, tuple)):
            self.parts.updater.check_whole(named_tensors)  # a bad list changes no rank

        def everywhere(op, version):
            stream = channel.stream_tensors(named_tensors, self.parts.device)

            def local():
                try:
                    return self.ops.update_weights(stream, version)
                finally:
                    stream.close()
                    channel.send(("end",))

            return channel.call(op, (version,), local)

        return self._update("update_weights_broadcast", version, everywhere=everywhere)

    def update_from_disk(self, path: str, version: int | None) -> int:
        return self._update("update_from_disk", path, version)

    def update_from_distributed(self, *args) -> int:
        return self._update("update_from_distributed", *args)

    def init_weight_sync_group(self, *args) -> None:
        self._on_every_rank("init_weight_sync_group", *args)

    def destroy_weight_sync_group(self, group_name: str) -> None:
        self._on_every_rank("destroy_weight_sync_group", group_name)

    def get_weight(self, name: str) -> torch.Tensor:
        loader, channel = self.parts.updater.loader, self.parts.channel
        if channel is None:
            return loader.read(name)
        layout = loader.shard_layout(name)  # checks the name before any rank is asked
        args = None if channel.embedded else (name,)
        parts = channel.call_all("read_weight", args, lambda: self.ops.read_weight(name))
        dim = layout.dim
        if dim is None:
            return parts[0]
        pieces = [p.chunk(layout.pieces, dim) for p in parts[::layout.replicas]]
        full = torch.cat([piece[i] for i in range(layout.pieces) for piece in pieces], dim=dim)
        return full if layout.trim is None else full.narrow(dim, 0, layout.trim)

    def weights_checksum(self, names: list[str] | None) -> dict[str, str]:
        from rollout_engine.weights.checksum import combine

        parts = self.parts
        if not parts.memory.resident("weights"):
            raise RuntimeError("cannot checksum weights while they are released; resume_memory(['weights']) first")
        if names is None:
            names = parts.updater.loader.full_names()
        else:
            for name in names:
                parts.updater.loader.shard_layout(name)  # ValueError naming an unknown one, before any rank is asked
        channel = parts.channel
        if channel is None:
            results = [self.ops.checksum_sums(names)]
        else:
            args = None if channel.embedded else (names,)
            results = channel.call_all("checksum_sums", args, lambda: self.ops.checksum_sums(names))
        joined = {n: self.get_weight(n).to(parts.device) for n in results[0][1]}
        return combine([sums for sums, _ in results], names, joined)

    # ---- memory -----------------------------------------------------------------
    def release_memory(self, tags: Sequence[str]) -> dict[str, int]:
        return self._on_every_rank("release_memory", tags, self.core.paused)

    def resume_memory(self, tags: Sequence[str]) -> None:
        self._on_every_rank("resume_memory", tags)

    def memory_state(self) -> dict[str, str]:
        return self.parts.controller.state()

    def flush_cache(self) -> None:
        self.parts.prefix_cache.flush()

    # ---- observation ------------------------------------------------------------
    def cache_stats(self) -> dict[str, float]:
        return counters(self.parts.prefix_cache, self.scheduler)

    def metrics(self) -> dict:
        sched = self.scheduler
        return {"running_requests": len(sched.running), "waiting_requests": len(sched.waiting),
                **sched.stats.snapshot(), "cache": self.cache_stats(), "weight_version": self.parts.updater.version,
                "kv_capacity_tokens": self.parts.limits.kv_capacity,
                "kv_free_tokens": sched.kv.allocator.num_free_pages * sched.kv.page_size, "memory": self.memory_state(),
                "paused": self.core.paused, "invalid_weights": self.parts.controller.validity.count}

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
