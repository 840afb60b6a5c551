"""The benchmark scripts under benchmarks/ (step_breakdown, host_phases,
ab_switch and the kernel probes): their reports from recorded inputs, their
refusals of bad flags as one line before looking for a GPU, Ctrl-C."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

def _benchmark(name: str):
    """A script of benchmarks/, imported as a module, with its own folder on
    the path while it loads (as when it runs: scripts import their neighbours)."""
    import importlib.util
    import sys

    folder = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def test_step_breakdown_sums_kernels_by_kind_and_idle_time():
    sb = _benchmark("step_breakdown")
    assert sb.busy_time([(0, 10), (5, 12), (20, 30)]) == 22  # overlaps counted once
    events = [("sm90_xmma_gemm_bf16", 0, 600), ("BatchDecodeWithPagedKVCacheKernel", 600, 200),
              ("ncclDevKernel_AllReduce_Sum_bf16", 800, 100), ("argmax_logsumexp partial_kernel", 900, 50),
              ("rmsnorm_kernel", 950, 50)]
    res = sb.breakdown(events, wall_us=2000, steps=2)
    assert res["busy_share"] == 0.5 and res["idle_ms_per_step"] == 0.5
    assert res["ms_by_kind"] == {"matmul": 0.6, "attention": 0.2, "all_reduce": 0.1, "sampling": 0.1, "norm": 0.1}


def test_step_breakdown_sorts_idle_gaps_by_length_and_names_what_waited():
    sb = _benchmark("step_breakdown")
    events = [("gemm", 0, 100), ("rmsnorm_kernel", 105, 5), ("BatchPrefillKernel", 2110, 90),
              ("gemm", 2250, 50), ("rope_kernel", 2240, 20)]  # out of order; the gemm overlaps nothing after
    gaps = sb.idle_gaps(events)["by_length"]
    assert gaps["<2us"] == gaps["2-5us"] == {"count": 0, "ms": 0.0}
    assert gaps["5-10us"] == {"count": 1, "ms": 0.0}  # 105 -> 110
    assert gaps["10-100us"] == {"count": 1, "ms": 0.0}  # 2200 -> 2240
    assert gaps[">=1000us"] == {"count": 1, "ms": 2.0}  # 110 -> 2110
    assert sb.idle_gaps(events)["long_gaps_before"] == {"BatchPrefillKernel": {"count": 1, "ms": 2.0}}
    assert sb.idle_gaps(events)["gaps_10_100us_before"] == {"rope_kernel": {"count": 1, "ms": 0.0}}
    tenths = sb.idle_gaps(events)["long_gaps_by_tenth_of_run"]  # the run spans 0 -> 2300 us; the gap starts at 110
    assert len(tenths) == 10 and tenths[0] == {"count": 1, "ms": 2.0} and sum(t["count"] for t in tenths) == 1
    late = sb.idle_gaps([("a", 0, 900), ("b", 1000, 10)])["long_gaps_by_tenth_of_run"]  # idle from 900 of 1010
    assert late[8] == {"count": 1, "ms": 0.1} and sum(t["count"] for t in late) == 1


def test_step_breakdown_reads_the_device_events_from_the_raw_results():
    import types

    sb = _benchmark("step_breakdown")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, start_ns, dur_ns):
        return types.SimpleNamespace(name=lambda: name, device_type=lambda: device, start_ns=lambda: start_ns,
                                     duration_ns=lambda: dur_ns)

    raw = [event("aten::mm", cpu, 0, 9000), event("gemm", cuda, 1500, 2500), event("Memcpy HtoD", cuda, 5000, 500)]
    prof = types.SimpleNamespace(profiler=types.SimpleNamespace(kineto_results=types.SimpleNamespace(events=lambda: raw)))
    assert sb.device_events(prof) == [("gemm", 1.5, 2.5), ("Memcpy HtoD", 5.0, 0.5)]  # the host's operators left out


@pytest.mark.parametrize("argv,flag", [
    (["--batch-size", "0"], "--batch-size"), (["--output-len", "-1"], "--output-len"), (["-n", "0"], "-n"),
    (["--num-prompts", "x"], "--num-prompts"), (["--workload", "nope"], "--workload"), (["--tp", "0"], "--tp-size"),
    (["--tp", "3"], "--tp-size"), (["--model", "nope"], "--model"), (["--load-format", "pt"], "--load-format"),
])
def test_step_breakdown_names_the_bad_flag_on_any_machine(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        _benchmark("step_breakdown").parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {flag}: " in err and "Traceback" not in err, err


def test_gpu_benchmarks_on_a_machine_without_enough_gpus_say_so_in_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        _benchmark("step_breakdown").parse_args([])
    assert exit_.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    for name, argv in (("invariant_matmul", []), ("decode_attention", []), ("tp_allreduce", ["--gpus", "3"]),
                       ("fp8_gemm_configs", []), ("fp8_gemm_tiles", []), ("shared_prefix_attention", []),
                       ("host_calls", [])):
        with pytest.raises(SystemExit) as exit_:
            _benchmark(name).main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and "CUDA GPU" in err and "\n" not in err, err
        assert err.startswith(f"{name}.py: error: "), err


_TMA = "rollout_engine.kernels.moe.TMA_WEIGHTS="
_SIDES = ["--out-dir", ".", "--a", _TMA + "1", "--b", _TMA + "0"]


@pytest.mark.parametrize("name,argv,flag", [
    ("decode_attention", ["--batch-sizes", "0"], "--batch-sizes"), ("decode_attention", ["--contexts", "x"], "--contexts"),
    ("invariant_matmul", ["--rows", "-3"], "--rows"), ("tp_allreduce", ["--gpus", "0"], "--gpus"),
    ("tp_allreduce", ["--ops", "0"], "--ops"), ("decode_attention", ["--out", "/no/such/folder/x.json"], "--out"),
    ("invariant_matmul", ["--out", "/no/such/folder/x.json"], "--out"),
    ("checksum_probe", ["--out", "/no/such/folder/x.json"], "--out"), ("checksum_probe", ["/no/such/x.json"], "--out"),
    ("fp8_gemm_tiles", ["--rows", "0"], "--rows"), ("fp8_gemm_tiles", ["--model", "qwen3-30b-a3b"], "--model"),
    ("fp8_gemm_tiles", ["--products", "lm_head"], "--products"),
    ("shared_prefix_attention", ["--group", "0"], "--group"), ("shared_prefix_attention", ["--batch-sizes", "12"],
                                                                 "--batch-sizes"),
    ("shared_prefix_attention", ["--orders", "random"], "--orders"),
    ("host_phases", ["--out", "/no/such/folder/x.json", "--", "--workload", "offline"], "--out"),
    ("host_phases", ["--profile", "--", "--workload", "grpo"], "--profile"),
    ("shared_prefix_attention", ["--shared-prefixes", "650"], "--shared-prefixes"),
    ("moe_pdl_ab", ["maybe", "moe_kernel.py"], "side"),
    ("moe_pdl_ab", ["on", "moe_kernel.py", "--tokens", "0"], "--tokens"),  # "off" would patch the kernels
    ("ab_switch", ["rollout_engine.layers.fp8_linear.FAST_ACUM=0", "rollout-engine"], "module.NAME=value"),
    ("ab_switch", ["rollout_engine.layers.fp8_linear.FAST_ACCUM=maybe", "rollout-engine"], "module.NAME=value"),
    ("ab_switch", ["rollout_engine.layers.no_such.FAST_ACCUM=0", "rollout-engine"], "module.NAME=value"),
    ("ab_switch", ["rollout_engine.layers.fp8_linear.FAST_ACCUM=0"], "program"),
    ("ab_switch", ["rollout_engine.layers.fp8_linear.FAST_ACCUM=0", "no_such.py"], "program"),
    ("ab_switch", ["rollout_engine.layers.fp8_linear.FAST_ACCUM=0.0", "rollout-engine"], "module.NAME=value"),
    ("ab_switch", ["rollout_engine.layers.fp8_linear.FAST_ACCUM", "rollout-engine"], "module.NAME=value"),
    ("ab_switch", ["rollout_engine.attention.flashinfer_backend.TRITON_DECODE_BF16_MIN_ROWS=many", "rollout-engine"],
     "module.NAME=value"),
    ("batch_gemm_configs", ["--configs", "64,32,128,2,4"], "--configs"),
    ("batch_gemm_configs", ["--configs", "64,32,128,2,4,3,2"], "--configs"),
    ("decode_attention", ["--backends", "cuda"], "--backends"),
    ("decode_attention", ["--layouts", "NDH"], "--layouts"), ("moe_kernel", ["--tokens", "8,0"], "--tokens"),
    ("moe_kernel", ["--tokens", "8", "x"], "--tokens"),
    *(("ab_pairs", argv, flag) for argv, flag in [
        (["--name", "a b", *_SIDES, "--", "rollout-engine"], "--name"),
        (["--name", "x", "--out-dir", "/no/such/folder", "--a", _TMA + "1", "--b", _TMA + "0", "--", "rollout-engine"],
         "--out-dir"),
        (["--name", "x", "--out-dir", ".", "--a", _TMA[:-2] + "=1", "--b", _TMA + "0", "--", "rollout-engine"], "--a"),
        (["--name", "x", "--out-dir", ".", "--a", _TMA + "1", "--b", _TMA + "maybe", "--", "rollout-engine"], "--b"),
        (["--name", "x", *_SIDES, "--", "no_such.py"], "--"), (["--name", "x", *_SIDES, "--"], "--"),
        (["--name", "x", *_SIDES, "--", "rollout-engine", "bench", "--out", "r.json"], "--"),
        (["--name", "x", *_SIDES, "rollout-engine"], "--"),
        (["--name", "x", "--pairs", "0", *_SIDES, "--", "rollout-engine"], "--pairs"),
        (["--name", "x", "--budget", "-5", *_SIDES, "--", "rollout-engine"], "--budget")]),
])
def test_benchmark_scripts_name_a_bad_flag_before_looking_for_a_gpu(name, argv, flag, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        _benchmark(name).main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and f"error: argument {flag}: " in err and "\n" not in err, err


def test_ab_switch_sets_the_switch_for_the_program_it_runs(monkeypatch):
    from rollout_engine import console
    from rollout_engine.layers import fp8_linear

    from rollout_engine.bench.run import SWITCHES_ENV

    monkeypatch.setattr(fp8_linear, "FAST_ACCUM", True)  # restored after the test
    monkeypatch.delenv(SWITCHES_ENV, raising=False)  # and this
    seen = {}
    monkeypatch.setattr(console, "main", lambda: seen.update(argv=sys.argv[:], fast=fp8_linear.FAST_ACCUM,
                                                             switches=os.environ.get(SWITCHES_ENV)) or 0)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    assert _benchmark("ab_switch").main(["rollout_engine.layers.fp8_linear.FAST_ACCUM=0", "rollout-engine", "bench",
                                         "--workload", "grpo"]) == 0
    assert seen == {"argv": ["rollout-engine", "bench", "--workload", "grpo"], "fast": False,
                    "switches": '{"rollout_engine.layers.fp8_linear.FAST_ACCUM": "False"}'}


def test_ab_switch_says_what_it_set_then_the_scripts_own_error(monkeypatch, capsys):
    """The path spelt as the examples spell it; the script checks its own flags."""
    from rollout_engine.kernels import attention

    monkeypatch.setattr(attention, "DECODE_TILE", None)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    with pytest.raises(SystemExit) as exit_:
        _benchmark("ab_switch").main(["rollout_engine.kernels.attention.DECODE_TILE=(8, 1, 2)",
                                      "benchmarks/fp8_gemm_configs.py", "--rows", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 2, err
    assert err[0] == "ab_switch: rollout_engine.kernels.attention.DECODE_TILE = (8, 1, 2)"
    assert err[1].startswith("fp8_gemm_configs.py: error: argument --rows: "), err


def test_ab_switch_runs_scripts_whose_main_reads_sys_argv(monkeypatch, capsys):
    """cpu_prefill.py's main takes no list: it reads sys.argv, as ab_switch sets it; a None switch takes a tuple."""
    from rollout_engine.kernels import attention

    monkeypatch.setattr(attention, "DECODE_TILE", None)
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    with pytest.raises(SystemExit) as exit_:
        _benchmark("ab_switch").main(["rollout_engine.kernels.attention.DECODE_TILE=(32, 1, 5)", "cpu_prefill.py",
                                      "--help"])
    assert exit_.value.code == 0 and "cpu_prefill.py" in capsys.readouterr().out
    assert attention.DECODE_TILE == (32, 1, 5)


