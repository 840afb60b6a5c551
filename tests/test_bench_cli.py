"""`rollout-engine bench` and the demo command, end to end on tiny inputs."""
from __future__ import annotations

import json

import pytest

from rollout_engine.cli import main


def test_bench_grpo_reports_cache_on_and_off(llama, tmp_path, monkeypatch):
    """... and, for an A/B side, the switches benchmarks/ab_switch.py set."""
    from rollout_engine.bench.run import SWITCHES_ENV

    monkeypatch.setenv(SWITCHES_ENV, '{"rollout_engine.layers.fp8_linear.FAST_ACCUM": "False"}')
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
    assert on["kv_capacity_tokens"] == off["kv_capacity_tokens"] == 4096
    # the report's config says what ran: no CUDA graphs on the CPU, no derived flags
    assert report["config"]["cuda_graph"] is False and "no_cuda_graph" not in report["config"]
    assert report["config"]["num_prompts"] == 3 and report["config"]["output_len"] == 6
    assert report["switches"] == {"rollout_engine.layers.fp8_linear.FAST_ACCUM": "False"}


def _files_under(folder):
    import pathlib

    return {str(p.relative_to(folder)) for p in pathlib.Path(folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_bench_without_out_prints_the_report_and_writes_no_file(llama, tmp_path, monkeypatch, capsys):
    """The report goes to stdout; a file only where --out names one. Run from
    an empty folder (as from the repository root): nothing lands there, nor
    under benchmarks/ (results are put under benchmarks/results/ by hand)."""
    import pathlib

    from rollout_engine.bench.run import SWITCHES_ENV

    monkeypatch.delenv(SWITCHES_ENV, raising=False)
    _, folder = llama
    benchmarks = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    before = _files_under(benchmarks)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--workload", "weights", "--model", folder, "--load-format", "auto",
                 "--max-total-tokens", "1024"]) == 0
    printed = capsys.readouterr().out
    report = json.loads(printed[printed.index("{"):])
    assert report["config"]["out"] is None and report["results"]["in_process_s"] > 0
    assert "switches" not in report  # none set
    assert list(tmp_path.iterdir()) == []
    assert _files_under(benchmarks) == before


def test_demo_runs_on_the_default_model(smollm2_dir, capsys, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(__import__("pathlib").Path(smollm2_dir).parents[1]))
    assert main(["demo", "--max-new-tokens", "8", "-n", "2", "--max-total-tokens", "2048"]) == 0
    printed = capsys.readouterr().out
    assert "8 samples" in printed and "tok/s" in printed and "mean logprob" in printed
    assert "logprobs processed (of the distribution sampled from" in printed  # which logprobs these are


