"""The weight lifecycle: all-or-nothing list updates, exact invalidation of
updates that stop part-way, and no KV of other weights ever served."""
from __future__ import annotations

import warnings

import pytest
import torch

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.weights.updater import IncompleteUpdate

PARAMS = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 40)), list(range(100, 124))]


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    hf = make_hf_model("llama", tie=False, seed=5)
    return hf, save_model(hf, tmp_path_factory.mktemp("lifecycle-b"))


@pytest.fixture(scope="module")
def fresh_b_tokens(model_b):
    return _tokens(RolloutEngine(model_b[1], max_total_tokens=2048))


def _tokens(engine, prompts=PROMPTS):
    return [o.output_token_ids for o in engine.generate(input_ids=prompts, sampling_params=PARAMS)]


def _engine(llama):
    return RolloutEngine(llama[1], max_total_tokens=2048)


def test_one_nan_in_a_dict_changes_nothing_and_generation_goes_on(llama, model_b):
    engine = _engine(llama)
    before = _tokens(engine)  # also fills the prefix cache
    cached = engine.cache_stats()["cached_tokens"]
    state = dict(model_b[0].state_dict())
    name = "model.layers.1.mlp.down_proj.weight"
    old = engine.get_weight(name)
    state[name] = state[name].clone()
    state[name][3, 5] = float("nan")
    with pytest.raises(ValueError, match=f"{name}: holds NaN or infinite values; the update was refused"):
        engine.update_weights(state)
    assert engine.weight_version == 0 and engine.metrics()["invalid_weights"] == 0
    assert torch.equal(engine.get_weight(name), old)
    assert torch.equal(engine.get_weight("model.layers.0.self_attn.q_proj.weight"),
                       llama[0].state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert engine.cache_stats()["cached_tokens"] == cached  # the cache was kept: same weights
    assert _tokens(engine) == before
    assert all(o.num_cached_tokens > 0 for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS))
    # Rewriting that one tensor with good values is an ordinary update.
    assert engine.update_weights([(name, model_b[0].state_dict()[name])]) == 1
    assert len(engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)) == 2


def test_inf_after_the_cast_is_refused_too(llama):
    """A value finite in the source but not in the engine's dtype (float32
    here: 1e300 from float64) is caught by the check before copying."""
    engine = _engine(llama)
    name = "model.norm.weight"
    bad = torch.full_like(llama[0].state_dict()[name], 1e300, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"{name}: holds NaN"):
        engine.update_weights([(name, bad)])
    assert torch.equal(engine.get_weight(name), llama[0].state_dict()[name])


def test_a_stream_that_breaks_off_marks_exactly_what_it_wrote(llama, model_b):
    engine = _engine(llama)
    before = _tokens(engine)
    items = list(model_b[0].state_dict().items())
    written = [n for n, _ in items[:4]]
    old = [(n, engine.get_weight(n)) for n in written]

    def stream():
        yield from items[:4]
        raise ConnectionError("trainer went away")

    with pytest.raises(IncompleteUpdate) as info:
        engine.update_weights(stream())
    message = str(info.value)
    assert "trainer went away" in message and "writing 4 tensors" in message
    assert all(n in message for n in written) and sorted(info.value.written) == sorted(written)
    assert engine.weight_version == 0  # the version moves only on a complete update
    assert engine.metrics()["invalid_weights"] == 4
    with pytest.raises(RuntimeError, match="4 weights are not usable") as refused:
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert written[0] in str(refused.value)
    # Rewriting exactly those four (here: their old values) makes it generate again.
    assert engine.update_weights(old) == 1
    assert engine.metrics()["invalid_weights"] == 0
    assert _tokens(engine) == before


def test_a_bad_name_mid_stream_names_what_was_written(llama, model_b, fresh_b_tokens):
    engine = _engine(llama)
    items = list(model_b[0].state_dict().items())

    def stream():
        yield from items[:3]
        yield "model.layers.0.bogus.weight", torch.zeros(1)

    with pytest.raises(ValueError, match="unknown weight name .*writing 3 tensors"):
        engine.update_weights(stream())
    assert engine.metrics()["invalid_weights"] == 3
    engine.update_weights(iter(items))  # a complete update clears everything
    assert engine.weight_version == 1 and _tokens(engine) == fresh_b_tokens


def test_nan_in_a_stream_is_named_and_only_written_tensors_are_marked(llama, model_b):
    engine = _engine(llama)
    items = list(model_b[0].state_dict().items())[:5]
    bad_name = items[2][0]
    items[2] = (bad_name, torch.full_like(items[2][1], float("inf")))
    with pytest.raises(ValueError, match=f"{bad_name}: holds NaN.*writing 5 tensors"):
        engine.update_weights(iter(items))
    assert engine.metrics()["invalid_weights"] == 5
    assert engine.weight_version == 0


