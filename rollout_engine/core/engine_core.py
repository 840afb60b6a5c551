"""EngineCore: the one owner of the step loop.

One thread per engine steps the scheduler. Front ends on any thread only
post commands (submit requests, abort, a control) into its inbox and wait on
their own Subscription or on the command's future. Commands run between two
steps, in the order posted, so controls never race a step and nobody takes a
lock around the scheduler. The loop blocks on its inbox while there is
nothing to step (idle or paused): an idle engine uses no CPU.

Failures: an exception from a command goes to its poster. An exception from
a step goes to every call with requests in flight; those requests are
aborted and the loop goes on. If the loop itself dies, every waiter gets the
error and later posts raise it.
"""
from __future__ import annotations

import atexit
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from rollout_engine.config import EngineConfig
from rollout_engine.model_zoo import resolve_model_path
from rollout_engine.core.build import EngineParts, build_parts, check_tp_size, engine_cuda_index
from rollout_engine.core import live
from rollout_engine.core.controls import Controls
from rollout_engine.core.worker import drop_graphs, worker_main
from rollout_engine.outputs import merge_deltas, routes_ready
from rollout_engine.distributed import tp_group
from rollout_engine.core.request_factory import RequestFactory
from rollout_engine.core.subscription import Subscription
from rollout_engine.request import Request
from rollout_engine.runner.model_loader import read_hf_config, resolve_device
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.scheduler import Scheduler

STOP_AT_EXIT_SECONDS = 10.0  # for a loop thread stepping at interpreter exit
ABANDONED_BUILD_WAIT_SECONDS = 120.0  # for one still building an engine nobody will use


@atexit.register
def _stop_live_loops() -> None:
    """At interpreter exit, stop loop threads that are still stepping (the
    device must not be torn down under a running step). A loop thread still
    building an engine whose constructor was interrupted (Ctrl-C) is waited
    for longer: killed inside torch, it would end the process with an abort."""
    try:
        for core in live.live_cores():
            core.stop(timeout=ABANDONED_BUILD_WAIT_SECONDS if core._abandoned else STOP_AT_EXIT_SECONDS)
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting, without a traceback
        pass


class _SharedResults:
    """Embedded rank 0: a call's deliver, extended so that its result (end or
    error) also goes to the other ranks, who return it from their matching
    call (streams: merged from the deltas). Every call sends exactly one."""

    def __init__(self, sub: Subscription, channel: tp_group.TPChannel):
        self.sub, self.channel, self.inner = sub, channel, sub.deliver
        self.deltas: dict[str, list] = {}
        self.sent = False

    def __call__(self, item) -> None:
        kind, value = item
        if kind == "delta":
            self.deltas.setdefault(value.request_id, []).append(value)
        elif kind == "end":
            outputs = value if value is not None else [merge_deltas(self.deltas[r.request_id]) for r in self.sub.reqs]
            self._send("end", outputs)
        elif kind == "error":
            self._send("error", value)
        self.inner(item)

    def left(self) -> None:
        """Rank 0's caller left the call: the other ranks' matching calls end too."""
        self._send("error", RuntimeError("the call was abandoned on rank 0"))

    def _send(self, kind: str, value) -> None:
        if not self.sent:
            self.sent = True
            self.channel.send(("result", kind, value))


def start_core(cfg: EngineConfig):
    """The core for this process: an EngineCore, or, on ranks 1..k-1 of a
    tensor-parallel engine embedded in a torch.distributed job, a follower."""
    if cfg.tp_size == 1 or not tp_group.in_distributed_job():
        return EngineCore(cfg)
    check_tp_size(cfg, embedded=True)
    comm, control = tp_group.embedded_group(cfg.tp_size, resolve_device(cfg.device))
    channel = tp_group.channel_of(comm, control, [], embedded=True)
    if comm.tp_rank == 0:
        return EngineCore(cfg, channel)
    from rollout_engine.core.follower import FollowerCore

    return FollowerCore(cfg, channel)