def test_bench_weights_times_in_process_and_disk_updates(llama, tmp_path):
    _, folder = llama
    out = tmp_path / "weights.json"
    assert main(["bench", "--workload", "weights", "--model", folder, "--load-format", "auto",
                 "--max-total-tokens", "1024", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["weight_bytes"] > 0 and res["in_process_s"] > 0 and res["from_disk_s"] > 0


def test_bench_serve_measures_in_process_and_http_on_the_same_requests(llama, tmp_path, capsys):
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
    assert json.loads(capsys.readouterr().out)["results"] == res  # stdout: the report alone (progress: stderr)
    assert res["requests"] == 12 and res["concurrency"] == 4
    assert res["http"]["output_tokens"] == res["in_process"]["output_tokens"] > 0
    assert res["http_over_in_process"] > 0


def test_longtail_workload_shape():
    from rollout_engine.bench.workloads import longtail

    wl = longtail(50000, scale=0.25)
    assert len(wl.input_ids) == 16 * 16 and len({tuple(x) for x in wl.input_ids}) == 16
    assert {len(x) for x in wl.input_ids} == {512}
    lens = [p.max_new_tokens for p in wl.params]
    assert max(lens) == 8192 and min(lens) >= 512  # tails of 8k at a quarter scale
    assert 0.6 < sum(1 for n in lens if n <= 2048) / len(lens) < 0.8  # 70% in U[1k, 4k] * 0.5
    capped = longtail(50000, scale=0.25, context=4096)
    assert max(p.max_new_tokens for p in capped.params) == 4096 - 512
    with pytest.raises(ValueError, match="scale"):
        longtail(50000, scale=0)


def test_longtail_summary_counts_low_occupancy_time():
    from rollout_engine.bench.longtail import summarize

    rows = [(0.5, 40, 0, 100), (1.0, 40, 0, 300), (2.0, 10, 0, 700), (3.0, 2, 0, 800)]
    res = summarize(rows, 4.0, 900)
    assert res["share_of_time_below_32_running"] == 0.5  # from t=2 to the end
    assert res["output_tok_per_s"] == 225.0 and len(res["tok_per_s_by_twentieth"]) == 20
    assert res["max_running_by_twentieth"][0] == 40 and res["max_running_by_twentieth"][-1] == 2


def test_bench_longtail_end_to_end(tmp_path, monkeypatch):
    from models import make_hf_model, save_model
    from rollout_engine.bench import longtail

    # The running count is polled; at the default 0.1 s a fast machine can run the 72 steps during which all
    # 16 samples run between two polls. Every 2 ms no poll interval is that long.
    monkeypatch.setattr(longtail, "SAMPLE_EVERY_S", 0.002)

    folder = save_model(make_hf_model("llama", seed=1, max_position_embeddings=4096), tmp_path / "m")
    out = tmp_path / "lt.json"
    assert main(["bench", "--workload", "longtail", "--model", str(folder), "--load-format", "auto",
                 "--scale", "0.002", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["requests"] == 16 and res["prompts"] == 1
    assert res["share_of_time_below_32_running"] == 1.0  # 16 requests: always below 32
    assert res["output_tokens"] > 16 * 40 and res["makespan_s"] > 0
    running = res["max_running_by_twentieth"]
    # Every sample runs at some point, then the batch drains to its longest ones (the peak may fall in any
    # twentieth: the shortest samples end within the first).
    assert max(running) == 16 and running[-1] <= 2


def test_workload_roofline_counts_only_computed_prompt_tokens():
    from rollout_engine.bench.roofline import DeviceLimits, ModelCosts, workload_roofline

    costs = ModelCosts(weight_bytes_per_step=1e9, kv_bytes_per_token=1e5, flops_per_token=1e9)
    limits = DeviceLimits(bandwidth=1e12, flops=1e14)
    inputs, outputs = [1000] * 8, [100] * 8
    every = workload_roofline(costs, limits, inputs, outputs, 8)
    # 8 samples of one prompt: an ideal cache computes it once; decode still reads each sample's context.
    once = workload_roofline(costs, limits, inputs, outputs, 8, prefill_tokens=1000)
    decode_s = sum((1e9 + 8 * (1000 + t) * 1e5) / 1e12 for t in range(100))
    assert abs(once - 800 / (1000 * 1e9 / 1e14 + decode_s)) < 1e-6 * once
    assert abs(every - 800 / (8000 * 1e9 / 1e14 + decode_s)) < 1e-6 * every


def test_the_fp8_roofline_reads_one_byte_per_quantized_weight_at_twice_the_peak():
    """quantization="fp8": the attention projections and dense MLPs cost 1
    byte a weight and half their FLOPs against the bf16 peak; the
    embeddings, LM head, norms and (MoE) routers cost as in bf16; MoE
    experts 1 byte a weight, their FLOPs as in bf16 (weight-only)."""
    from rollout_engine.bench.roofline import ModelCosts
    from rollout_engine.models.config import ModelConfig
    from rollout_engine.models.presets import preset_config

    mc = ModelConfig.from_hf(preset_config("qwen2.5-7b"), ())
    h, i = mc.hidden_size, mc.intermediate_size
    linear = mc.num_layers * (h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h + 3 * h * i)
    bf16, fp8 = ModelCosts.of(mc), ModelCosts.of(mc, fp8=True)
    assert bf16.weight_bytes_per_step - fp8.weight_bytes_per_step == linear
    assert bf16.flops_per_token - fp8.flops_per_token == linear
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token
    moe = ModelConfig.from_hf(preset_config("qwen3-30b-a3b"), ())
    moe_bf16, moe_fp8 = ModelCosts.of(moe), ModelCosts.of(moe, fp8=True)
    assert moe_fp8.expert_bytes * 2 == moe_bf16.expert_bytes
    # the linear layers' FLOPs halved (as many as their weights), the experts' not
    assert (moe_bf16.flops_per_token - moe_fp8.flops_per_token
            == moe_bf16.weight_bytes_per_step - moe_fp8.weight_bytes_per_step)
