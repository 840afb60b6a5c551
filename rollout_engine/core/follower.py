"""Ranks 1..k-1 of a tensor-parallel engine embedded in a torch.distributed
job (every rank constructed the engine and makes the same calls).

The rank's loop thread builds its shard, then runs what rank 0 sends: step
plans, rank operations and the result of each front-end call. Front-end calls
here wait for rank 0's result of the matching call (calls are matched in the
order they are made, so every rank must make them in the same order, as
collectives require); rank 0's arguments are the ones used. A rank operation
(weights, memory) runs with this rank's own arguments when rank 0 reaches it,
so each rank can pass its own full tensors. Calls that read or change rank
0's scheduler (pause, abort, flush, metrics, ...) answer for this rank only.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import torch

from rollout_engine.config import EngineConfig
from rollout_engine.core.build import EngineParts, build_parts, engine_cuda_index
from rollout_engine.core.rank_ops import RankOps
from rollout_engine.core.request_factory import RequestFactory
from rollout_engine.core.subscription import Subscription, counts_as_done
from rollout_engine.core.worker import serve
from rollout_engine.distributed.tp_group import RankLink


class FollowerCore:
    def __init__(self, cfg: EngineConfig, link: RankLink):
        self.paused = False
        self.manual = False
        self._calls: deque[Subscription] = deque()  # calls made here, waiting for rank 0's result
        self._results: deque[tuple[str, Any]] = deque()  # rank 0's results that came before the call here
        self._lock = threading.Lock()
        self._ops: queue.SimpleQueue = queue.SimpleQueue()  # (op, run) posted by this rank's caller
        built: Future = Future()
        self._cuda_index = engine_cuda_index(cfg)
        self._thread = threading.Thread(target=self._run, args=(cfg, link, built), daemon=True,
                                        name=f"rollout-engine-tp{link.comm.tp_rank}")
        self._thread.start()
        self.parts: EngineParts = built.result()
        self.factory = RequestFactory(self.parts.tokenizer, self.parts.limits, cfg.seed)
        self.controls = FollowerControls(self, RankOps(self.parts, link.comm.tp_rank))

    def _run(self, cfg, link: RankLink, built: Future) -> None:
        try:
            if self._cuda_index is not None:  # this rank's GPU, not GPU 0
                torch.cuda.set_device(self._cuda_index)
            parts = build_parts(cfg, link.comm)
        except BaseException as e:  # noqa: BLE001 - raised in the constructor
            built.set_exception(e)
            return
        built.set_result(parts)
        serve(parts, link, local_call=self._local_call, on_result=self._on_result)

    # ---- the front ends' side --------------------------------------------------------
    def submit(self, token_lists, params, request_ids, sub: Subscription) -> None:
        with self._lock:
            result = self._results.popleft() if self._results else None
            if result is None:
                self._calls.append(sub)
        if result is not None:
            self._deliver(sub, *result)

    def abort_call(self, sub: Subscription) -> None:
        sub.done = True  # rank 0 decides what runs; its result for this call is dropped here

    def post(self, fn: Callable[[], Any], fut: Future | None = None) -> None:
        fn()

    def call(self, fn: Callable[..., Any], *args) -> Any:
        return fn(*args)

    def run_rank_op(self, op: str, run: Callable[[], Any]) -> Any:
        """Queue this rank's part of a rank operation; returns its result
        once rank 0 has reached the same operation."""
        fut: Future = Future()
        self._ops.put((op, run, fut))
        return fut.result()

    def stop(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)  # rank 0's shutdown sends the stop

    # ---- the loop thread's side ----------------------------------------------------------
    def _local_call(self, op: str) -> Callable[[], Any]:
        mine, run, fut = self._ops.get()
        if mine != op:
            error = RuntimeError(f"tensor-parallel ranks diverged: rank 0 runs {op}, this rank called {mine}")
            fut.set_exception(error)
            raise error

        def execute() -> Any:
            try:
                result = run()
            except BaseException as e:
                fut.set_exception(e)
                raise
            fut.set_result(result)
            return result

        return execute

    def _on_result(self, kind: str, value) -> None:
        with self._lock:
            sub = self._calls.popleft() if self._calls else None
            if sub is None:  # rank 0 finished before this rank made the call
                self._results.append((kind, value))
                return
        self._deliver(sub, kind, value)

    @staticmethod
    def _deliver(sub: Subscription, kind: str, value) -> None:
        if sub.done:
            return
        if kind == "error":
            sub.fail(value)
            return
        if sub.stream:
            for out in value:
                sub.deliver(("delta", out))
            sub.deliver(("end", None))
            return
        if sub.progress:
            sub.deliver(("progress", sum(counts_as_done(out.finish_reason) for out in value)))
        sub.deliver(("end", value))


class FollowerControls:
    """The controls of a follower rank: rank operations wait for rank 0's;
    the rest answer for this rank."""

    def __init__(self, core: FollowerCore, ops: RankOps):
        self.core, self.ops = core, ops

    def _rank_op(self, op: str, *args):
        return self.core.run_rank_op(op, lambda: getattr(self.ops, op)(*args))

    def update_weights(self, named_tensors, version) -> int:
        return self._rank_op("update_weights", named_tensors, version)

    def update_from_disk(self, path: str, version) -> int:
        return self._rank_op("update_from_disk", path, version)

    def update_from_distributed(self, *args) -> int:
        return self._rank_op("update_from_distributed", *args)

    def init_weight_sync_group(self, *args) -> None:
        return self._rank_op("init_weight_sync_group", *args)

    def destroy_weight_sync_group(self, group_name: str) -> None:
        return self._rank_op("destroy_weight_sync_group", group_name)

    def release_memory(self, tags) -> dict[str, int]:
        return self._rank_op("release_memory", tags, True)

    def resume_memory(self, tags) -> None:
        return self._rank_op("resume_memory", tags)

    def get_weight(self, name: str):
        """This rank's part (rank 0 returns the whole tensor, joined)."""
        return self._rank_op("read_weight", name)

    def weights_checksum(self, names):
        """This rank's sums (rank 0 returns the digests)."""
        return self._rank_op("checksum_sums", names)

    def memory_state(self) -> dict[str, str]:
        return self.ops.parts.controller.state()

    def pause(self, mode: str) -> None:
        pass

    def resume_generation(self) -> None:
        pass

    def abort(self, request_ids) -> int:
        return 0

    def num_unfinished(self) -> int:
        return 0

    def flush_cache(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass

    def cache_stats(self) -> dict:
        return {}

    def metrics(self) -> dict:
        return {"tp_rank": self.ops.tp_rank, "weight_version": self.ops.parts.updater.version,
                "memory": self.memory_state()}
