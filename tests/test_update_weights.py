"""Hot-swapping weights in place: in-process tensors and safetensors folders."""
from __future__ import annotations

import pytest
import torch

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams

PARAMS = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], list(range(50, 80))]


@pytest.fixture(scope="module")
def second_llama(tmp_path_factory):
    hf = make_hf_model("llama", tie=False, seed=7)
    return hf, save_model(hf, tmp_path_factory.mktemp("llama-b"))


def _tokens(engine):
    return [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


@pytest.mark.parametrize("as_generator", [False, True])
def test_update_equals_a_fresh_engine_of_the_new_model(llama, second_llama, as_generator):
    (_, folder_a), (hf_b, folder_b) = llama, second_llama
    engine = RolloutEngine(folder_a, max_total_tokens=4096)
    before = _tokens(engine)
    ptrs = {n: p.data_ptr() for n, p in engine.core.parts.model.named_parameters()}
    state = {n: t.double() for n, t in hf_b.state_dict().items()}  # dtype conversion on the way in
    version = engine.update_weights(iter(state.items()) if as_generator else state)
    assert version == 1 == engine.weight_version
    assert {n: p.data_ptr() for n, p in engine.core.parts.model.named_parameters()} == ptrs  # in place
    assert engine.cache_stats()["cached_tokens"] == 0  # old KV dropped
    after = _tokens(engine)
    assert after == _tokens(RolloutEngine(folder_b, max_total_tokens=4096)) != before
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert all(o.weight_version == 1 for o in outs)


def test_from_disk_and_explicit_version(llama, second_llama):
    (_, folder_a), (_, folder_b) = llama, second_llama
    engine = RolloutEngine(folder_a, max_total_tokens=4096)
    assert engine.update_weights_from_disk(folder_b, version=42) == 42
    assert _tokens(engine) == _tokens(RolloutEngine(folder_b, max_total_tokens=4096))
    with pytest.raises(ValueError, match="not a folder"):
        engine.update_weights_from_disk(folder_b + "-missing")


def test_partial_update_and_get_weight(llama, second_llama):
    (hf_a, folder_a), (hf_b, _) = llama, second_llama
    engine = RolloutEngine(folder_a, max_total_tokens=4096)
    name = "model.layers.1.self_attn.k_proj.weight"
    new = hf_b.state_dict()[name]
    engine.update_weights([(name, new)])
    assert torch.equal(engine.get_weight(name), new)
    for other in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        assert torch.equal(engine.get_weight(other), hf_a.state_dict()[other])


def test_bad_name_or_shape_changes_nothing(llama, second_llama):
    (_, folder_a), (hf_b, _) = llama, second_llama
    engine = RolloutEngine(folder_a, max_total_tokens=4096)
    before = _tokens(engine)
    q = engine.get_weight("model.layers.0.self_attn.q_proj.weight")
    good = list(hf_b.state_dict().items())
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.bogus.weight'"):
        engine.update_weights(good + [("model.layers.0.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight: shape mismatch"):
        engine.update_weights(good[:3] + [("model.norm.weight", torch.zeros(3))])
    assert engine.weight_version == 0
    assert torch.equal(engine.get_weight("model.layers.0.self_attn.q_proj.weight"), q)
    assert _tokens(engine) == before


WRONG_SIZES = [  # (name, how the tensor is made wrong): every loader that slices its part of the full tensor
    ("model.layers.0.self_attn.q_proj.weight", "rows"), ("model.layers.0.self_attn.k_proj.weight", "columns"),
    ("model.layers.1.self_attn.v_proj.weight", "fewer rows"), ("model.layers.0.self_attn.o_proj.weight", "columns"),
    ("model.layers.0.mlp.gate_proj.weight", "rows"), ("model.layers.1.mlp.up_proj.weight", "fewer rows"),
    ("model.layers.0.mlp.down_proj.weight", "columns"), ("model.layers.1.mlp.down_proj.weight", "transposed"),
    ("model.layers.0.self_attn.q_proj.bias", "rows"), ("model.layers.1.self_attn.k_proj.bias", "fewer rows"),
]


def _wrong(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "rows":
        return torch.cat([t, t[:1]])
    if how == "fewer rows":
        return t[1:]
    if how == "columns":
        return torch.cat([t, t], dim=1)
    return t.t()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_tensor_of_another_size_is_refused_not_cut_to_fit(tiny_models, quantization):
    """A tensor larger than the weight used to be cut to its size (the
    loaders slice this rank's rows or columns of the full tensor), and a
    smaller one failed with torch's slicing message. Both are refused with
    the expected and given shapes, as is an integer tensor (it was cast);
    nothing copied, the engine unchanged."""
    hf, folder = tiny_models[("qwen2", True)]  # qwen2: biases on q, k and v
    engine = RolloutEngine(folder, max_total_tokens=2048, quantization=quantization)
    before = _tokens(engine)
    state = hf.state_dict()
    for name, how in WRONG_SIZES:
        bad = _wrong(state[name], how)
        expected = tuple(state[name].shape)
        with pytest.raises(ValueError, match=rf"{name}: shape mismatch: expected \({expected[0]},") as e:
            engine.update_weights([(name, bad)])
        assert str(tuple(bad.shape)) in str(e.value), e.value
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=f"{name}: expected a floating-point tensor, got torch.int64"):
        engine.update_weights([(name, state[name].long())])
    meta = dict(state, **{name: torch.empty(state[name].shape, device="meta")})  # refused before any copy
    with pytest.raises(ValueError, match=f"{name}: a tensor on the meta device holds no values"):
        engine.update_weights(meta)
    assert engine.weight_version == 0 and _tokens(engine) == before  # nothing marked invalid either
    assert engine.weight_version == 0 and _tokens(engine) == before
    engine.update_weights(state)  # the right sizes still go in
    assert engine.weight_version == 1 and _tokens(engine) == before


def test_a_broken_stream_blocks_generation_until_complete(llama, second_llama):
    (_, folder_a), (hf_b, folder_b) = llama, second_llama
    engine = RolloutEngine(folder_a, max_total_tokens=4096)

    def stream():
        yield from list(hf_b.state_dict().items())[:5]
        yield "model.layers.0.bogus.weight", torch.zeros(1)

    with pytest.raises(ValueError, match="unknown weight name"):
        engine.update_weights(stream())
    with pytest.raises(RuntimeError, match="are not usable"):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    engine.update_weights(iter(hf_b.state_dict().items()))
    assert _tokens(engine) == _tokens(RolloutEngine(folder_b, max_total_tokens=4096))


def test_a_tied_models_lm_head_is_checked_not_dropped_unseen(tiny_models):
    """A tied model's lm_head.weight is written nowhere (the embedding is the
    head), but a wrong one is refused as the embedding's would be: shape,
    dtype, values; whole updates and streamed ones alike."""
    hf, folder = tiny_models[("qwen2", True)]
    engine = RolloutEngine(folder, max_total_tokens=2048)
    before = _tokens(engine)
    head = hf.state_dict()["lm_head.weight"]
    for bad, words in ((torch.zeros(3, 3), r"lm_head.weight: shape mismatch: expected \(512, 64\), got \(3, 3\)"),
                       (head.long(), "lm_head.weight: expected a floating-point tensor"),
                       (torch.full_like(head, float("nan")), "lm_head.weight: holds NaN or infinite values")):
        with pytest.raises(ValueError, match=words):
            engine.update_weights({"lm_head.weight": bad})
    with pytest.raises(ValueError, match="lm_head.weight: holds NaN or infinite values"):
        engine.update_weights(iter([("lm_head.weight", torch.full_like(head, float("inf")))]))
    assert engine.weight_version == 0 and _tokens(engine) == before
    engine.update_weights(hf.state_dict())  # with its lm_head.weight, as a tied model's state_dict has it
    assert engine.weight_version == 1 and _tokens(engine) == before


def test_tied_model_takes_the_embedding(tiny_models):
    hf, folder = tiny_models[("qwen2", True)]
    engine = RolloutEngine(folder, max_total_tokens=2048)
    emb = torch.randn_like(hf.state_dict()["model.embed_tokens.weight"])
    engine.update_weights([("model.embed_tokens.weight", emb), ("lm_head.weight", emb)])
    assert torch.equal(engine.get_weight("lm_head.weight"), emb)
    assert engine.core.parts.model.lm_head.weight is engine.core.parts.model.model.embed_tokens.weight


def test_each_token_carries_the_weight_version_that_produced_it(llama):
    from models import make_hf_model

    _, folder = llama
    engine = RolloutEngine(folder, device="cpu", max_total_tokens=1024)
    new = make_hf_model("llama", seed=7)
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    stream = engine.stream(input_ids=[[1, 2, 3, 4]], sampling_params=params)
    tokens, versions = [], []
    for k, delta in enumerate(stream):
        tokens += delta.output_token_ids
        versions += delta.output_weight_versions
        if k == 5:  # mid-rollout: hold the request, swap the weights, go on
            engine.pause_generation("keep")
            engine.update_weights(new.state_dict())
            engine.continue_generation()
    assert len(versions) == len(tokens) == 30
    switch = versions.index(1)
    assert 0 < switch < 30 and versions == [0] * switch + [1] * (30 - switch)
    whole = engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params=params)[0]
    assert whole.output_weight_versions == [1] * 30 and whole.weight_version == 1
