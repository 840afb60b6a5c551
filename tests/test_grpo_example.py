"""The GRPO training example end to end on the CPU: rollouts, rewards, a
policy-gradient step, weight sync, wandb offline, the mismatch figures and
the plot."""
from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.slow  # trains for many steps; run by .ci/run after the fast tests

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_grpo_steps_with_wandb_offline(smollm2_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = tmp_path / "run.json"
    result = _load("grpo_train").main(["--model", smollm2_dir, "--steps", "2", "--prompts", "2", "-n", "2",
                                       "--max-new-tokens", "8", "--wandb", "--log-json", str(log)])
    rows = json.loads(log.read_text())
    assert len(rows) == 2 and result["weight_version"] == 2 and [r["weight_version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["mismatch_max"] < 1e-4  # fp32: the engine's raw logprobs are the trainer's
        assert row["output_tokens"] == 2 * 2 * 8 and row["time/generate"] > 0 and row["time/sync"] > 0
        assert 0 <= row["reward_mean"] <= 1
    assert "time/checksum" in rows[1] and "time/checksum" not in rows[0]  # the last step checks the sync
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    logged = open(runs[0], "rb").read()
    for key in ("reward_mean", "mismatch_mean", "mismatch_max", "kl_k1_per_seq", "output_tokens_per_s",
                "prefix_hit_rate", "weight_version", "time/generate", "time/sync"):
        assert f"rollout/{key}".encode() in logged, key

    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    plot_run = _load("plot_run")
    plot_run.main([str(log), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = tmp_path / "both.png"
    plot_run.main([str(log), str(log), "--labels", "a", "b", "--png", str(both)])
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad in ([str(log), "--labels", "a", "b", "--png", str(both)], [str(log)]):
        with pytest.raises(SystemExit):
            plot_run.main(bad)


def test_grpo_rollout_help_prints_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        _load("grpo_rollout").main(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_the_logger_is_a_no_op_without_a_run(smollm2_dir):
    from rollout_engine import RolloutEngine, SamplingParams
    from rollout_engine.integrations.wandb import RolloutLogger

    engine = RolloutEngine(smollm2_dir, max_total_tokens=2048)
    try:
        logger = RolloutLogger(None)
        params = SamplingParams(max_new_tokens=4, n=2, temperature=0)
        first = logger.step(engine, engine.generate(["Hi"], sampling_params=params), {"generate": 1.0})
        second = logger.step(engine, engine.generate(["Hi"], sampling_params=params), {"generate": 1.0})
        logger.log(second, 1)
        assert first["output_tokens"] == second["output_tokens"] == 8  # per step, not cumulative
        assert second["prompt_tokens_computed"] < first["prompt_tokens_computed"]  # the prompt came from the cache
        assert second["output_tokens_per_s"] == 8.0
    finally:
        engine.shutdown()


def test_the_reward_takes_the_last_number():
    reward = _load("grpo_train").reward
    assert reward("12 + 7 = 19", 19) == reward("The answer is 19.", 19) == 1.0
    assert reward("What is 12 + 7?", 19) == reward("", 19) == reward("19 is not it: 20", 19) == 0.0


def _tiny_qwen3_preset(monkeypatch) -> None:
    """A preset `tiny-qwen3`: a small Qwen3 shape for runs with dummy weights."""
    from rollout_engine.models import presets

    monkeypatch.setitem(presets.PRESETS, "tiny-qwen3", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=5000, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=4999))


def test_token_task_on_a_preset_with_dummy_weights(tmp_path, monkeypatch):
    """The path for GPUs without a checkpoint: a preset's shape, the trainer's
    random init pushed to the engine first, a reward learnable from random weights."""
    _tiny_qwen3_preset(monkeypatch)
    log = tmp_path / "run.json"
    result = _load("grpo_train").main(["--model", "tiny-qwen3", "--load-format", "dummy", "--task", "token",
                                       "--steps", "2", "--prompts", "2", "-n", "4", "--max-new-tokens", "6",
                                       "--device", "cpu", "--log-json", str(log)])
    rows = json.loads(log.read_text())
    assert result["weight_version"] == 2 and [r["weight_version"] for r in rows] == [1, 2]
    assert all(r["mismatch_max"] < 1e-4 for r in rows)  # the engine runs the trainer's weights from the start


def test_fp8_rollouts_with_tis(tmp_path, monkeypatch):
    """`--rollout-quantization fp8 --tis-cap C`: the engine quantizes every
    update (the checksum check on every step compares it with the trainer's
    weights as fp8 holds them), the mismatch is fp8's (far above the 1e-4 of
    an unquantized engine), and the truncated importance weights are logged."""
    _tiny_qwen3_preset(monkeypatch)
    log = tmp_path / "run.json"
    _load("grpo_train").main(["--model", "tiny-qwen3", "--load-format", "dummy", "--task", "token",
                              "--steps", "2", "--prompts", "2", "-n", "4", "--max-new-tokens", "6",
                              "--device", "cpu", "--rollout-quantization", "fp8", "--tis-cap", "2",
                              "--checksum-every", "1", "--log-json", str(log)])
    rows = json.loads(log.read_text())
    assert len(rows) == 2
    for row in rows:
        assert row["mismatch_mean"] > 1e-3
        assert 0 < row["tis_weight_mean"] <= 2 and 0 <= row["tis_capped"] <= 1


def test_the_token_task_learns_from_random_weights(tmp_path):
    """The task the GPU presets train on (no checkpoint): from a random
    model, 30 GRPO steps raise the share of target tokens. Fails if the
    advantage's sign, the clipped ratio or the weight sync broke."""
    from models import make_hf_model, save_model

    folder = save_model(make_hf_model("qwen3", tie=True, vocab_size=4096, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, initializer_range=0.02), tmp_path / "model")
    log = tmp_path / "run.json"
    _load("grpo_train").main(["--model", folder, "--task", "token", "--steps", "30", "--prompts", "8", "-n", "8",
                              "--max-new-tokens", "16", "--lr", "3e-3", "--log-json", str(log)])
    rewards = [r["reward_mean"] for r in json.loads(log.read_text())]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert 0.15 < first < 0.35  # a quarter of the vocabulary is a target: random weights hit about that share
    assert last - first >= 0.1, rewards


def test_fsdp_over_two_ranks_trains_one_policy_into_both_engines(tmp_path):
    """`--fsdp` under torchrun (two gloo ranks here): each rank rolls out its
    own prompts, FSDP2 trains one policy, and every rank's engine ends with
    the same weights (the same greedy answer) and version."""
    import multiprocessing as mp

    import sync_workers
    from models import make_hf_model, save_model
    from test_weight_sync import _free_port, _gather

    folder = save_model(make_hf_model("qwen3", tie=True, vocab_size=4096, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, initializer_range=0.02), tmp_path / "model")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=sync_workers.grpo_fsdp_rank, args=(r, port, folder, EXAMPLES, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(_gather(procs, out, 2), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
    (_, v0, probe0, rewards0), (_, v1, probe1, rewards1) = results
    assert v0 == v1 == 2
    assert probe0 == probe1
    assert rewards0 == rewards1  # the logged reward is the mean over both ranks' rollouts
    # The weights moved: a fresh engine on the initial checkpoint answers differently.
    from rollout_engine import RolloutEngine, SamplingParams

    engine = RolloutEngine(folder, device="cpu", max_total_tokens=2048)
    try:
        before = engine.generate(input_ids=[list(range(1, 9))],
                                 sampling_params=SamplingParams(max_new_tokens=8, temperature=0))[0].output_token_ids
    finally:
        engine.shutdown()
    assert before != probe0


@pytest.mark.parametrize("flags,named", [
    (["--lr", "inf"], "--lr"), (["--lr", "0"], "--lr"), (["--clip", "-1"], "--clip"), (["--steps", "0"], "--steps"),
    (["--log-json", "/no/such/folder/run.json"], "--log-json"), (["--model", "no-such-model"], "--model"),
    (["--tis-cap", "0.5"], "--tis-cap"), (["--rollout-quantization", "int4"], "--rollout-quantization"),
    (["--stpes", "3"], "did you mean --steps?"),
])
def test_bad_arguments_are_one_line_errors_before_any_work(flags, named, capsys):
    with pytest.raises(SystemExit) as e:
        _load("grpo_train").main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and named in err and err.count("\n") == 1, err


def test_plot_run_keeps_every_run_apart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot_run = _load("plot_run")
    row = {"step": 0, "reward_mean": 0.5, "mismatch_mean": 1e-3, "mismatch_max": 1e-2, "output_tokens_per_s": 1.0}
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "run.json").write_text(json.dumps([row]))
    logs = [str(tmp_path / "a" / "run.json"), str(tmp_path / "b" / "run.json")]
    runs = {}
    plot_run.plot = lambda r, png, title: runs.update(r)  # what would be drawn
    plot_run.main(logs + ["--png", str(tmp_path / "both.png")])
    assert sorted(runs) == sorted(logs)  # same file names: whole paths as labels, no run dropped
    for bad in (logs + ["--labels", "x", "x", "--png", str(tmp_path / "p.png")],
                logs + ["--png", str(tmp_path / "p.jpg")], [logs[0], str(tmp_path / "nope" / "p.png")]):
        with pytest.raises(SystemExit):
            plot_run.main(bad)
    (tmp_path / "other.json").write_text('[{"a": 1}]')
    with pytest.raises(SystemExit):
        plot_run.main([str(tmp_path / "other.json"), str(tmp_path / "p.png")])
    assert "not a grpo_train.py" in capsys.readouterr().err


def test_check_sync_names_tensors_the_engine_holds_differently(llama):
    from rollout_engine import RolloutEngine

    hf, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=512)
    check_sync = _load("grpo_train").check_sync
    check_sync(hf, engine)  # the same weights: passes
    name = "model.layers.1.self_attn.v_proj.weight"
    engine.update_weights([(name, hf.state_dict()[name] * 2)])
    with pytest.raises(RuntimeError, match=f"differ from the trainer's in 1 tensors: \\['{name}'\\]"):
        check_sync(hf, engine)


def test_routing_replay_on_a_small_moe(tmp_path, monkeypatch):
    """`--routing-replay`: the engine (bf16) returns each token's experts, the
    fp32 trainer replays them; every step logs the routers' agreement and
    the mismatch without replay, which replay does not exceed; the plot
    draws both. A dense model is refused naming the flag."""
    from rollout_engine.models import presets

    monkeypatch.setitem(presets.PRESETS, "tiny-moe", dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=3000, hidden_size=128,
        intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=2999, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, norm_topk_prob=True))
    log = tmp_path / "run.json"
    train = _load("grpo_train")
    train.main(["--model", "tiny-moe", "--load-format", "dummy", "--task", "token", "--routing-replay",
                "--dtype", "bfloat16", "--steps", "3", "--prompts", "4", "-n", "4", "--max-new-tokens", "12",
                "--device", "cpu", "--log-json", str(log)])
    rows = json.loads(log.read_text())
    assert len(rows) == 3
    for row in rows:
        assert 0.5 < row["router_agreement"] <= 1
        assert row["mismatch_mean"] <= row["mismatch_free_mean"]
    png = tmp_path / "run.png"
    _load("plot_run").main([str(log), str(png)])
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit):
        train.main(["--model", "qwen3-0.6b", "--load-format", "dummy", "--task", "token", "--routing-replay",
                    "--steps", "1", "--device", "cpu"])