def test_step_breakdown_checks_its_output_paths_before_the_run(tmp_path, capsys):
    for argv, flag in ((["--out", str(tmp_path / "no" / "x.json")], "--out"), (["--trace", str(tmp_path)], "--trace")):
        with pytest.raises(SystemExit) as exit_:
            _benchmark("step_breakdown").parse_args(argv)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and f"error: argument {flag}: " in err, err


def test_benchmark_scripts_help_shows_the_whole_docstring_and_the_defaults(capsys):
    for name in ("step_breakdown", "decode_attention"):
        module = _benchmark(name)
        with pytest.raises(SystemExit) as exit_:
            (module.parse_args if name == "step_breakdown" else module.main)(["--help"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0
        last_paragraph = module.__doc__.strip().split("\n\n")[-1].split("\n")[0]
        assert last_paragraph in out and "(default: " in out, out


def test_scripts_end_on_ctrl_c_and_refused_input_with_one_line(capsys, monkeypatch):
    """Every script under benchmarks/ runs its main through run_script:
    Ctrl-C is `<script>: error: interrupted` (130, as rollout-engine says it), the engine's ValueError one
    error line (2), not a traceback."""
    import glob
    import sys

    from rollout_engine.script_args import run_script

    root = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
    for path in glob.glob(os.path.join(root, "*.py")):
        with open(path) as f:
            assert "raise SystemExit(run_script(main))" in f.read(), path
    monkeypatch.setattr(sys, "argv", ["fp8_fidelity.py", "--model", "nosuch"])

    def interrupted():
        raise KeyboardInterrupt

    def refused():
        raise ValueError("model 'nosuch' is not a folder,\n  a known model")

    assert run_script(interrupted) == 130 and run_script(refused) == 2
    assert capsys.readouterr().err == ("fp8_fidelity.py: error: interrupted\n"
                                       "fp8_fidelity.py: error: model 'nosuch' is not a folder, a known model\n")
    assert run_script(lambda: None) == 0 and run_script(lambda: 3) == 3


def test_host_phases_times_the_step_loop_of_a_bench_run_and_leaves_nothing_patched(llama, tmp_path, capsys):
    from rollout_engine.runner.model_runner import ModelRunner
    from rollout_engine.scheduler import scheduler as sched

    before = (sched.Scheduler._step, sched.Scheduler._launch, sched.build_plan, ModelRunner.collect)
    _, folder = llama
    out = tmp_path / "phases.json"
    rc = _benchmark("host_phases").main(["--profile", "--out", str(out), "--", "--workload", "grpo", "--model", folder,
                                         "--load-format", "auto", "--num-prompts", "2", "-n", "2", "--prompt-min",
                                         "8", "--prompt-max", "12", "--output-len", "5",
                                         "--max-total-tokens", "2048"])
    assert rc == 0
    report = json.loads(out.read_text())
    # two measured runs (cache off, then on) of 2 x 2 samples x 5 tokens; the warm-ups are not counted
    assert 10 <= report["steps"] <= 2 * 12
    assert {"scheduler.schedule_ahead", "scheduler.build_plan", "runner.launch", "runner.sample"} <= set(
        report["us_per_step"])
    assert report["host_ms_per_step"] > 0 and sum(b["steps"] for b in report["by_batch"].values()) == report["steps"]
    kinds = report["by_kind"]  # each step by what it launched: the prompts' steps are mixed, the rest decode
    assert {"mixed", "decode"} <= set(kinds) and sum(k["steps"] for k in kinds.values()) == report["steps"]
    assert kinds["mixed"]["us_per_step"]["runner.launch"] > 0 and kinds["decode"]["host_us_mean"] > 0
    assert (tmp_path / "phases.json.tottime.txt").read_text().count("function calls") == 1
    assert (sched.Scheduler._step, sched.Scheduler._launch, sched.build_plan, ModelRunner.collect) == before


def test_shared_prefix_attention_lays_out_groups_sharing_their_prompt_pages():
    import torch

    layout = _benchmark("shared_prefix_attention")._layout
    for grouped in (True, False):
        total, group_pages, rows = layout(32, 8, 640, 100, 16, grouped, torch.Generator().manual_seed(1))
        assert len(group_pages) == 4 and all(len(p) == 40 for p in group_pages)
        assert sorted(g for g, _, _ in rows) == [g for g in range(4) for _ in range(8)]  # 8 rows per group
        if grouped:
            assert [g for g, _, _ in rows] == sorted(g for g, _, _ in rows)
        pages = torch.cat(group_pages + [own for _, own, _ in rows])
        assert len(set(pages.tolist())) == len(pages) == total - 1 and 0 not in pages.tolist()  # page 0 unused
        assert all(len(own) == -(-n // 16) and 25 <= n < 175 for _, own, n in rows)


@pytest.mark.parametrize("argv,says", [
    (["--", "--workload", "serve"], "got --workload serve"),
    (["--", "--workload", "grpo", "--replicas", "2"], "--replicas 2"),
    (["--workload", "grpo"], "go after `--`"),
])
def test_host_phases_refuses_what_it_cannot_measure_in_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        _benchmark("host_phases").parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err, err


def test_host_phases_leaves_no_report_when_the_bench_refuses_its_arguments(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert _benchmark("host_phases").main(["--out", str(out), "--", "--workload", "grpo", "--bogus", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--bogus" in captured.err and not out.exists()


def test_ab_switch_says_a_bool_takes_0_or_1(capsys):
    with pytest.raises(SystemExit):
        _benchmark("ab_switch").main(["rollout_engine.layers.fp8_linear.FAST_ACCUM=true", "rollout-engine"])
    assert "FAST_ACCUM is a bool, not 'true' (0 or 1)" in capsys.readouterr().err


def test_moe_kernel_takes_token_counts_with_commas_or_spaces(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--tokens", "8,64"], ["--tokens", "8", "64,256"]):
        with pytest.raises(SystemExit):
            _benchmark("moe_kernel").main(argv)
        assert "needs a CUDA GPU" in capsys.readouterr().err  # past the flags: only the GPU is missing

