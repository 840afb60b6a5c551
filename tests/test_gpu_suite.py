"""tests/gpu_suite.py, the GPU tests over every GPU at once: how files are
dealt to shards, its refusals on a machine without GPUs, and a shard's run
(on the CPU, with a marker that selects CPU tests)."""
from __future__ import annotations

import argparse

import pytest

import gpu_suite


def test_files_are_dealt_longest_first_to_the_least_loaded_shard(monkeypatch):
    monkeypatch.setattr(gpu_suite, "SECONDS", {"test_gpu_differential.py": 420, "test_gpu_moe.py": 240,
                                               "test_gpu_fp8.py": 200, "test_gpu_kernels.py": 60})
    files = {"tests/test_gpu_differential.py": 7, "tests/test_gpu_moe.py": 18, "tests/test_gpu_kernels.py": 59,
             "tests/test_new.py": 3, "tests/test_gpu_fp8.py": 38}  # test_new.py: 3 tests x SECONDS_PER_TEST
    two = gpu_suite.deal(files, 2)
    assert two == [["tests/test_gpu_differential.py", "tests/test_gpu_kernels.py"],
                   ["tests/test_gpu_moe.py", "tests/test_gpu_fp8.py", "tests/test_new.py"]]
    assert sorted(sum(gpu_suite.deal(files, 3), [])) == sorted(files)  # every file once
    assert gpu_suite.deal(files, 8)[5:] == [[], [], []]


def test_a_part_is_one_of_n_dealt_the_same_way():
    assert gpu_suite.part_of("2/3") == (2, 3) and gpu_suite.part_of("1/1") == (1, 1)
    for bad in ("0/3", "4/3", "3", "a/b", "/", "-1/2"):
        with pytest.raises(ValueError, match="K/N"):
            gpu_suite.part_of(bad)


def test_paths_narrow_the_files_and_are_not_given_to_every_shard():
    paths, rest = gpu_suite.paths_apart(["tests/test_gpu_moe.py", "-x", "tests/test_gpu_fp8.py::test_a", "-k",
                                         "tests", "--ignore", "tests/test_docs.py", "--durations=3", "tests"])
    assert paths == ["tests/test_gpu_moe.py", "tests/test_gpu_fp8.py::test_a", "tests"]
    assert rest == ["-x", "-k", "tests", "--ignore", "tests/test_docs.py", "--durations=3"]  # option values stay
    # a shard runs the node ids named in its files, and its other files whole
    assert gpu_suite.narrowed(["tests/test_gpu_fp8.py", "tests/test_gpu_moe.py"], paths) == \
        ["tests/test_gpu_fp8.py::test_a", "tests/test_gpu_moe.py"]


def test_seconds_per_file_are_summed_from_the_junit_reports(tmp_path):
    (tmp_path / "gpu0.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu_moe" name="a" time="1.5"/>'
        '<testcase classname="tests.test_gpu_moe.TestRows" name="b" time="2.0"/>'
        '<testcase classname="tests.test_docs" name="c" time="0.25"/></testsuite></testsuites>')
    seconds = gpu_suite.file_seconds([str(tmp_path / "gpu0.xml"), str(tmp_path / "killed.xml")])
    assert seconds == {"test_gpu_moe.py": 3.5, "test_docs.py": 0.25}


@pytest.mark.parametrize("argv,words", [([], "needs a CUDA GPU"), (["--gpus", "0"], "argument --gpus"),
                                        (["--timeout", "x"], "argument --timeout"),
                                        (["--part", "4/3"], "argument --part")])
def test_refusals_are_one_line(argv, words, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        gpu_suite.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and words in err and "\n" not in err, err


@pytest.mark.slow  # two pytest subprocesses, one of them waited out
def test_a_shard_runs_its_files_and_one_past_its_time_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "SINGLE", "not gpu")  # CPU tests stand in for a GPU shard
    args = argparse.Namespace(out=str(tmp_path), timeout=300, gpus=1, multigpu=True, tag="", paths=[],
                              pytest_args=["-k", "ticking"])
    [(name, rc, last)] = gpu_suite.run(args, [["tests/test_progress.py"]])
    assert (name, rc) == ("gpu0", 0) and "passed" in last
    assert (tmp_path / "gpu0.xml").exists() and "passed" in (tmp_path / "gpu0.log").read_text()
    assert list(gpu_suite.file_seconds([str(tmp_path / "gpu0.xml")])) == ["test_progress.py"]
    args.tag = "part2-"  # --part 2/N: its own logs beside the other parts'
    [(name, rc, last)] = gpu_suite.run(args, [["tests/test_progress.py"]])
    assert (name, rc) == ("part2-gpu0", 0)
    assert (tmp_path / "part2-gpu0.log").exists() and (tmp_path / "gpu0.log").exists()
    args.tag = ""
    args.timeout, args.pytest_args = 1, []
    [(name, rc, last)] = gpu_suite.run(args, [["tests/test_logs.py"]])  # builds an engine: more than a second
    assert rc == 124 and last.endswith("(timed out)")
    assert not (tmp_path / "gpu0.xml").exists()  # the first run's report is not taken for this one's
