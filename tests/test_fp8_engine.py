"""quantization="fp8" on the CPU: the engine's fp8 path is the reference
arithmetic the GPU path is held to (layers/fp8_linear.py), checked here
against Hugging Face models whose quantized linear layers are replaced by
what fp8 holds and computes: weights read back through their per-row scales,
inputs quantized per token. Updates in every form quantize into the same
storage (equal to a fresh engine on the new weights, bitwise), keep the
finiteness rule and atomicity, and checksums match the trainer's side."""
from __future__ import annotations

import pytest
import torch

from differential import Reference, fp8_oracle
from models import MOE, make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.fidelity import weights_checksum
from rollout_engine.kernels.fp8 import FP8
from rollout_engine.quantization import as_held, is_quantized

PROMPTS = [[5, 17, 3, 99, 250, 7], [1, 2, 3], list(range(40, 75))]
KINDS = ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    out = {}
    for kind in KINDS:
        hf = make_hf_model(kind, seed=3) if kind not in MOE else make_hf_model(kind, seed=5)
        out[kind] = (hf, save_model(hf, tmp_path_factory.mktemp(f"fp8-{kind}")))
    return out


def _engine(folder, **kw):
    return RolloutEngine(folder, device="cpu", max_total_tokens=2048, quantization="fp8",
                         **{"max_prefill_tokens": 16, **kw})


GREEDY = SamplingParams(max_new_tokens=10, temperature=0, logprobs=True, ignore_eos=True)


# Engine against the fp8 oracle, per token (teacher-forced on the engine's tokens). Mostly equal to a
# few ulps; where an fp32 rounding difference ahead of a per-token quantization moves one activation to the
# neighbouring e4m3 value, up to 0.072 nats on these tiny models (measured). fp8 itself moves them
# 0.08-0.2 nats on average from the unquantized model: the engine must be far nearer the oracle.
FLIP_TOL = 0.15
GREEDY_MARGIN = 0.05


