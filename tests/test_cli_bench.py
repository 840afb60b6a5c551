"""`rollout-engine bench` on the command line: GPU workloads refused on the
CPU, bad flags as one line, the flags a workload does not use named, the
engine flags reaching the engine."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cli_errors import one_line_error
from rollout_engine import cli
from rollout_engine.cli import main
from rollout_engine.config import EngineConfig


@pytest.fixture
def no_bench_run(monkeypatch):
    import rollout_engine.bench.run as bench_run

    def refuse(args):
        raise AssertionError("the benchmark ran")
    monkeypatch.setattr(bench_run, "main", refuse)


@pytest.mark.parametrize("workload", ["offline", "decode", "prefill", "memory"])
def test_gpu_workloads_need_cuda(workload, capsys, monkeypatch, no_bench_run):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--workload", workload]) == 2
    line = one_line_error(capsys)
    assert "--workload" in line and "CUDA GPU" in line


@pytest.mark.parametrize("flags, named", [
    (["-n", "0"], "-n"),
    (["--max-total-tokens", "0"], "--max-total-tokens"),
    (["--prompt-min", "64", "--prompt-max", "32"], "--prompt-min"),
    (["--out", "/no/such/folder/report.json"], "--out"),
    (["--model", "nope"], "--model"),
    (["--page-size", "3"], "--page-size"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--tp", "3"], "--tp-size"),  # 16 heads do not split in 3
])
def test_bad_bench_flags(flags, named, capsys, no_bench_run):
    assert main(["bench", "--workload", "grpo", *flags]) == 2
    assert named in one_line_error(capsys)


@pytest.fixture
def bench_args_seen(monkeypatch):
    import rollout_engine.bench.run as bench_run

    seen = []
    monkeypatch.setattr(bench_run, "main", lambda args: seen.append(args) or 0)
    return seen


@pytest.mark.parametrize("flags, long", [
    ([], True), (["--num-prompts", "2", "-n", "2", "--output-len", "32"], False),
    (["--workload", "longtail"], True), (["--workload", "longtail", "--scale", "0.001", "-n", "2"], False),
])
def test_bench_on_the_cpu_says_when_a_workload_will_take_hours(flags, long, capsys, monkeypatch, bench_args_seen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", *flags]) == 0 and bench_args_seen  # it still runs: the note is a note
    err = capsys.readouterr().err
    assert ("takes hours" in err or "can take hours" in err) == long, err
    if long:
        quick = err.split("for a quick look: ")[1].split()
        capsys.readouterr()
        assert main(["bench", *flags[:2], *quick]) == 0 and "hours" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, unused", [
    (["--workload", "longtail", "--scale", "0.001", "-n", "2", "--num-prompts", "16"], ["--num-prompts"]),
    (["--workload", "decode", "--output-len", "8", "--graphs-only", "--batch-sizes", "1"], ["--output-len"]),
    (["--workload", "grpo", "--scale", "0.5", "--steps", "3", "--num-prompts", "2"], ["--scale", "--steps"]),
    (["--workload", "offline", "--num-prompts", "2", "--baseline", "none"], []),  # a default given: not noted
    (["--workload", "prefill", "--num-prompts", "2", "--max-prefill-tokens", "64"], ["--max-prefill-tokens"]),
    (["--workload", "weights", "--page-size", "16", "--max-running-requests", "8", "--max-prefill-tokens", "64",
      "--bucket-mb", "64"], ["--page-size", "--max-running-requests", "--max-prefill-tokens", "--bucket-mb"]),
])
def test_bench_says_which_flags_its_workload_does_not_use(flags, unused, capsys, monkeypatch, bench_args_seen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU checks: the run is faked
    assert main(["bench", *flags]) == 0 and bench_args_seen
    notes = [line for line in capsys.readouterr().err.splitlines() if "does nothing" in line]
    assert sorted(line.split(" does nothing")[0].split()[-1] for line in notes) == sorted(unused)
    assert all(f"--workload {flags[1]}" in line for line in notes)
    from rollout_engine.bench.run import _config

    assert "bench_defaults" not in _config(bench_args_seen[0])  # the report's config says what ran


def test_bucket_size_is_noted_only_without_the_broadcast(capsys):
    from rollout_engine.bench.command import _note_unused_bench_flags

    parser = cli.build_parser()
    for flags, noted in ((["--nccl"], False), ([], True)):
        args = parser.parse_args(["bench", "--workload", "weights", "--bucket-mb", "64", *flags])
        _note_unused_bench_flags(args, args.bench_defaults)
        assert ("--bucket-mb does nothing" in capsys.readouterr().err) == noted


def test_bench_engine_flags_reach_the_engine():
    """Every engine flag `bench` offers is passed to the engines it builds."""
    from rollout_engine.bench.common import engine_kwargs

    args = cli.build_parser().parse_args(["bench", "--page-size", "16", "--max-running-requests", "64",
                                      "--cuda-graph-max-batch-size", "128", "--tp", "2", "--deterministic",
                                      "--max-prefill-tokens", "16384"])
    kw = engine_kwargs(args)
    assert (kw["page_size"], kw["max_running_requests"], kw["cuda_graph_max_batch_size"]) == (16, 64, 128)
    assert kw["max_prefill_tokens"] == 16384
    assert kw["tp_size"] == 2 and kw["deterministic"] is True
    offered = {a.dest for a in cli.build_parser()._subparsers._group_actions[0].choices["bench"]._actions}
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert offered & engine_fields <= set(kw)
