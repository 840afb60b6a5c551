"""The step loop: admit waiting requests, build a batch, run it, apply the
results. Pure Python over CPU data; the runner is the only thing that touches
the device.

Every step extends each running request: decoding ones by their last sampled
token, prefilling ones by a chunk of their prompt (bounded by
`max_prefill_tokens`), and admits waiting requests into what is left of that
budget. Prefill and decode are the same operation ("compute KV for
all_ids[kv_len:...]"), so chunked prefill and resuming a retracted request
need no special path.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from rollout_engine.plan import StepRunner
from rollout_engine.request import PLACEHOLDER, Request
from rollout_engine.scheduler.batch import Batch, ScheduledSeq
from rollout_engine.scheduler.config import SchedulerConfig
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.plan_builder import PlanIndex, SeqResult, build_plan, seq_results
from rollout_engine.scheduler.routes_keeper import RoutesKeeper, sends_routes
from rollout_engine.scheduler.stats import StepStats
from rollout_engine.scheduler.stop import StopChecker


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVManager, runner: StepRunner, stop: StopChecker,
                 on_finish: Callable[[Request], None] | None = None):
        self.cfg = cfg
        self.kv = kv
        self.runner = runner
        self.stop = stop
        self.weight_version = 0  # of the weights the next steps run with (set by whoever updates them)
        self.on_finish = on_finish  # called with each request as it finishes, however it ends
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.new_token_ratio = cfg.init_new_token_ratio
        self.num_retractions = 0
        self.num_steps = 0
        self.num_ahead_steps = 0  # decode steps scheduled while the previous one ran
        self.prompt_tokens_computed = 0  # prompt positions whose KV was computed (not cached)
        self.decode_tokens = 0
        self._pending: tuple[Batch, PlanIndex, Any] | None = None  # launched, not yet collected
        kv.table.track_writes()  # each plan carries the table writes since the previous one
        self._abort_marked = 0  # requests marked by abort() since the last step applied them
        self.stats = StepStats()
        self.routes = RoutesKeeper(kv, runner)

    # ---- requests in and out -------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    def live_requests(self) -> list[Request]:
        """Every request not finished: running, waiting, and samples not forked yet."""
        live = [*self.running, *self.waiting]
        return live + [s for r in live for s in r.fork_siblings]

    def abort(self, request_ids: list[str] | None = None) -> int:
        """Mark the named (or all) requests that exist now; they finish with
        "abort" at the start of the next step. Ids of no live request are
        ignored: an abort never reaches a request submitted after it.
        Returns the number of requests marked."""
        wanted = None if request_ids is None else set(request_ids)
        return self.abort_requests([r for r in self.live_requests() if wanted is None or r.request_id in wanted])

    def abort_requests(self, reqs: list[Request]) -> int:
        """Mark these requests (those not finished yet) to be aborted."""
        marked = 0
        for r in reqs:
            if not r.finished and not r.abort_requested:
                r.abort_requested = True
                marked += 1
        self._abort_marked += marked
        return marked

    @sends_routes
    def finish_aborted(self) -> list[Request]:
        """Apply marked aborts now, without running a batch (the step in
        flight, if any, is settled first)."""
        return self.settle() + self._apply_aborts()

    def _apply_aborts(self) -> list[Request]:
        if not self._abort_marked:
            return []
        self._abort_marked = 0
        hit = lambda r: r.abort_requested  # noqa: E731
        done = [r for r in self.running if hit(r)] + [r for r in self.waiting if hit(r)]
        for leader in (*self.running, *self.waiting):  # siblings not forked yet
            done += [r for r in leader.fork_siblings if hit(r)]
            leader.fork_siblings = [r for r in leader.fork_siblings if not hit(r)]
        self.running = [r for r in self.running if not hit(r)]
        self.waiting = deque(r for r in self.waiting if not hit(r))
        for r in done:
            # Aborted leaders hand their unforked siblings on to be aborted too.
            done += [s for s in r.fork_siblings if s not in done]
            r.fork_siblings = []
            self._finish(r, "abort")
        return done

    # ---- one step ------------------------------------------------------------
    @sends_routes
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats.on_step(time.perf_counter() - start)

    def _step(self) -> list[Request]:
        """One batch.

        Overlap: while step N runs on the device, step N+1 is scheduled and
        launched (the inputs of requests that sample in step N are the tokens
        still being sampled, taken on the device), then step N's results are
        applied. Prefill chunks and admissions are scheduled ahead as decodes
        are, so the host's work hides behind the GPU's in every kind of step.
        A request that finishes in step N computed one token too many in step
        N+1; that result is dropped."""
        finished: list[Request] = []
        if self._pending is not None and self._abort_marked:
            finished += self._collect_pending()  # aborts see settled state
        finished += self._apply_aborts()
        if self._pending is None:
            batch = self._schedule()
            if not batch.seqs:
                return finished
            self._pending = self._launch(batch)
        pending = self._pending
        ahead = self._schedule_ahead(pending[0])
        ahead_pending = self._launch(ahead, pending) if ahead is not None else None
        finished += self._collect_pending()
        if ahead is not None:
            self._pending = ahead_pending
        return finished

    def _launch(self, batch: Batch, prev: tuple[Batch, PlanIndex, Any] | None = None) -> tuple[Batch, PlanIndex, Any]:
        plan, index = build_plan(batch, self.kv.table, prev[1] if prev is not None else None,
                                 self.cfg.share_prefixes)
        self.routes.send()  # before a step that may reuse the slots they were read from
        return batch, index, self.runner.launch(plan, prev[2] if prev is not None else None)

    @sends_routes
    def settle(self) -> list[Request]:
        """Wait for the step in flight, if any, and apply it."""
        return self._collect_pending() if self._pending is not None else []

    def _collect_pending(self) -> list[Request]:
        batch, index, handle = self._pending
        self._pending = None
        results = seq_results(len(batch.seqs), index, self.runner.collect(handle))
        self._count(batch)
        finished = []
        for seq, result in zip(batch.seqs, results):
            if seq.req.finished:  # finished in the step before: a token computed ahead, dropped
                continue
            if self._apply(seq, result, batch.weight_version):
                finished.append(seq.req)
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _schedule_ahead(self, batch: Batch) -> Batch | None:
        """The next step, scheduled while `batch` runs, as `_schedule` would
        schedule it, or None where only the settled state can decide (overlap
        off, or too little free KV for the decodes: retraction and eviction
        wait for settled state).

        A request that samples in `batch` decodes the token being sampled if
        it surely goes on (no length stop) and forks nobody: it gets a
        placeholder, which `batch`'s result fills. Other running requests go
        on as settled: the next prefill chunk, or a decode of their last
        known token (a fork leader whose siblings were just made). Waiting
        requests are admitted into the rest of the prefill budget; the KV of
        requests that finish in `batch` still counts as taken, so admission
        errs on the safe side, and a slot freed in `batch` is filled one step
        later."""
        if not self.cfg.overlap:
            return None
        in_batch = {id(s.req): s for s in batch.seqs}
        max_context = self.stop.max_context
        placeholders: list[ScheduledSeq] = []  # seqs of `batch` whose token the next step reads
        decodes: list[Request] = []
        prefills: list[Request] = []
        for req in self.running:
            seq = in_batch.get(id(req))
            if seq is not None and seq.samples:
                num_out = len(req.output_ids)
                if (req.fork_siblings or num_out + 1 >= req.params.max_new_tokens
                        or len(req.prompt_ids) + num_out + 1 >= max_context):
                    continue  # may end in `batch`, or forks first: decided once settled
                placeholders.append(seq)
                decodes.append(req)
            elif req.is_prefilling:
                prefills.append(req)
            else:
                decodes.append(req)
        slots = self.kv.alloc_decode(decodes) if decodes else None
        if decodes and slots is None:
            return None
        for seq in placeholders:
            seq.fill_index = len(seq.req.output_ids)
            seq.req.output_ids.append(PLACEHOLDER)
            seq.req.pending_tokens += 1
        ahead = Batch(weight_version=self.weight_version)
        for i, req in enumerate(decodes):
            ahead.seqs.append(ScheduledSeq(req, req.kv_len, 1, slots[i: i + 1], samples=True))
            req.kv_len += 1
        self._fill_prefill_budget(ahead, prefills)
        if not ahead.seqs:
            return None
        self._decay_new_token_ratio(ahead)
        self.num_ahead_steps += 1
        return ahead

    def _schedule(self) -> Batch:
        batch = Batch(weight_version=self.weight_version)
        self._schedule_decodes(batch)
        self._fill_prefill_budget(batch, [r for r in self.running if r.is_prefilling])
        self._decay_new_token_ratio(batch)
        return batch

    def _fill_prefill_budget(self, batch: Batch, prefilling: list[Request]) -> None:
        """Chunked prefills go on first, then waiting requests are admitted
        into what is left of `max_prefill_tokens`."""
        budget = self.cfg.max_prefill_tokens
        for req in prefilling:
            budget -= self._schedule_chunk(batch, req, budget)
            if budget <= 0:
                return
        self._admit(batch, budget)

    def _decay_new_token_ratio(self, batch: Batch) -> None:
        """Each decode step lowers the share of the running requests'
        remaining tokens that admission keeps room for (a retraction resets
        it to 1)."""
        if batch.is_decode:
            self.new_token_ratio = max(self.cfg.min_new_token_ratio,
                                       self.new_token_ratio - self.cfg.new_token_ratio_decay)

    def _schedule_decodes(self, batch: Batch) -> None:
        for req in [r for r in self.running if not r.is_prefilling]:
            if req.row is None:  # retracted earlier in this loop
                continue
            slots = self.kv.alloc_extend(req, 1)
            while slots is None:
                # Out of KV: retract the newest request. Requests before `req`
                # in admission order are never victims, so nothing already in
                # this batch is taken back.
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    raise RuntimeError("a single request does not fit in the KV cache")
                self._retract(victim)
                if victim is req:
                    break
                slots = self.kv.alloc_extend(req, 1)
            if req.row is not None:
                batch.seqs.append(ScheduledSeq(req, req.kv_len, 1, slots))
                req.kv_len += 1

    def _schedule_chunk(self, batch: Batch, req: Request, budget: int) -> int:
        """Schedule up to `budget` tokens of `req`'s pending prefill."""
        num = min(req.seq_len - req.kv_len, budget)
        slots = self.kv.alloc_extend(req, num) if num > 0 else None
        if slots is None:
            return 0
        batch.seqs.append(ScheduledSeq(req, req.kv_len, num, slots))
        req.kv_len += num
        return num

    def _admit(self, batch: Batch, budget: int) -> None:
        # Admission keeps room for new_token_ratio of the running requests'
        # remaining tokens; the total is kept up to date as requests join.
        if not self.waiting:
            return
        remaining = sum(r.remaining_new_tokens for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            self.kv.admit(req)
            need = min(req.seq_len - req.kv_len, budget)
            if need > self.kv.available_tokens - int(remaining * self.new_token_ratio) and self.running:
                self.kv.release(req)  # wait for memory; nothing was computed
                return
            self.waiting.popleft()
            self.running.append(req)
            remaining += req.remaining_new_tokens
            taken = self._schedule_chunk(batch, req, budget)
            if taken == 0:  # not even the chunk fits: wait
                self.running.pop()
                self.kv.release(req)
                self.waiting.appendleft(req)
                return
            budget -= taken

    @sends_routes
    def retract_all(self) -> None:
        """Every running request gives up its KV (into the prefix cache, where
        it may be reused) and waits at the front of the queue, in order; it
        resumes from its output so far."""
        self.settle()
        for req in reversed(list(self.running)):
            self._retract(req)

    def _retract(self, req: Request) -> None:
        """Take a running request back to the front of the queue. Its computed
        KV goes to the prefix cache; its output so far is kept, and resuming
        recomputes the rest, so nothing is lost or sampled twice (the RNG is
        keyed by position)."""
        self.running.remove(req)
        self.routes.keep(req)
        self.kv.release(req)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = 1.0

    def _count(self, batch: Batch) -> None:
        self.num_steps += 1
        prompt = batch.prompt_tokens
        self.prompt_tokens_computed += prompt
        self.decode_tokens += batch.num_tokens - prompt

    # ---- results ---------------------------------------------------------------
    def _apply(self, seq: ScheduledSeq, result: SeqResult, weight_version: int) -> bool:
        req = seq.req
        if result.prompt_logprobs:
            req.prompt_logprobs.extend(result.prompt_logprobs)
        if not seq.samples:
            return False
        if seq.extend_len > 1:  # a prefill just completed: share its KV (not the next step's, in flight)
            self.kv.cache_prefix(req, seq.end)
        if req.fork_siblings:
            self._fork(req, result.fork_results, weight_version)
        return self._append(req, result, weight_version, seq.fill_index)

    def _fork(self, leader: Request, results: list[SeqResult], weight_version: int) -> None:
        """The siblings' first tokens were sampled from the leader's logits;
        they queue up front and find the prompt's KV in the prefix cache."""
        queued = []
        for sib, res in zip(leader.fork_siblings, results):
            if leader.prompt_logprobs is not None:
                sib.prompt_logprobs = list(leader.prompt_logprobs)
            if not self._append(sib, res, weight_version, kv_of=leader):
                self.routes.keep(sib, leader)
                queued.append(sib)
        leader.fork_siblings = []
        self.waiting.extendleft(reversed(queued))

    def _append(self, req: Request, result: SeqResult, weight_version: int, fill_index: int | None = None,
                kv_of: Request | None = None) -> bool:
        """Record a sampled token (into its placeholder when it was scheduled
        ahead); returns True if the request finished. `kv_of`: the request
        whose KV holds this one's tokens (a fork's leader)."""
        if req.params.max_new_tokens == 0:  # the prompt alone: the token its last position gave is not kept
            req.weight_version = weight_version
            self._finish(req, "length", kv_of)
            return True
        if fill_index is None:
            req.output_ids.append(result.token)
        else:
            req.output_ids[fill_index] = result.token
            req.pending_tokens -= 1
        req.output_weight_versions.append(weight_version)
        self.stats.on_token(req)
        if req.params.logprobs:
            req.output_logprobs.append(result.logprob)
        if req.params.top_logprobs:
            req.top_logprobs.append(result.top_logprobs)
        req.weight_version = weight_version
        reason = self.stop.check(req)
        if reason is None:
            return False
        self._finish(req, reason, kv_of)
        return True

    def _finish(self, req: Request, reason: str, kv_of: Request | None = None) -> None:
        try:
            self.routes.keep(req, kv_of)
        finally:
            req.finish_reason = reason
            self.stats.on_finish(reason)
            self.kv.release(req)
        if self.on_finish is not None:
            self.on_finish(req)

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.running)