def assert_near_oracle(outs, prompts, oracle: Reference, plain: Reference, tag, tol: float = FLIP_TOL,
                       margin: float = GREEDY_MARGIN, ratio: float = 0.1) -> None:
    """Engine outputs (greedy, with logprobs) against the fp8 oracle,
    teacher-forced on the engine's tokens: each token within `tol`, each
    greedy choice within `margin` of the oracle's best, and on average
    `ratio` (a tenth) as far from the oracle as from the unquantized model."""
    pairs = [(p, o.output_token_ids) for p, o in zip(prompts, outs)]
    to_oracle, to_plain = [], []
    for out, want, unquantized in zip(outs, oracle.output_logprobs(pairs), plain.output_logprobs(pairs)):
        ids = torch.tensor(out.output_token_ids)[:, None]
        got = torch.tensor(out.output_logprobs)
        chosen = want.gather(-1, ids).squeeze(1)
        to_oracle.append((got - chosen).abs())
        to_plain.append((got - unquantized.gather(-1, ids).squeeze(1)).abs())
        assert float((want.max(-1).values - chosen).max()) < margin, tag
    to_oracle, to_plain = torch.cat(to_oracle), torch.cat(to_plain)
    assert float(to_oracle.max()) < tol, (tag, float(to_oracle.max()))
    assert float(to_oracle.mean()) < ratio * float(to_plain.mean()), (tag, float(to_oracle.mean()))


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_engine_computes_what_fp8_holds(fp8_models, kind):
    """The engine against the fp32 oracle (`assert_near_oracle`) over a
    cache hit, chunked prefill (chunk 16 < a 35-token prompt) and n > 1;
    the quantized weights are e4m3 and the others stay in the engine dtype."""
    hf, folder = fp8_models[kind]
    engine = _engine(folder)
    oracle, plain = Reference(fp8_oracle(hf), "cpu"), Reference(hf, "cpu")
    params = SamplingParams(max_new_tokens=16, temperature=0, logprobs=True, ignore_eos=True)
    for rep in range(2):  # the second call hits the prefix cache
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert_near_oracle(outs, PROMPTS, oracle, plain, (kind, rep))
    fork = engine.generate(input_ids=PROMPTS[:1], sampling_params=SamplingParams(
        n=3, max_new_tokens=16, temperature=0, ignore_eos=True))
    assert all(o.output_token_ids == outs[0].output_token_ids for o in fork)
    params = dict(engine.core.parts.model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    assert params["model.layers.0.self_attn.qkv_proj.weight_scale"].dtype == torch.float32
    assert params["model.embed_tokens.weight"].dtype == torch.float32
    assert not any(p.dtype == FP8 for n, p in params.items() if "norm" in n or n.endswith("mlp.gate.weight"))
    experts = [n for n in params if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert bool(experts) == (kind in MOE) and all(params[n].dtype == FP8 for n in experts)
    assert all(params[f"{n}_scale"].dtype == torch.float32 for n in experts)
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("kind", ["qwen2", "qwen2_moe"])
def test_checksums_and_get_weight_show_the_quantized_weights(fp8_models, kind):
    """The engine's checksums equal the trainer's side with quantization="fp8"
    (and differ from it without, for the quantized names only); get_weight
    gives the values fp8 holds, in the engine dtype."""
    hf, folder = fp8_models[kind]
    engine = _engine(folder)
    state = hf.state_dict()
    theirs = weights_checksum(state, torch.float32, quantization="fp8")
    ours = engine.weights_checksum()
    assert ours == {n: theirs[n] for n in ours}
    plain = weights_checksum(state, torch.float32)
    differ = {n for n in ours if ours[n] != plain[n]}
    assert differ and differ == {n for n in ours if is_quantized(n, "fp8")}
    name = "model.layers.1.mlp.down_proj.weight" if kind == "qwen2" else \
        "model.layers.1.mlp.shared_expert.down_proj.weight"
    got = engine.get_weight(name)
    assert got.dtype == torch.float32 and torch.equal(got, as_held(state[name], torch.float32))
    fused = engine.get_weight("model.layers.0.self_attn.qkv_proj.weight")  # a fused parameter by its own name
    parts = [state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(fused, torch.cat([as_held(p, torch.float32) for p in parts]))
    with pytest.raises(ValueError, match="quantization"):
        weights_checksum(state, torch.float32, quantization="int4")
    engine.shutdown()


def test_updates_in_every_form_equal_a_fresh_engine(fp8_models, tmp_path):
    """list, dict, generator and disk updates quantize into the same storage:
    the weights (checksums) and outputs of a fresh fp8 engine on the new
    weights, bitwise."""
    hf, folder = fp8_models["qwen3"]
    new = make_hf_model("qwen3", seed=11)
    new_folder = save_model(new, tmp_path / "new")
    fresh = _engine(new_folder)
    want_sums, want = fresh.weights_checksum(), fresh.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    fresh.shutdown()
    engine = _engine(folder)
    state = new.state_dict()
    for form in ("list", "dict", "stream", "disk"):
        engine.update_weights(list(make_hf_model("qwen3", seed=3).state_dict().items()))  # back to the old
        if form == "list":
            engine.update_weights(list(state.items()))
        elif form == "dict":
            engine.update_weights(dict(state))
        elif form == "stream":
            engine.update_weights((n, t) for n, t in state.items())
        else:
            engine.update_weights_from_disk(new_folder)
        assert engine.weights_checksum() == want_sums, form
        got = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want], form
        assert [o.output_logprobs for o in got] == [o.output_logprobs for o in want], form
    engine.shutdown()


def test_a_non_finite_update_is_refused_whole_or_named(fp8_models):
    """e4m3 holds no infinity: a NaN or inf source would show only in its
    scale. A list with one is refused before anything is copied (weights
    unchanged); a stream names the tensor; the engine serves afterwards."""
    from rollout_engine.weights.updater import IncompleteUpdate
    from rollout_engine.layers.weight_copy import NonFiniteWeights

    hf, folder = fp8_models["llama"]
    engine = _engine(folder)
    before = engine.weights_checksum()
    good = engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)[0]
    state = dict(hf.state_dict())
    for value in (float("inf"), float("nan")):
        bad = state["model.layers.0.mlp.down_proj.weight"].clone()
        bad[3, 5] = value
        items = [(n, bad if n == "model.layers.0.mlp.down_proj.weight" else t) for n, t in state.items()]
        version = engine.weight_version
        with pytest.raises(NonFiniteWeights, match="model.layers.0.mlp.down_proj.weight.*refused"):
            engine.update_weights(items)
        assert engine.weights_checksum() == before and engine.weight_version == version
        again = engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)[0]
        assert again.output_token_ids == good.output_token_ids
        with pytest.raises((NonFiniteWeights, IncompleteUpdate), match="model.layers.0.mlp.down_proj.weight"):
            engine.update_weights(iter(items))
        with pytest.raises(RuntimeError):  # written tensors are marked: no generation on mixed weights
            engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
        engine.update_weights(list(state.items()))
        assert engine.weights_checksum() == before
    engine.shutdown()


