"""Alternated A/B runs of module switches in one device call: A then B,
`--pairs` times, each run `ab_switch.py <its settings> <program> --out
<out-dir>/<name>-<a|b>-<i>.json` in a process of its own (its output in the
.log beside it), under `--timeout`; with `--budget`, no run starts that the
rest of the budget cannot hold (as long as the longest run so far). Then
each headline figure the reports share (ms per decode step and x the floor,
tokens/s and share of the roofline, the MoE layer's us and share of its
limit) is printed for every run with the ratio of B's mean to A's, and the
whole is written to <out-dir>/<name>.json.

    python3 benchmarks/ab_pairs.py --name moe-bs1 --out-dir $OUT \\
        --a rollout_engine.kernels.gemv.PRELOAD_BLOCKS=4 rollout_engine.kernels.moe.EARLY_DOWN=1 \\
        --b rollout_engine.kernels.gemv.PRELOAD_BLOCKS=1 rollout_engine.kernels.moe.EARLY_DOWN=0 \\
        -- rollout-engine bench --workload decode --model qwen3-30b-a3b --batch-sizes 1 --graphs-only

The program is rollout-engine or a script of this folder that writes its
report to --out (moe_kernel.py, batch_gemm_configs.py, ...). Settings are
checked (module, name, type) before the first run; a run refused its input
(exit 2) stops the rest. Exit status 0 when every run ended well with its
report, 1 otherwise (a run failed, timed out, wrote no report or was
skipped), 130 on Ctrl-C, after writing the summary of the runs that had
started."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from ab_switch import parse_setting
from rollout_engine.script_args import ScriptParser, UsageError, positive_float, positive_int, run_script

HERE = os.path.dirname(os.path.abspath(__file__))
HEADLINE = ("mean_step_ms", "x_floor", "output_tok_per_s", "pct_of_roofline", "moe_us", "experts_us", "share")
LABELS = ("tokens", "shape", "name", "model")  # what names an element of a list in a report


def run_one(cmd: list[str], log: str, timeout: float) -> tuple[int | None, float]:
    """Run cmd in a session of its own, its output to `log`; (exit status,
    or None where it ran past `timeout` and its process group was killed;
    seconds)."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        except BaseException:  # Ctrl-C: the run goes too
            _kill(proc)
            raise
        if rc is None:
            _kill(proc)
    return rc, time.monotonic() - start


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.rstrip() for line in f if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def figures(report: object, path: str = "") -> dict[str, float]:
    """The headline figures of a report, by where they are in it."""
    out: dict[str, float] = {}
    if isinstance(report, dict):
        for key, value in report.items():
            where = f"{path}.{key}" if path else str(key)
            if key in HEADLINE and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[where] = float(value)
            else:
                out.update(figures(value, where))
    elif isinstance(report, list):
        for i, value in enumerate(report):
            label = next((f"{k}={value[k]}" for k in LABELS if isinstance(value, dict) and k in value), str(i))
            out.update(figures(value, f"{path}[{label}]"))
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """Per headline figure every finished run of each side reports: the
    values in run order and B's mean over A's."""
    done = [r for r in runs if r.get("figures")]
    names = sorted(set().union(*(r["figures"] for r in done))) if done else []
    rows = []
    for name in names:
        a = [r["figures"][name] for r in done if r["side"] == "a" and name in r["figures"]]
        b = [r["figures"][name] for r in done if r["side"] == "b" and name in r["figures"]]
        ratio = (sum(b) / len(b)) / (sum(a) / len(a)) if a and b and sum(a) else None
        rows.append({"figure": name, "a": a, "b": b, "b_over_a": round(ratio, 4) if ratio is not None else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("ab_pairs.py", __doc__)
    p.usage = ("ab_pairs.py [-h] --name NAME --out-dir DIR --a module.NAME=value ... --b module.NAME=value ... "
               "[--pairs N] [--timeout S] [--budget S] -- PROGRAM [ARGS ...]")
    p.add_argument("--name", required=True, help="the runs' file names start with it")
    p.add_argument("--out-dir", required=True, help="an existing folder for the reports, logs and summary")
    p.add_argument("--a", nargs="+", action="extend", required=True, metavar="module.NAME=value",
                   help="side A's settings (a repeated --a adds to them)")
    p.add_argument("--b", nargs="+", action="extend", required=True, metavar="module.NAME=value",
                   help="side B's settings (likewise)")
    p.add_argument("--pairs", type=positive_int, default=2, help="A then B, this many times")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds one run may take")
    p.add_argument("--budget", type=positive_float, help="seconds all the runs may take")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:  # the options' own errors (unknown, missing) first: they say more
        p.parse_args(argv)
        p.error("argument --: expected '--' and the program after the options")
    cut = argv.index("--")
    args = p.parse_args(argv[:cut])
    program = argv[cut + 1:]
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.name):
        p.error(f"argument --name: letters, digits, '.', '_' and '-' only, not {args.name!r}")
    if not os.path.isdir(args.out_dir):
        p.error(f"argument --out-dir: {args.out_dir!r} is not a folder")
    if not program:
        p.error("argument --: expected rollout-engine or a script of benchmarks/ after it")
    script = program[0].removeprefix("benchmarks/")
    if script != "rollout-engine" and not (script.endswith(".py") and os.path.exists(os.path.join(HERE, script))):
        p.error(f"argument --: {program[0]!r} is neither rollout-engine nor a script of benchmarks/")
    if any(a == "--out" or a.startswith("--out=") for a in program):
        p.error("argument --: the program's --out is each run's own report; leave it out")
    for flag, settings in (("--a", args.a), ("--b", args.b)):
        for text in settings:
            try:
                parse_setting(text)
            except UsageError as e:
                p.error(f"argument {flag}: {e}")

    runs: list[dict] = []
    try:
        _alternate(args, script, program, runs)
    except KeyboardInterrupt:  # what finished is kept
        if runs and "status" not in runs[-1]:
            runs[-1]["status"] = "interrupted"
        _write_summary(args, program, runs)
        print(f"ab_pairs: the runs that finished: {os.path.join(args.out_dir, args.name)}.json", file=sys.stderr)
        raise
    rows = _write_summary(args, program, runs)
    for row in rows:
        ratio = f"{row['b_over_a']:.4f}" if row["b_over_a"] is not None else "-"
        print(f"{args.name} {row['figure']}: A {row['a']} B {row['b']} B/A {ratio}")
    print(f"ab_pairs: summary {os.path.join(args.out_dir, args.name)}.json", file=sys.stderr)
    return 0 if all(r.get("status") == "exit 0" for r in runs) else 1


def _alternate(args, script: str, program: list[str], runs: list[dict]) -> None:
    """The runs, A then B, pair after pair, each appended to `runs` as it starts."""
    spent, longest, refused = 0.0, 0.0, False
    for i in range(1, args.pairs + 1):
        for side, settings in (("a", args.a), ("b", args.b)):
            stem = os.path.join(args.out_dir, f"{args.name}-{side}-{i}")
            run = {"side": side, "pair": i, "report": stem + ".json"}
            runs.append(run)
            if refused or (args.budget is not None and spent + longest > args.budget):
                run["status"] = "skipped: " + ("a run before was refused its input" if refused else "over --budget")
                print(f"ab_pairs: {args.name} {side}{i} {run['status']}", file=sys.stderr, flush=True)
                continue
            cmd = [sys.executable, os.path.join(HERE, "ab_switch.py"), *settings, script, *program[1:],
                   "--out", stem + ".json"]
            if os.path.exists(stem + ".json"):  # a report of an earlier call is not this run's
                os.remove(stem + ".json")
            rc, seconds = run_one(cmd, stem + ".log", args.timeout)
            spent, longest = spent + seconds, max(longest, seconds)
            run["seconds"] = round(seconds, 1)
            run["status"] = "timed out" if rc is None else f"exit {rc}"
            if rc == 0 and not os.path.exists(stem + ".json"):
                run["status"] = "exit 0 without a report"
            elif rc == 0:
                with open(stem + ".json") as f:
                    run["figures"] = figures(json.load(f))
            print(f"ab_pairs: {args.name} {side}{i} {run['status']} in {seconds:.0f} s", file=sys.stderr, flush=True)
            if rc is None:
                print(f"  past --timeout {args.timeout:g} s: killed (its output: {stem}.log)", file=sys.stderr)
            elif run["status"] != "exit 0":
                print(f"  {_last_line(stem + '.log')}", file=sys.stderr, flush=True)
            refused = rc == 2  # a usage error: every later run would get the same


def _write_summary(args, program: list[str], runs: list[dict]) -> list[dict]:
    rows = summarize(runs)
    summary = {"name": args.name, "a": args.a, "b": args.b, "program": program, "runs": runs, "figures": rows}
    with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return rows


if __name__ == "__main__":
    raise SystemExit(run_script(main))