def test_the_prefix_cache_never_serves_kv_of_other_weights(llama, model_b, fresh_b_tokens):
    engine = _engine(llama)
    _tokens(engine)
    assert engine.cache_stats()["cached_tokens"] > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.update_weights(model_b[0].state_dict(), flush_cache=False)
    assert any(issubclass(w.category, DeprecationWarning) and "flush_cache" in str(w.message) for w in caught)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.output_token_ids for o in outs] == fresh_b_tokens
    engine.check_integrity()


def test_requests_running_across_an_update_do_not_cache_their_kv(llama, model_b, fresh_b_tokens):
    """A request held with its KV ("keep") while the weights change finishes
    on stale KV (as its output_weight_versions say); that KV is freed, never
    cached, so the same prompt afterwards is computed with the new weights."""
    engine = _engine(llama)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    stream = engine.stream(input_ids=PROMPTS, sampling_params=params)
    for k, _ in enumerate(stream):
        if k == 2:
            engine.pause_generation("keep")
            engine.update_weights(model_b[0].state_dict())
            engine.continue_generation()
    assert engine.cache_stats()["cached_tokens"] == 0
    engine.check_integrity()
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert [o.output_token_ids for o in outs] == fresh_b_tokens and [o.num_cached_tokens for o in outs] == [0, 0]
    assert engine.metrics()["kv_free_tokens"] + engine.cache_stats()["cached_tokens"] == \
        engine.metrics()["kv_capacity_tokens"]


def test_a_retracted_request_recomputes_its_kv_with_the_new_weights(llama, model_b):
    """Retracted across an update, a request's KV (parked in the prefix
    cache) is not matched again: it goes on from KV of the new weights, so
    its tokens after the switch equal a fresh engine on the new weights given
    the prompt plus the tokens made before the switch."""
    engine = _engine(llama)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    got, versions = [], []
    for k, delta in enumerate(engine.stream(input_ids=PROMPTS[:1], sampling_params=params)):
        got += delta.output_token_ids
        versions += delta.output_weight_versions
        if k == 3:
            engine.pause_generation("retract")
            engine.update_weights(model_b[0].state_dict())
            engine.continue_generation()
    split = versions.index(1)
    assert 0 < split < 16 and versions == [0] * split + [1] * (16 - split)
    fresh = RolloutEngine(model_b[1], max_total_tokens=2048)
    rest = fresh.generate(input_ids=[PROMPTS[0] + got[:split]],
                          sampling_params=SamplingParams(max_new_tokens=16 - split, temperature=0,
                                                         ignore_eos=True))[0].output_token_ids
    assert got[split:] == rest
    engine.check_integrity()


def test_bad_update_items_are_value_errors_naming_them(llama):
    import numpy as np

    engine = _engine(llama)
    with pytest.raises(ValueError, match="model.norm.weight: expected a torch.Tensor, got ndarray"):
        engine.update_weights({"model.norm.weight": np.ones(64, dtype=np.float32)})
    with pytest.raises(ValueError, match="named_tensors must be a dict or"):
        engine.update_weights("model.norm.weight")
    with pytest.raises(ValueError, match="update item 0 must be a \\(name, tensor\\) pair"):
        engine.update_weights([("model.norm.weight",)])
    assert engine.weight_version == 0 and engine.metrics()["invalid_weights"] == 0
    assert len(engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)) == 2


def test_an_interrupt_inside_a_stream_stays_an_interrupt_and_marks_what_was_written(llama, model_b):
    engine = _engine(llama)
    items = list(model_b[0].state_dict().items())

    def stream():
        yield items[0]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.update_weights(stream())
    assert engine.metrics()["invalid_weights"] == 1
    with pytest.raises(RuntimeError, match=f"1 weight is not usable \\({items[0][0]}\\)"):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)


def test_checksum_arguments(llama):
    from rollout_engine.distributed.weight_sync import WeightSyncGroup
    from rollout_engine.fidelity import weights_checksum

    hf, _ = llama
    engine = _engine(llama)
    names = ["model.norm.weight", "lm_head.weight"]
    assert engine.weights_checksum(n for n in names) == engine.weights_checksum(names)  # a generator, read once
    ours = weights_checksum({n: hf.state_dict()[n] for n in names}, "torch.float32")
    assert ours == engine.weights_checksum(names)
    for bad in (None, 5):
        with pytest.raises(ValueError, match="is not a torch dtype"):
            weights_checksum(ours, bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='gloo'"):
            WeightSyncGroup("127.0.0.1", 1, 0, 2, backend="nccl")
