"""The GPU tests on every GPU of the machine at once: the single-GPU tests
(`-m "gpu and not multigpu"`) split by file into one shard per GPU, each
shard a pytest of its own on its GPU (CUDA_VISIBLE_DEVICES), then, with two
GPUs or more, the multi-GPU tests (`-m multigpu`) over all of them. Files
are dealt to shards by their expected seconds (SECONDS, measured on H200s;
unlisted files count SECONDS_PER_TEST a test), longest first. Each pytest is
bounded by --timeout; logs and JUnit reports go to --out. `--part K/N`
runs the K-th of N parts of the single-GPU files (dealt the same way), the
multi-GPU tests with the last part only, its logs named partK-...: for
calls shorter than the suite.

    python tests/gpu_suite.py --out /tmp/gpu-suite            # every GPU
    python tests/gpu_suite.py --gpus 2 -- -x -k "not differential"   # extra pytest arguments after --
    python tests/gpu_suite.py -- tests/test_gpu_moe.py tests/test_gpu_fp8.py   # only these files
    python tests/gpu_suite.py --part 1/3                      # a third of the files, then 2/3 and 3/3

Exit status: 0 when every pytest passed, 1 otherwise (each one's last line
is printed), 2 for bad arguments or no GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SINGLE = "gpu and not multigpu"
# Seconds per file on an H200 (JUnit times of a whole-suite run on four H200s, 2026-11-28, the real weights
# converted on the machine), for dealing files to shards. On a fresh machine (Triton's cache empty) the files
# with many kernels take about 1.3x these; the multi-GPU tests wait 4-5 minutes more for the fused
# all-reduce kernels' first build (tests/conftest.py).
SECONDS = {"test_gpu_moe.py": 205, "test_gpu_fp8_kv_cache.py": 200, "test_gpu_deterministic.py": 135,
           "test_gpu_fp8.py": 130, "test_gpu_differential.py": 120, "test_gpu_moe_kernels.py": 110,
           "test_one_seq_attention.py": 90, "test_gpu_memory.py": 75, "test_gpu_parity.py": 50,
           "test_gpu_fp8_row.py": 35, "test_gpu_kernels.py": 30, "test_gpu_weight_lifecycle.py": 30,
           "test_gpu_fast_path.py": 25, "test_inflight_update.py": 15, "test_gpu_batch_gemm.py": 10,
           "test_prompt_graphs.py": 35}
SECONDS_PER_TEST = 5


def deal(files: dict[str, int], shards: int) -> list[list[str]]:
    """Files (name -> number of tests) into `shards` lists of about equal
    expected time: longest first, each to the shard with the least so far."""
    cost = {f: SECONDS.get(os.path.basename(f), SECONDS_PER_TEST * n) for f, n in files.items()}
    out: list[list[str]] = [[] for _ in range(shards)]
    load = [0] * shards
    for f in sorted(cost, key=lambda f: (-cost[f], f)):
        i = load.index(min(load))
        out[i].append(f)
        load[i] += cost[f]
    return out


def collect(marker: str, extra: list[str]) -> dict[str, int]:
    """Test files with tests of `marker`, and how many each has."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                          marker, *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
    files: dict[str, int] = {}
    for line in res.stdout.splitlines():
        if "::" in line:
            name = line.split("::")[0]
            files[name] = files.get(name, 0) + 1
    return files


def run(args, shards: list[list[str]]) -> list[tuple[str, int, str]]:
    """Phase 1 (one pytest per shard, on its GPU, at once), then phase 2
    (the multi-GPU tests on all): (name, exit status, last line) each.
    Every pytest runs in a process group of its own, killed on Ctrl-C."""
    phases = [[(f"{args.tag}gpu{i}", dict(os.environ, CUDA_VISIBLE_DEVICES=str(i)),
                ["-m", SINGLE, *narrowed(files, args.paths)]) for i, files in enumerate(shards) if files]]
    if args.gpus >= 2 and args.multigpu and (not args.paths or collect("multigpu", args.paths)):
        phases.append([(f"{args.tag}multigpu", dict(os.environ), ["-m", "multigpu", *args.paths])])
    results = []
    for phase in phases:
        running = [(name, _start(args, env, name, select)) for name, env, select in phase]
        deadline = time.monotonic() + args.timeout
        try:
            for name, proc in running:
                results.append(_finish(args, name, proc, deadline))
        finally:
            for _, proc in running:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    return results


def _start(args, env, name: str, select: list[str]) -> subprocess.Popen:
    report = os.path.join(args.out, name + ".xml")
    if os.path.exists(report):  # an earlier run's: a pytest killed by its timeout writes none to replace it
        os.remove(report)
    with open(os.path.join(args.out, f"{name}.log"), "w") as log:
        # -v: a line per test as it ends, so a pytest killed by the timeout still shows what failed
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "--durations=10",
               f"--junitxml={report}", *select, *args.pytest_args]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(args, name: str, proc: subprocess.Popen, deadline: float) -> tuple[str, int, str]:
    try:
        rc = proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc = 124
    with open(os.path.join(args.out, f"{name}.log")) as f:
        lines = [line.strip() for line in f if line.strip()]
    return name, rc, (lines[-1] if lines else "") + (" (timed out)" if rc == 124 else "")


