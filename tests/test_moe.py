"""Mixture-of-experts models on the CPU (fp32, torch reference kernels):
Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral and OLMoE (q/k norms over the
whole projections) equal Hugging Face token for token, through the prefix
cache, chunked prefill, n > 1 and retraction (the differential stress run);
weights under the checkpoint's per-expert names and under transformers 5's
fused names, in any mix, load and hot-swap alike; bad MoE input is refused
by name before anything is copied."""
from __future__ import annotations

import pytest
import torch

from differential import Reference, WorkloadGenerator, stress
from models import MOE, make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.fidelity import weights_checksum
from rollout_engine.integrations.fsdp import sync_to_engine
from test_parity_hf import hf_greedy, hf_logprobs

KINDS = sorted(MOE)
SYSTEM = list(range(30, 70))
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6, 7], [7] * 20, list(range(100, 190)), [300, 11]]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, logprob_mode="raw", ignore_eos=True, prompt_logprobs=True)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_and_logprobs_match_hf(moe_models, kind):
    hf, folder = moe_models[kind]
    # prompts longer than a prefill chunk; the second shares the first's 40-token prefix
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=4096, max_prefill_tokens=32)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == hf_greedy(hf, prompt, 24)
        ref = hf_logprobs(hf, prompt, out.output_token_ids)
        assert torch.allclose(torch.tensor(out.output_logprobs), ref[len(prompt) - 1:], atol=1e-4)
        assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), ref[: len(prompt) - 1], atol=1e-4)
    again = engine.generate(input_ids=PROMPTS[:2], sampling_params=SamplingParams(
        n=3, max_new_tokens=24, temperature=0, ignore_eos=True))
    assert engine.cache_stats()["matched_tokens"] >= len(SYSTEM)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs[:2] for _ in range(3)]
    engine.check_integrity()


