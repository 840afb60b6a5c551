"""benchmarks/ab_pairs.py: whole A/Bs of module switches in one device call,
the sides alternated, each run in a process of its own under a timeout,
within a budget, stopped by a refusal or Ctrl-C with what finished kept.
(Its refusals of bad flags: test_benchmark_scripts.py.)"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from test_benchmark_scripts import _benchmark

_TMA = "rollout_engine.kernels.moe.TMA_WEIGHTS="


def test_ab_pairs_alternates_the_sides_within_its_budget_and_divides_b_by_a(tmp_path, capsys, monkeypatch):
    """A then B, pair after pair, each with its own settings and report;
    the headline figures of the reports named by where they are (a list's
    elements by their token counts), B's mean over A's; no run started past
    the budget."""
    ab_pairs = _benchmark("ab_pairs")
    calls = []

    def run_one(cmd, log, timeout):
        side = "a" if cmd[2].endswith("=1") else "b"
        calls.append((side, os.path.basename(cmd[-1]), timeout))
        step = 2.0 if side == "a" else 3.0 + len(calls)  # B's two runs: 5.0 and 7.0
        report = {"results": {"bs1": {"mean_step_ms": step, "steps": 9}},
                  "shapes": [{"rows": [{"tokens": 8, "moe_us": 10.0, "limit_us": 4.0}]}]}
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump(report, f)
        open(log, "w").close()
        return 0, 40.0

    monkeypatch.setattr(ab_pairs, "run_one", run_one)
    argv = ["--name", "t", "--out-dir", str(tmp_path), "--a", _TMA + "1", "--b", _TMA + "0", "--timeout", "90",
            "--", "moe_kernel.py", "--tokens", "8"]
    assert ab_pairs.main(argv) == 0
    assert calls == [("a", "t-a-1.json", 90), ("b", "t-b-1.json", 90), ("a", "t-a-2.json", 90),
                     ("b", "t-b-2.json", 90)]
    summary = json.loads((tmp_path / "t.json").read_text())
    rows = {r["figure"]: r for r in summary["figures"]}
    assert set(rows) == {"results.bs1.mean_step_ms", "shapes[0].rows[tokens=8].moe_us"}
    assert rows["results.bs1.mean_step_ms"]["a"] == [2.0, 2.0] and rows["results.bs1.mean_step_ms"]["b"] == [5.0, 7.0]
    assert rows["results.bs1.mean_step_ms"]["b_over_a"] == 3.0
    assert rows["shapes[0].rows[tokens=8].moe_us"]["b_over_a"] == 1.0
    assert "t results.bs1.mean_step_ms: A [2.0, 2.0] B [5.0, 7.0] B/A 3.0000" in capsys.readouterr().out

    calls.clear()  # a budget of 100 s holds two runs of 40 s: the third would end past it
    assert ab_pairs.main(argv[:-4] + ["--budget", "100"] + argv[-4:]) == 1
    assert [c[1] for c in calls] == ["t-a-1.json", "t-b-1.json"]
    summary = json.loads((tmp_path / "t.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["exit 0", "exit 0"] + ["skipped: over --budget"] * 2


def test_ab_pairs_stops_at_a_refusal_and_kills_a_run_past_its_timeout(tmp_path, capsys, monkeypatch):
    import time

    ab_pairs = _benchmark("ab_pairs")
    start = time.monotonic()
    rc, seconds = ab_pairs.run_one([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "l"), 1.0)
    assert rc is None and seconds < 30 and time.monotonic() - start < 30
    # a real run refused by the script it starts (no GPU here): the rest are not started
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--name", "r", "--out-dir", str(tmp_path), "--a", _TMA + "1", "--b", _TMA + "0", "--",
            "moe_kernel.py", "--tokens", "8"]
    assert ab_pairs.main(argv) == 1
    err = capsys.readouterr().err
    assert "moe_kernel.py: error: needs a CUDA GPU" in err and err.count("skipped: a run before was refused") == 3
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert runs[0]["status"] == "exit 2" and (tmp_path / "r-a-1.log").exists() and not (tmp_path / "r-b-1.log").exists()
    # Ctrl-C during the second run: the summary keeps the first
    calls = []

    def run_one(cmd, log, timeout):
        calls.append(cmd)
        if len(calls) == 2:
            raise KeyboardInterrupt
        with open(cmd[-1], "w") as f:
            json.dump({"results": {"mean_step_ms": 1.0}}, f)
        return 0, 1.0

    monkeypatch.setattr(ab_pairs, "run_one", run_one)
    with pytest.raises(KeyboardInterrupt):
        ab_pairs.main(argv)
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["status"] for r in runs] == ["exit 0", "interrupted"]
    assert runs[0]["figures"] == {"results.mean_step_ms": 1.0}


@pytest.mark.slow
def test_ab_pairs_runs_a_bench_workload_on_each_side(llama, tmp_path):
    """Two real `rollout-engine bench` runs through ab_switch.py, in
    processes of their own: each report records its side's setting, and the
    summary holds their throughput."""
    _, folder = llama
    argv = ["--name", "g", "--out-dir", str(tmp_path), "--pairs", "1", "--a", _TMA + "1", "--b", _TMA + "0", "--",
            "rollout-engine", "bench", "--workload", "grpo", "--model", folder, "--load-format", "auto",
            "--num-prompts", "2", "-n", "2", "--prompt-min", "16", "--prompt-max", "24", "--output-len", "4",
            "--max-total-tokens", "2048"]
    assert _benchmark("ab_pairs").main(argv) == 0
    a, b = (json.loads((tmp_path / f"g-{side}-1.json").read_text()) for side in "ab")
    assert a["switches"] == {"rollout_engine.kernels.moe.TMA_WEIGHTS": "True"}
    assert b["switches"] == {"rollout_engine.kernels.moe.TMA_WEIGHTS": "False"}
    rows = {r["figure"]: r for r in json.loads((tmp_path / "g.json").read_text())["figures"]}
    throughput = rows["results.cache_on.output_tok_per_s"]
    assert len(throughput["a"]) == 1 and throughput["b_over_a"] > 0


def test_ab_pairs_never_reads_an_earlier_report_and_takes_repeated_settings(tmp_path, monkeypatch):
    """A run that ends well without writing its report fails (the report
    of an earlier call by the same name is removed first, not read); a
    repeated --a adds its settings to the first's."""
    ab_pairs = _benchmark("ab_pairs")
    seen = []

    def run_one(cmd, log, timeout):
        seen.append(cmd)
        open(log, "w").close()
        return 0, 1.0

    monkeypatch.setattr(ab_pairs, "run_one", run_one)
    stale = tmp_path / "s-a-1.json"
    stale.write_text(json.dumps({"results": {"mean_step_ms": 9.0}}))
    preload = "rollout_engine.kernels.gemv.PRELOAD_BLOCKS="
    argv = ["--name", "s", "--out-dir", str(tmp_path), "--pairs", "1", "--a", _TMA + "1", "--a", preload + "4",
            "--b", _TMA + "0", "--", "rollout-engine", "bench"]
    assert ab_pairs.main(argv) == 1
    assert not stale.exists()
    assert seen[0][2:4] == [_TMA + "1", preload + "4"] and seen[1][2:3] == [_TMA + "0"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["exit 0 without a report"] * 2 and summary["figures"] == []


def test_ab_pairs_without_its_options_names_them_first(capsys):
    """No '--' and no options: the missing options, not the missing program."""
    with pytest.raises(SystemExit) as exit_:
        _benchmark("ab_pairs").main(["--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "required: --name, --out-dir, --a, --b" in err and "'--'" not in err