# pytest flags that take no value: a path may follow them
FLAGS = {"-x", "-v", "-vv", "-q", "-s", "-l", "--lf", "--ff", "--exitfirst", "--verbose", "--quiet"}


def paths_apart(pytest_args: list[str]) -> tuple[list[str], list[str]]:
    """The test paths among the extra pytest arguments (an existing file or
    folder, or a node id in one, not an option's value), and the rest. The
    paths narrow which files are dealt: each shard gets its own files and
    the rest of the arguments, not every path again."""
    paths, rest = [], []
    for i, a in enumerate(pytest_args):
        prev = pytest_args[i - 1] if i else ""
        free = not prev.startswith("-") or prev in FLAGS or "=" in prev
        is_path = free and not a.startswith("-") and os.path.exists(os.path.join(ROOT, a.split("::")[0]))
        (paths if is_path else rest).append(a)
    return paths, rest


def narrowed(files: list[str], paths: list[str]) -> list[str]:
    """A shard's files, each as the node ids named in it among `paths`
    (tests/test_x.py::test_a), or whole where none is."""
    out = []
    for f in files:
        ids = [p for p in paths if "::" in p and os.path.normpath(p.split("::")[0]) == os.path.normpath(f)]
        out.extend(ids or [f])
    return out


def file_seconds(reports: list[str]) -> dict[str, float]:
    """Seconds per test file (its base name) summed over the JUnit reports
    that exist (a pytest killed by its timeout writes none)."""
    import xml.etree.ElementTree as ET

    out: dict[str, float] = {}
    for report in reports:
        if not os.path.exists(report):
            continue
        for case in ET.parse(report).getroot().iter("testcase"):
            # classname: tests.test_x, or tests.test_x.TestSomething: the module is the part named test_*
            module = next((part for part in case.get("classname", "").split(".") if part.startswith("test_")), "?")
            key = os.path.basename(case.get("file") or module + ".py")
            out[key] = out.get(key, 0.0) + float(case.get("time") or 0)
    return out


def part_of(text: str) -> tuple[int, int]:
    """--part's value: 'K/N' with 1 <= K <= N."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"must be K/N with 1 <= K <= N, such as 1/3, got {text!r}")
    return int(k), int(n)


def main(argv: list[str] | None = None) -> int:
    from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int

    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = ScriptParser("gpu_suite.py", __doc__)
    p.add_argument("--gpus", type=positive_int, help="GPUs to use (default: every one torch sees)")
    p.add_argument("--out", default="gpu-suite", help="folder for the logs and JUnit reports")
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds each pytest may run")
    p.add_argument("--part", default="1/1", metavar="K/N",
                   help="the K-th of N parts of the single-GPU files; the multi-GPU tests with K = N")
    p.usage = p.format_usage().removeprefix("usage: ").strip() + " [-- PYTEST_ARGS_OR_TEST_FILES ...]"
    args = p.parse_args(argv[:split])
    try:
        k, n = part_of(args.part)
    except ValueError as e:
        p.error(f"argument --part: {e}")
    args.paths, args.pytest_args = paths_apart(argv[split + 1:])
    import torch

    needs_cuda(p, "it runs the GPU tests")
    args.gpus = args.gpus or torch.cuda.device_count()
    if args.gpus > torch.cuda.device_count():
        p.error(f"argument --gpus: {args.gpus}, but torch sees {torch.cuda.device_count()} GPUs")
    os.makedirs(args.out, exist_ok=True)
    files = collect(SINGLE, [*args.paths, *args.pytest_args])
    mine = deal(files, n)[k - 1]
    args.multigpu, args.tag = k == n, (f"part{k}-" if n > 1 else "")  # each part's logs apart
    if not mine:
        print(f"part {k}/{n}: no single-GPU files (there are {len(files)})", flush=True)
    shards = deal({f: files[f] for f in mine}, args.gpus)
    for i, files in enumerate(shards):
        print(f"gpu{i}: {' '.join(os.path.basename(f) for f in files)}", flush=True)
    results = run(args, shards)
    for name, rc, last in results:
        print(f"{name}: exit {rc}: {last}")
    seconds = file_seconds([os.path.join(args.out, f"{name}.xml") for name, _, _ in results])
    if seconds:  # for SECONDS above
        print("seconds per file: " + ", ".join(f"{f} {s:.0f}" for f, s in sorted(seconds.items(), key=lambda x: -x[1])))
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    from rollout_engine.script_args import run_script

    raise SystemExit(run_script(main))