@pytest.mark.parametrize("kind", [k if k == "olmoe" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_random_call_sequences_match_the_reference(tmp_path, kind):
    """Cache hits, batches that grow and shrink, aborts and retractions in a
    tight pool, n > 1: every token checked against Hugging Face."""
    hf = make_hf_model(kind, seed=3)
    engine = RolloutEngine(save_model(hf, tmp_path / kind), device="cpu", max_total_tokens=400,
                           max_prefill_tokens=48, page_size=4, max_running_requests=24)
    gen = WorkloadGenerator(seed=11, token_range=(0, 512), max_prompt_len=60, max_new_tokens=40, max_batch=16)
    report = stress(engine, Reference(hf, "cpu"), gen, num_calls=30, margin=1e-3, logprob_tol=1e-3)
    print(report.summary())
    assert not report.violations, report.violations[:5]
    stats = engine.cache_stats()
    assert stats["retractions"] > 0 and stats["hit_rate"] > 0.1


def _per_expert(hf) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's names: each fused expert tensor split per expert."""
    out = []
    for name, t in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(name.replace("gate_up_proj", f"{e}.gate_proj.weight"), t[e, :half]),
                        (name.replace("gate_up_proj", f"{e}.up_proj.weight"), t[e, half:])]
        elif name.endswith("experts.down_proj"):
            out += [(name.replace("down_proj", f"{e}.down_proj.weight"), t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out


def _outputs(engine):
    return [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_update_weights_under_both_namings_equals_a_fresh_engine(moe_models, tmp_path, kind):
    _, folder = moe_models[kind]
    new = make_hf_model(kind, seed=9)
    new_folder = save_model(new, tmp_path / "new")
    want = _outputs(RolloutEngine(new_folder, device="cpu", max_total_tokens=2048))
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=2048)
    old = _outputs(engine)
    assert old != want

    engine.update_weights(list(new.named_parameters()))  # fused: what a trainer's named_parameters() gives
    assert _outputs(engine) == want
    engine.update_weights_from_disk(folder)
    assert _outputs(engine) == old
    engine.update_weights(_per_expert(new))  # the checkpoint's per-expert names (Mixtral: w1/w3/w2 on disk)
    assert _outputs(engine) == want
    engine.update_weights_from_disk(folder)
    mixed = [(n, t) for i, (n, t) in enumerate(_per_expert(new)) if "experts." not in n or i % 2]
    mixed += [(n, t) for n, t in new.named_parameters() if "experts" in n]  # fused after per-expert: any mix
    engine.update_weights((pair for pair in mixed))  # streamed
    assert _outputs(engine) == want
    engine.update_weights_from_disk(new_folder)  # Mixtral: block_sparse_moe.experts.E.w1 ... on disk
    assert _outputs(engine) == want
    engine.update_weights_from_disk(folder)
    sync_to_engine(new, engine)  # the FSDP hook (on an unwrapped model: the same names, streamed)
    assert _outputs(engine) == want
    engine.check_integrity()


def test_checksums_and_get_weight_agree_with_the_trainers_fused_tensors(moe_models):
    hf, folder = moe_models["qwen3_moe"]
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    names = engine.weight_names()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.down_proj" in names
    assert not any(".experts.0." in n for n in names)
    trainer = dict(hf.named_parameters())
    assert set(names) == set(trainer)
    assert engine.weights_checksum() == weights_checksum(list(trainer.items()), torch.float32)
    fused = trainer["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(engine.get_weight("model.layers.2.mlp.experts.gate_up_proj"), fused)
    assert torch.equal(engine.get_weight("model.layers.2.mlp.experts.5.up_proj.weight"), fused[5, 32:])
    assert torch.equal(engine.get_weight("model.layers.2.mlp.experts.5.down_proj.weight"),
                       trainer["model.layers.2.mlp.experts.down_proj"][5])
    per_expert = dict(_per_expert(hf))  # a trainer holding one tensor per expert (docs/moe.md)
    some = [n for n in per_expert if ".layers.2." in n][:5]
    assert engine.weights_checksum(some) == weights_checksum([(n, per_expert[n]) for n in some], torch.float32)


def test_bad_expert_weights_are_refused_by_name_before_any_copy(moe_models):
    hf, folder = moe_models["qwen3_moe"]
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    before = engine.weights_checksum()
    want = _outputs(engine)
    good = ("model.layers.0.mlp.experts.1.gate_proj.weight", torch.zeros(32, 64))
    cases = [
        ("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64), "expert index 8 is out of range"),
        ("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 60, 64), "[experts, 2 * intermediate, hidden]"),
        ("model.layers.0.mlp.experts.down_proj", torch.zeros(7, 64, 32), "[experts, hidden, intermediate]"),
        ("model.layers.0.mlp.experts.2.down_proj.weight", torch.zeros(64, 31), "shape mismatch"),
        ("model.layers.0.mlp.experts.-1.down_proj.weight", torch.zeros(64, 32), "expert index -1 is out of range"),
        ("model.layers.0.mlp.experts.3.down_prj.weight", torch.zeros(64, 32),
         "did you mean 'model.layers.0.mlp.experts.3.down_proj.weight'?"),
        ("model.layers.9.mlp.experts.down_proj", torch.zeros(8, 64, 32), "out of range (num_hidden_layers=3)"),
        ("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(8, 64, 64), "layer 1 has a dense MLP"),
    ]
    for name, tensor, words in cases:
        with pytest.raises(ValueError) as e:
            engine.update_weights([good, (name, tensor)])
        assert name.split(".experts")[0] in str(e.value) and words in str(e.value), str(e.value)
    assert engine.weights_checksum() == before  # nothing copied, not even the good tensor before the bad one
    assert _outputs(engine) == want


def test_a_mixtral_checkpoint_name_is_refused_as_it_was_sent(moe_models):
    """Mixtral's checkpoints say block_sparse_moe where transformers 5 says
    mlp; an error names the tensor the caller sent, not the engine's name."""
    hf, folder = moe_models["mixtral"]
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    count = hf.config.num_local_experts
    name = f"model.layers.0.block_sparse_moe.experts.{count}.w1.weight"
    with pytest.raises(ValueError, match=f"^{name}: expert index {count} is out of range"):
        engine.update_weights([(name, torch.zeros(hf.config.intermediate_size, hf.config.hidden_size))])
    with pytest.raises(ValueError, match=f"^{name}: expert index"):
        engine.get_weight(name)
    with pytest.raises(ValueError, match=r"^model.layers.0.block_sparse_moe.experts.-1.w1.weight: expert index -1 is out"):
        engine.get_weight("model.layers.0.block_sparse_moe.experts.-1.w1.weight")


def test_a_checkpoint_that_disagrees_with_its_config_is_refused_naming_it(tmp_path):
    hf = make_hf_model("mixtral", seed=1)
    folder = save_model(hf, tmp_path / "ok")
    import json

    config = json.load(open(f"{folder}/config.json"))
    for field, value, words in [("num_local_experts", 2, "expert index 2 is out of range"),
                                ("num_local_experts", 6, r"expected \[num_experts=6, hidden=64\], got \[4, 64\]"),
                                ("num_experts_per_tok", 5, "num_experts_per_tok=5")]:
        json.dump({**config, field: value}, open(f"{folder}/config.json", "w"))
        with pytest.raises(ValueError, match=words):
            RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    json.dump(config, open(f"{folder}/config.json", "w"))


def test_tp_size_that_does_not_split_the_experts_names_the_sizes_that_do(tmp_path):
    folder = save_model(make_hf_model("qwen3_moe", moe_intermediate_size=30), tmp_path / "m")
    with pytest.raises(ValueError, match=r"experts' intermediate size \(30\); this model splits into tp_size 1, 2$"):
        RolloutEngine(folder, device="cpu", tp_size=4)


def test_unsupported_architectures_and_options_are_named(tmp_path):
    folder = save_model(make_hf_model("olmoe", seed=1), tmp_path / "m")
    import json

    config = json.load(open(f"{folder}/config.json"))
    for change, words in [({"architectures": ["DeepseekV3ForCausalLM"]}, "multi-head latent attention"),
                          ({"clip_qkv": 8.0}, "clip_qkv=8.0"), ({"hidden_act": "gelu"}, "hidden_act 'gelu'")]:
        json.dump({**config, **change}, open(f"{folder}/config.json", "w"))
        with pytest.raises(ValueError, match=words):
            RolloutEngine(folder, device="cpu", max_total_tokens=1024)


def test_a_sliding_window_caps_the_context(tmp_path):
    """Within the window sliding and full attention are the same, so the
    context is cut to it (exact on every attention backend)."""
    folder = save_model(make_hf_model("mixtral", sliding_window=64), tmp_path / "m")
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    assert engine.model_config.max_position == 64
    with pytest.raises(ValueError, match="context of 64 tokens \\(its sliding_window"):
        engine.generate(input_ids=[[1] * 60], sampling_params=SamplingParams(max_new_tokens=10))
    assert len(engine.generate(input_ids=[[1] * 50], sampling_params=SamplingParams(
        max_new_tokens=10, ignore_eos=True))[0].output_token_ids) == 10


def test_a_stream_stopped_after_some_experts_marks_their_tensor_until_written_whole(moe_models):
    hf, folder = moe_models["qwen3_moe"]
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    want = _outputs(engine)
    fused = "model.layers.2.mlp.experts.gate_up_proj"

    def stream():
        yield "model.layers.2.mlp.experts.3.up_proj.weight", torch.zeros(32, 64)
        yield "model.layers.2.mlp.experts.5.gate_proj.weight", torch.zeros(32, 64)
        raise ConnectionError("trainer went away")

    with pytest.raises(RuntimeError, match=rf"after writing 1 tensor \({fused}\)"):
        engine.update_weights(stream())
    with pytest.raises(RuntimeError, match=f"1 weight is not usable \\({fused}\\)"):
        engine.generate(input_ids=[[1, 2]])
    engine.update_weights([("model.layers.2.mlp.experts.3.up_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(RuntimeError, match="not usable"):  # expert 5's gate rows are still a mix
        engine.generate(input_ids=[[1, 2]])
    engine.update_weights([(f"model.layers.2.mlp.experts.{e}.gate_proj.weight", torch.zeros(32, 64))
                           for e in range(4, 8)])
    engine.generate(input_ids=[[1, 2]])  # every written unit written again: valid (if changed) weights
    engine.update_weights([(fused, dict(hf.named_parameters())[fused])])  # the whole tensor, as it was
    assert _outputs(engine) == want