def test_dummy_fp8_weights_are_the_quantized_dummy_weights():
    """load_format="dummy": an fp8 engine holds the quantized draw of the
    weights the same engine without quantization gets, so fp8 and bf16
    benchmarks run on the same model."""
    plain = RolloutEngine("qwen3-moe-mini", load_format="dummy", device="cpu", max_total_tokens=256)
    fp8 = RolloutEngine("qwen3-moe-mini", load_format="dummy", device="cpu", max_total_tokens=256,
                        quantization="fp8")
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(fp8.get_weight(name), as_held(plain.get_weight(name), torch.float32))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.3.down_proj.weight"):
        assert torch.equal(fp8.get_weight(name), as_held(plain.get_weight(name), torch.float32))
    plain.shutdown()
    fp8.shutdown()


@pytest.mark.parametrize("kw,field", [(dict(quantization="int8"), "quantization"),
                                      (dict(quantization="fp8", deterministic=True), "quantization"),
                                      (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype")])
def test_bad_quantization_options_name_the_field(llama, kw, field):
    with pytest.raises(ValueError, match=field):
        RolloutEngine(llama[1], device="cpu", max_total_tokens=256, **kw)


def test_a_quantization_in_capitals_is_told_the_name(llama):
    with pytest.raises(ValueError, match=r"quantization must be None or one of \('fp8',\) \(did you mean 'fp8'\?\)"):
        RolloutEngine(llama[1], device="cpu", max_total_tokens=256, quantization="FP8")


def _fp8_checkpoint(hf, folder, drop: str | None = None) -> str:
    """`hf` saved as FP8 checkpoints are: the quantized weights (experts
    too) in e4m3 with 128x128 block scales beside them."""
    import json
    import os

    from safetensors.torch import save_file

    from rollout_engine.kernels.fp8 import quantize_blocks

    tensors = {}
    for name, t in hf.state_dict().items():
        if is_quantized(name, "fp8") or ".experts." in name and t.dim() == 2:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t)
        else:
            tensors[name] = t.contiguous()
    if drop:
        del tensors[drop]
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


def test_fp8_checkpoints_load_in_fp8_and_in_full_precision(fp8_models, tmp_path):
    """An FP8 checkpoint (e4m3 weights, `weight_scale_inv` block scales):
    an fp32 engine holds its values read back through the blocks, exactly;
    an fp8 engine holds them re-quantized into its per-row layout; both
    load from disk and as an update, and a weight missing its scales (or
    scales without a weight) is a ValueError naming it, nothing copied."""
    from rollout_engine.kernels.fp8 import dequantize_blocks, quantize_blocks

    hf, _ = fp8_models["qwen3"]
    folder = _fp8_checkpoint(hf, tmp_path / "ckpt")
    name = "model.layers.1.self_attn.o_proj.weight"
    blocks = dequantize_blocks(*quantize_blocks(hf.state_dict()[name]))
    full = RolloutEngine(folder, device="cpu", max_total_tokens=512)
    assert torch.equal(full.get_weight(name), blocks)
    fp8 = _engine(folder)
    assert torch.equal(fp8.get_weight(name), as_held(blocks, torch.float32))
    assert fp8.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # serves
    full.update_weights(list(hf.state_dict().items()))
    full.update_weights_from_disk(folder)
    assert torch.equal(full.get_weight(name), blocks)
    for drop in (name, name + "_scale_inv"):
        bad = _fp8_checkpoint(hf, tmp_path / drop, drop=drop)
        before = fp8.weights_checksum()
        with pytest.raises(ValueError, match=name):
            fp8.update_weights_from_disk(bad)
        assert fp8.weights_checksum() == before
        with pytest.raises(ValueError, match=name):
            _engine(bad)
    full.shutdown()
    fp8.shutdown()


def test_the_memory_check_counts_fp8_weights_at_one_byte(monkeypatch):
    """A model whose bf16 weights do not fit but whose fp8 weights do is
    loaded in fp8, not refused (the check counts what fp8 holds)."""
    from rollout_engine.distributed.comm import TPComm
    from rollout_engine.models.config import ModelConfig
    from rollout_engine.runner import model_loader

    mc = ModelConfig.from_hf(*model_loader.read_hf_config("llama-3.1-8b"))
    monkeypatch.setattr(model_loader, "available_bytes", lambda device: 9 * 2**30)
    with pytest.raises(ValueError, match="needs 15.0 GiB"):
        model_loader.check_fits("llama-3.1-8b", mc, TPComm(), torch.device("cpu"), torch.bfloat16)
    model_loader.check_fits("llama-3.1-8b", mc, TPComm(), torch.device("cpu"), torch.bfloat16, "fp8")  # 8.5 GiB