class EngineCore:
    def __init__(self, cfg: EngineConfig, channel: tp_group.TPChannel | None = None):
        """Start the loop thread; it builds the engine's parts first (so the
        thread that computes is the one that built: on the CPU, torch's
        OpenMP pool then belongs to one thread) and then serves commands.
        Raises what building raised."""
        self.paused = False
        # Tests and tools that drive the engine step by step set this: the
        # loop then steps only on `step_once()` (still on the loop thread).
        self.manual = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[int, Subscription] = {}  # id(request) -> its call's subscription
        self._streams: list[Subscription] = []
        self._finished: list[Request] = []
        self._stopping = False
        self._stop_requested = False
        self._abandoned = False
        self._dead: BaseException | None = None
        self._cuda_index = engine_cuda_index(cfg)
        self._channel = channel  # rank 0 of a tensor-parallel engine embedded in a torch.distributed job
        # The model's config is read here first, on the caller's thread: it
        # fetches a zoo model on first use and imports transformers' config
        # classes (seconds). Ctrl-C in that time is then an ordinary
        # KeyboardInterrupt, not a loop thread left building at interpreter
        # exit (which ends the process with an abort).
        read_hf_config(resolve_model_path(cfg.model, cfg.load_format))
        # A standalone TP engine's other ranks start here too: on the thread a Ctrl-C lands on, which lets
        # them start ignoring it (tp_group.start_workers); the loop thread joins them.
        self._workers = self._start_workers(cfg)
        built: Future = Future()
        try:
            self._thread = threading.Thread(target=self._run, args=(cfg, built), name="rollout-engine-loop",
                                            daemon=True)
            live.add(self)
            self._thread.start()
        except BaseException:  # the loop thread, which would have joined them, never started
            if self._workers is not None:
                self._workers.terminate()
            raise
        self.parts: EngineParts
        self.scheduler: Scheduler
        self.factory: RequestFactory
        try:
            built.result()  # the loop thread has set the three above
        except BaseException:
            self._abandoned = True  # interrupted while building: the loop ends once built
            raise
        self.controls = Controls(self, self.parts)

    # ---- posting (any thread) -------------------------------------------------
    def post(self, fn: Callable[[], Any], fut: Future | None = None) -> None:
        """Run fn() on the loop thread between two steps; with `fut`, its
        result or exception goes there (else an exception is fn's to handle)."""
        if self._dead is not None:
            raise RuntimeError("the engine's step loop has stopped") from self._dead
        self._inbox.put((fn, fut))
        if self._dead is not None:  # died meanwhile: nobody will run it
            self._fail_commands(self._dead)

    def call(self, fn: Callable[..., Any], *args) -> Any:
        """Run fn(*args) on the loop thread between two steps and return its
        result (or raise its exception) here."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut: Future = Future()
        self.post(lambda: fn(*args), fut)
        return fut.result()

    def submit(self, token_lists: list[list[int]], params: list[SamplingParams],
               request_ids: Sequence[str] | None, sub: Subscription) -> None:
        """Queue requests (inputs already validated); results go to `sub`.
        A refusal (paused, weights missing, an id in use) is delivered to
        `sub` as an error."""
        if self._channel is not None:
            sub.deliver = _SharedResults(sub, self._channel)
        self.post(lambda: self._submit(token_lists, params, request_ids, sub))

    def abort_call(self, sub: Subscription) -> None:
        """Abort what is left of a call whose caller stopped waiting; its KV
        goes back at once (no batch runs, so a paused engine stays paused)."""
        def run() -> None:
            if isinstance(sub.deliver, _SharedResults):  # embedded rank 0: every call gets a result on every rank
                sub.deliver.left()
            sub.done = True  # the caller is gone: nothing more to deliver
            self.abort_now(sub.reqs)

        if self._dead is None and not self._stopping:
            self.post(run)

    def set_manual(self, manual: bool) -> None:
        """Manual stepping (tests and tools that drive the engine step by
        step): the loop steps only on `step_once()`, still on its thread."""
        self.manual = manual
        self.post(lambda: None)  # wake the loop to look again

    def add_requests(self, prompts, input_ids, sampling_params, request_ids=None) -> list[Request]:
        """Validate and queue requests whose results nobody waits for; returns
        the live Requests, for tests and tools that watch them."""
        token_lists, params = self.factory.validate(prompts, input_ids, sampling_params)
        errors: list[BaseException] = []
        sub = Subscription(lambda item: errors.append(item[1]) if item[0] == "error" else None)
        self.submit(token_lists, params, request_ids, sub)
        self.call(lambda: None)  # the submission has been applied
        if errors:
            raise errors[0]
        return sub.reqs

    def step_once(self) -> list[Request]:
        """One scheduler step on the loop thread (with `manual` set)."""
        def run() -> list[Request]:
            finished = self.scheduler.step()
            self.dispatch()
            return finished

        return self.call(run)

    def stop(self, timeout: float | None = None) -> None:
        """Abort every request, let the loop finish and join it."""
        self._stop_requested = True
        if self._dead is None and self._thread.is_alive() and not self._stopping:
            def run() -> None:
                self.abort_now()
                self._stopping = True
                if self.parts.channel is not None:  # the other ranks exit
                    drop_graphs(self.parts)
                    self.parts.channel.close()

            self.post(run)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def join_if_stopping(self, timeout: float) -> None:
        """Wait for this loop if it was asked to stop (a dropped engine's
        finalizer asks without waiting), from any other thread."""
        if self._stop_requested and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- on the loop thread ---------------------------------------------------
    def _submit(self, token_lists, params, request_ids, sub: Subscription) -> None:
        try:
            if self.paused:
                raise RuntimeError("generation is paused: call continue_generation() first")
            self.parts.controller.check_can_generate()
            taken = {r.request_id for r in self.scheduler.live_requests()}
            groups = self.factory.create(token_lists, params, request_ids, taken)
        except Exception as e:  # noqa: BLE001 - the caller's error
            sub.fail(e)
            return
        sub.attach([r for group in groups for r in group])
        for r in sub.reqs:
            self._subs[id(r)] = sub
        if sub.stream:
            self._streams.append(sub)
        for group in groups:
            if self.parts.prefix_cache.enabled:
                # The prompt is prefilled once; samples 1..n-1 fork from it.
                group[0].fork_siblings = group[1:]
                self.scheduler.add(group[0])
            else:
                for r in group:
                    self.scheduler.add(r)

    def _run(self, cfg: EngineConfig, built: Future) -> None:
        try:
            if self._cuda_index is not None:  # streams, events and graphs of the engine's device
                torch.cuda.set_device(self._cuda_index)
            try:
                parts = self._build(cfg)
            except BaseException as e:  # noqa: BLE001 - raised in the constructor
                built.set_exception(e)
                return
            self.parts, self.scheduler = parts, parts.scheduler
            self.factory = RequestFactory(parts.tokenizer, parts.limits, cfg.seed)
            self.scheduler.on_finish = self._finished.append
            built.set_result(parts)
            if self._abandoned:
                return
            while not self._stopping:
                idle = self.paused or self.manual or not self.scheduler.has_work()
                cmd = self._inbox.get() if idle else self._next_command()
                commanded = cmd is not None
                while cmd is not None:
                    self._execute(*cmd)
                    if self._stopping:
                        return
                    cmd = self._next_command()
                if commanded and (self._finished or self._streams):  # a command that settled a step may
                    self.dispatch()  # have finished requests: no later dispatch would hand them out
                if not (self.paused or self.manual) and self.scheduler.has_work():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - reported to every waiter
            self._dead = e
            for sub in set(self._subs.values()):
                sub.fail(e)
            self._fail_commands(e)
        finally:
            if self._dead is None:  # stopped: later posts are refused, and any left get an error
                self._dead = RuntimeError("the engine's step loop was stopped")
                self._fail_commands(self._dead)
            live.discard(self)

    @staticmethod
    def _execute(fn: Callable[[], Any], fut: Future | None) -> None:
        if fut is None:
            fn()
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - the poster's, even an interrupt raised in its generator
            fut.set_exception(e)

    def _start_workers(self, cfg: EngineConfig) -> tp_group.Started | None:
        """A standalone TP engine's ranks 1..k-1, started (after the checks
        that need no other rank); None for one rank or an embedded engine."""
        if cfg.tp_size == 1 or self._channel is not None:
            return None
        check_tp_size(cfg)
        device = resolve_device(cfg.device)
        if self._cuda_index is not None:
            device = torch.device("cuda", self._cuda_index)
        return tp_group.start_workers(cfg, device, worker_main)

    def _build(self, cfg: EngineConfig) -> EngineParts:
        """This rank's parts; with tp_size > 1, after joining the other ranks."""
        if cfg.tp_size == 1:
            return build_parts(cfg)
        if self._channel is not None:
            return build_parts(cfg, self._channel.comm, self._channel)
        channel = tp_group.join_workers(self._workers)
        try:
            return build_parts(cfg, channel.comm, channel)
        except BaseException:
            channel.close(timeout=5)
            raise

    def _next_command(self) -> tuple[Callable[[], Any], Future | None] | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _fail_commands(self, error: BaseException) -> None:
        """Commands left when the loop died: their posters get the error."""
        while (cmd := self._next_command()) is not None:
            if cmd[1] is not None and not cmd[1].done():
                cmd[1].set_exception(RuntimeError(f"the engine's step loop has stopped: {error!r}"))

    def _step(self) -> None:
        try:
            self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - goes to the calls it hit
            for sub in set(self._subs.values()):
                sub.fail(e)
            self.abort_now()
            return
        self.dispatch()

    def abort_now(self, reqs: list[Request] | None = None) -> None:
        """Finish `reqs` (default: every live request) with "abort" now,
        without running a batch, and hand the results out. Loop thread."""
        if reqs is None:
            self.scheduler.abort()
        else:
            self.scheduler.abort_requests(reqs)
        self.scheduler.finish_aborted()
        self.dispatch()

    def dispatch(self) -> None:
        """Hand finished requests and stream deltas to their calls."""
        stop = self.scheduler.stop
        # A finished request's routing (return_routed_experts) is copied to the host behind the steps in
        # flight: while more steps run, it is handed out at a later dispatch, once there; with no step
        # to run next (idle, paused, stepped by hand), now (waiting for it holds up no step).
        wait = self.paused or self.manual or not self.scheduler.has_work()
        finished, self._finished[:] = list(self._finished), []
        for r in finished:
            if not (wait or routes_ready(r)):
                self._finished.append(r)
                continue
            sub = self._subs.pop(id(r), None)
            if sub is not None:
                sub.on_finish(r, stop)
        if self._streams:
            for sub in self._streams:
                if not sub.done:
                    sub.poll(stop, wait)
            self._streams = [s for s in self._streams if not s.done]
