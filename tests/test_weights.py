"""HF names onto fused parameters; errors for unknown and missing weights."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_engine.distributed.comm import TPComm
from rollout_engine.models.config import ModelConfig
from rollout_engine.runner.model_loader import build_model, read_hf_config
from rollout_engine.weights.loader import WeightLoader, iter_safetensors


def _fresh(folder):
    hf, eos = read_hf_config(folder)
    return build_model(ModelConfig.from_hf(hf, eos), TPComm(), torch.device("cpu"), torch.float32)


def test_fused_params_hold_the_hf_tensors(tiny_models):
    hf, folder = tiny_models[("qwen2", True)]
    model = _fresh(folder)
    WeightLoader(model).load_folder(folder)
    sd = hf.state_dict()
    qkv = model.model.layers[1].self_attn.qkv_proj
    q, k, v = (sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(qkv.weight, torch.cat([q, k, v]))
    assert torch.equal(qkv.bias, torch.cat([sd[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"]))
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]]))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one storage


def test_loading_copies_in_place(llama):
    _, folder = llama
    model = _fresh(folder)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    WeightLoader(model).load_folder(folder)
    assert before == {n: p.data_ptr() for n, p in model.named_parameters()}


def test_unknown_name_and_bad_shape_are_value_errors(llama):
    _, folder = llama
    loader = WeightLoader(_fresh(folder))
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.foo.weight'"):
        loader.load([("model.layers.0.foo.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight: shape mismatch"):
        loader.load([("model.norm.weight", torch.zeros(3))])


def test_an_unknown_name_says_what_is_nearest(llama):
    _, folder = llama
    loader = WeightLoader(_fresh(folder))
    cases = [("model.layers.2.mlp.down_proj.weight", "layer index 2 is out of range (num_hidden_layers=2)"),
             ("model.layers.1.self_attn.q_proj.weights", "did you mean 'model.layers.1.self_attn.q_proj.weight'?"),
             ("model.layers.0.mlp.experts.gate_up_proj", "layer 0 has a dense MLP (no experts)")]
    for name, words in cases:
        with pytest.raises(ValueError) as e:
            loader.load([(name, torch.zeros(1))])
        assert str(e.value) == f"unknown weight name {name!r}: {words}" or str(e.value).endswith(words), str(e.value)
    with pytest.raises(ValueError) as e:
        loader.load([("something.else", torch.zeros(1))])
    assert str(e.value) == "unknown weight name 'something.else'"


def test_full_names_cover_the_checkpoint(tiny_models):
    for hf, folder in tiny_models.values():
        names = set(WeightLoader(_fresh(folder)).full_names())
        ckpt = {n for n, _ in iter_safetensors(folder)}
        assert names == ckpt - {"lm_head.weight"} or names == ckpt


def test_missing_weights_are_reported(tmp_path, llama):
    from rollout_engine import RolloutEngine

    _, folder = llama
    import shutil

    shutil.copytree(folder, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights for .*model.norm.weight"):
        RolloutEngine(str(tmp_path / "m"))


def test_dummy_preset_has_real_shapes():
    hf, _ = read_hf_config("qwen3-0.6b")
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.qk_norm, cfg.tie_word_embeddings) == (128, 8, True, True)
    llama = ModelConfig.from_hf(read_hf_config("llama-3.1-8b")[0])
    assert llama.rope.scaling_type == "llama3" and llama.eos_token_ids == (128001, 128008, 128009)
