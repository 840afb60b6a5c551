"""`rollout-engine bench` and the demo command, end to end on tiny inputs."""
from __future__ import annotations

import json

from rollout_engine.cli import main


def test_bench_grpo_reports_cache_on_and_off(llama, tmp_path):
    _, folder = llama
    out = tmp_path / "grpo.json"
    rc = main(["bench", "--workload", "grpo", "--model", folder, "--load-format", "auto", "--num-prompts", "3",
               "-n", "4", "--prompt-min", "16", "--prompt-max", "40", "--output-len", "6",
               "--max-total-tokens", "4096", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    on, off = report["results"]["cache_on"], report["results"]["cache_off"]
    assert on["output_tokens"] == off["output_tokens"] == 3 * 4 * 6
    assert on["cache_hit_rate"] >= on["ideal_hit_rate"] == 0.75
    assert off["prompt_tokens_computed"] == off["prompt_tokens"] and off["cache_hit_rate"] == 0
    assert on["prompt_tokens_computed"] == on["prompt_tokens"] // 4


def test_demo_runs_on_the_default_model(smollm2_dir, capsys, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(__import__("pathlib").Path(smollm2_dir).parents[1]))
    assert main(["demo", "--max-new-tokens", "8", "-n", "2", "--max-total-tokens", "2048"]) == 0
    printed = capsys.readouterr().out
    assert "8 samples" in printed and "tok/s" in printed and "mean logprob" in printed


def test_bench_weights_times_in_process_and_disk_updates(llama, tmp_path):
    _, folder = llama
    out = tmp_path / "weights.json"
    assert main(["bench", "--workload", "weights", "--model", folder, "--load-format", "auto",
                 "--max-total-tokens", "1024", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["weight_bytes"] > 0 and res["in_process_s"] > 0 and res["from_disk_s"] > 0


def test_bench_serve_measures_in_process_and_http_on_the_same_requests(llama, tmp_path):
    import pytest

    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    _, folder = llama
    out = tmp_path / "serve.json"
    assert main(["bench", "--workload", "serve", "--model", folder, "--load-format", "auto", "--num-prompts", "12",
                 "--prompt-min", "8",
                 "--prompt-max", "40", "--output-len", "8", "--concurrency", "4", "--max-total-tokens", "4096",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["requests"] == 12 and res["concurrency"] == 4
    assert res["http"]["output_tokens"] == res["in_process"]["output_tokens"] > 0
    assert res["http_over_in_process"] > 0
