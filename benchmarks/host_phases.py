"""Where the host's time goes in the engine's step loop during a `rollout-engine
bench` run, and which steps waited on it.

Each phase of a step (scheduling the next step, building its plan, launching
it: the graph replay with its attention plan, the logits and sampling; then
collecting the step before and applying its tokens) is timed by a wrapper
around the method that does it, over the measured runs only (not the
engines' starts or warm-ups; grpo's two runs, cache off and on, together).
Per step the host's time is split from its wait for the device: a step whose
wait is under 50 us found the device idle, so the host bounded it. The
report gives each phase's mean time per step (phases nest: the scheduler's
launch holds the runner's, which holds the graph replay and sampling, so
they do not add up; `host_ms_per_step` is the whole) and counts host-bound
steps by batch size; `by_kind` splits the same by the kind of step each
loop iteration launched (mixed: one with prompt rows, run outside the CUDA
graphs; decode; none). Measures the grpo (one replica) and offline workloads,
whose runs go through the bench's timed run; the others are refused.

    python3 benchmarks/host_phases.py --out /tmp/phases.json -- \\
        --workload offline --model qwen3-0.6b --num-prompts 256 --page-size 16
    python3 benchmarks/host_phases.py --profile --out /tmp/phases.json -- --workload grpo ...

Everything after `--` goes to `rollout-engine bench`; standard output holds
the bench's report, then this one (--out writes this one alone). With
--profile (needs --out) the loop thread's steps also run under cProfile; its
tables go next to --out (`.tottime.txt`, `.cumtime.txt`). The wrappers cost
a few microseconds per call, about 2% of offline qwen3-0.6b's throughput.
On the CPU (grpo only: offline needs a GPU) the torch backend's steps never
wait for a device: every step counts as host-bound. A bench run that fails
or is interrupted leaves no report.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import pstats
import time

import numpy as np

from rollout_engine.script_args import ScriptParser, run_script

WAIT_BOUND_S = 50e-6  # a collect that waited less found its step already done: the device waited for the host
BANDS = ((0, 16), (16, 64), (64, 128), (128, 192), (192, 1 << 30))
MEASURED = ("grpo", "offline")  # the workloads whose runs go through bench.run.run_workload


class Phases:
    """Timers around the step loop's methods (class attributes, patched for
    the life of the process)."""

    def __init__(self, profile: bool):
        self.total: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.steps: list[tuple[float, float, int]] = []  # (host s, wait s, batch size collected)
        self.waits: list[float] = []
        # per kind of step launched ("mixed", "decode", "none"): [(host s, wait s)] and phase seconds
        self.kind_steps: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self.kind_total: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        self.step_total: dict[str, float] = collections.defaultdict(float)  # the step in progress, by phase
        self.step_kind = "none"  # what the step in progress launched
        self.profile = cProfile.Profile() if profile else None
        self.on = False
        self._patched: list[tuple[object, str, object]] = []  # (owner, name, original): undone by uninstall

    def _patch(self, owner, name: str, value) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


    def wrap(self, cls, name: str, label: str) -> None:
        fn = getattr(cls, name, None)
        if fn is None:
            return
        phases = self

        self._patch(cls, name, _timed_function(phases, fn, label))

    def install(self) -> None:
        from rollout_engine.runner.cuda_graph import CudaGraphRunner
        from rollout_engine.runner.model_runner import ModelRunner
        from rollout_engine.scheduler import scheduler as sched

        S = sched.Scheduler
        for name in ("_schedule", "_schedule_ahead", "_launch", "_collect_pending", "_apply"):
            self.wrap(S, name, f"scheduler.{name.lstrip('_')}")
        self._patch(sched, "build_plan", _timed_function(self, sched.build_plan, "scheduler.build_plan"))
        for name in ("launch", "_forward_eager", "_logits", "_sample"):
            self.wrap(ModelRunner, name, f"runner.{name.lstrip('_')}")
        self.wrap(CudaGraphRunner, "replay", "runner.graph_replay")
        self.wrap(CudaGraphRunner, "replay_sampled", "runner.graph_replay_sampled")
        try:
            from rollout_engine.attention.flashinfer_backend import FlashInferAttentionBackend

            self.wrap(FlashInferAttentionBackend, "prepare_replay", "attention.prepare_replay")
        except ImportError:  # flashinfer's module imports lazily; the backend module itself always imports
            pass
        self._wrap_collect(ModelRunner)
        self._wrap_launch_kind(S)
        self._wrap_step(S)

    def _wrap_launch_kind(self, cls) -> None:
        launch, phases = cls._launch, self

        @functools.wraps(launch)
        def kinded(scheduler, batch, *args, **kwargs):
            phases.step_kind = "decode" if batch.is_decode else "mixed"
            return launch(scheduler, batch, *args, **kwargs)
        self._patch(cls, "_launch", kinded)

    def _wrap_collect(self, cls) -> None:
        collect, phases = cls.collect, self

        @functools.wraps(collect)
        def timed(runner, handle):
            if not phases.on:
                return collect(runner, handle)
            start = time.perf_counter()
            if handle.event is not None:
                handle.event.synchronize()
            phases.waits.append(time.perf_counter() - start)
            return collect(runner, handle)
        self._patch(cls, "collect", timed)

    def _wrap_step(self, cls) -> None:
        step, phases = cls._step, self

        @functools.wraps(step)
        def timed(scheduler):
            if not phases.on:
                return step(scheduler)
            pending = scheduler._pending
            batch = len(pending[0].seqs) if pending is not None else 0
            waits = len(phases.waits)
            phases.step_total.clear()
            phases.step_kind = "none"
            if phases.profile is not None:
                phases.profile.enable()
            start = time.perf_counter()
            try:
                return step(scheduler)
            finally:
                elapsed = time.perf_counter() - start
                if phases.profile is not None:
                    phases.profile.disable()
                wait = phases.waits[-1] if len(phases.waits) > waits else 0.0
                phases.steps.append((elapsed - wait, wait, batch))
                phases.kind_steps[phases.step_kind].append((elapsed - wait, wait))
                for label, seconds in phases.step_total.items():
                    phases.kind_total[phases.step_kind][label] += seconds
        self._patch(cls, "_step", timed)

    def report(self) -> dict:
        steps = len(self.steps) or 1
        rows = np.array(self.steps, dtype=np.float64).reshape(-1, 3)
        order = sorted(self.total.items(), key=lambda kv: -kv[1])
        out = {"steps": len(self.steps),
               "host_ms_per_step": round(float(rows[:, 0].sum()) * 1e3 / steps, 3),
               "wait_ms_per_step": round(float(rows[:, 1].sum()) * 1e3 / steps, 3),
               "host_bound_steps": int((rows[:, 1] < WAIT_BOUND_S).sum()),
               "us_per_step": {k: round(v * 1e6 / steps, 1) for k, v in order},
               "calls": dict(self.calls), "by_batch": {}}
        for lo, hi in BANDS:
            band = rows[(rows[:, 2] >= lo) & (rows[:, 2] < hi)]
            if len(band):
                out["by_batch"][f"{lo}-{hi - 1 if hi < 1 << 30 else 'up'}"] = {
                    "steps": len(band), "host_bound": int((band[:, 1] < WAIT_BOUND_S).sum()),
                    "host_us_median": round(float(np.median(band[:, 0])) * 1e6, 1),
                    "wait_us_median": round(float(np.median(band[:, 1])) * 1e6, 1)}
        out["by_kind"] = {}
        for kind, times in sorted(self.kind_steps.items()):
            t = np.array(times, dtype=np.float64)
            per = self.kind_total[kind]
            out["by_kind"][kind] = {
                "steps": len(t), "host_bound": int((t[:, 1] < WAIT_BOUND_S).sum()),
                "host_us_mean": round(float(t[:, 0].mean()) * 1e6, 1),
                "wait_us_mean": round(float(t[:, 1].mean()) * 1e6, 1),
                "us_per_step": {k: round(v * 1e6 / len(t), 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}}
        return out


def _timed_function(phases: Phases, fn, label: str):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if not phases.on:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            phases.total[label] += seconds
            phases.step_total[label] += seconds
            phases.calls[label] += 1
    return timed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ScriptParser("host_phases.py", __doc__)
    p.add_argument("--profile", action="store_true", help="also run the loop thread's steps under cProfile")
    p.add_argument("--out", help="write the report here (JSON); with --profile, cProfile's tables beside it")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="after `--`: the arguments of `rollout-engine bench`")
    hint = "the bench arguments go after `--` (e.g. -- --workload offline --model qwen3-0.6b)"
    args, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}; {hint}")
    args = p.parse_checked(argv)
    if args.bench and args.bench[0] == "--":
        args.bench = args.bench[1:]
    if not args.bench:
        p.error(hint)
    if args.profile and not args.out:
        p.error("argument --profile: needs --out (its tables are written beside the report)")
    bench = argparse.ArgumentParser(add_help=False)
    bench.add_argument("--workload", default="grpo")
    bench.add_argument("--replicas", type=int, default=1)
    known, _ = bench.parse_known_args(args.bench)
    if known.workload not in MEASURED or known.replicas > 1:
        p.error(f"measures --workload {' or '.join(MEASURED)} on one replica (their runs go through the bench's "
                f"timed run); got --workload {known.workload}" + (f" --replicas {known.replicas}"
                                                                  if known.replicas > 1 else ""))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollout_engine.bench import run as bench_run
    from rollout_engine.cli import main as cli_main

    phases = Phases(args.profile)
    phases.install()
    run_workload = bench_run.run_workload

    def measured(engine, wl):  # the runs themselves (grpo: cache off and on), not engine starts or warm-ups
        phases.on = True
        try:
            return run_workload(engine, wl)
        finally:
            phases.on = False

    phases._patch(bench_run, "run_workload", measured)
    try:
        code = cli_main(["bench", *args.bench])
    finally:
        phases.uninstall()
    if code:  # the bench refused its arguments or was interrupted: it said so; no report
        return code
    report = {"bench": args.bench, **phases.report()}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        if phases.profile is not None:
            for key in ("tottime", "cumtime"):
                buf = io.StringIO()
                pstats.Stats(phases.profile, stream=buf).sort_stats(key).print_stats(40)
                with open(f"{args.out}.{key}.txt", "w") as f:
                    f.write(buf.getvalue())
    return code


if __name__ == "__main__":
    raise SystemExit(run_script(main))
