"""Routing replay in a Hugging Face trainer (tiny random MoE models, fp32,
CPU): replaying a model's own routing changes nothing; a forced routing is
the one the experts get, with gate weights from the trainer's router over
those experts (so a perturbed router stays close to the sampler and its
weights get gradients); positions past each row's array route freely; bad
arrays, batches and models are refused by name, and every router is itself
again after the context, whatever happened inside."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models import MOE, make_hf_model
from rollout_engine.integrations.routing_replay import agreement, moe_blocks, replay

KINDS = sorted(MOE)
ROW_LENS = [10, 7, 4, 9]  # tokens per right-padded row; the engine routed all but the last
DTYPES = [np.uint8, np.int16, np.int32, np.int64]
RENORMALISES = {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True, "olmoe": False}


@pytest.fixture(scope="module")
def models():
    return {kind: make_hf_model(kind, seed=7) for kind in KINDS}


def _batch(vocab_size: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(ROW_LENS), max(ROW_LENS), dtype=torch.long)
    for i, n in enumerate(ROW_LENS):
        ids[i, :n] = torch.randint(1, vocab_size, (n,), generator=gen)
    return ids


def _run(model, input_ids) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Logits and, per MoE layer, [B, S, ...] views of what its router computed
    ("router_logits") and what its experts were given ("ids", "weights")."""
    seen: list[dict[str, torch.Tensor]] = []
    handles = []
    for block in moe_blocks(model):
        handles.append(block.gate.register_forward_hook(lambda m, a, out: seen.append({"router_logits": out[0]})))
        handles.append(block.experts.register_forward_pre_hook(
            lambda m, args: seen[-1].update(ids=args[1], weights=args[2])))
    try:
        logits = model(input_ids).logits
    finally:
        for h in handles:
            h.remove()
    batch, seq_len = input_ids.shape
    return logits, [{k: v.reshape(batch, seq_len, -1) for k, v in layer.items()} for layer in seen]


def _arrays(layers, shift: int = 0, num_experts: int = 1) -> list[np.ndarray]:
    """What the engine would return: per row [n_i, moe_layers, k], n_i = row
    length - 1, in mixed integer dtypes; `shift` moves every id to another
    expert (a permutation, so no token gets one expert twice)."""
    ids = torch.stack([layer["ids"] for layer in layers], dim=2)
    ids = (ids + shift) % num_experts if shift else ids
    return [ids[i, : n - 1].numpy().astype(DTYPES[i % 4]) for i, n in enumerate(ROW_LENS)]


def _assert_unpatched(model) -> None:
    for block in moe_blocks(model):
        assert "forward" not in block.gate.__dict__ and not block._forward_pre_hooks


def _next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Logprobs of every row's next tokens, at the positions the engine routed."""
    lps = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([lps[i, : n - 1] for i, n in enumerate(ROW_LENS)])


@pytest.mark.parametrize("kind", KINDS)
def test_replaying_the_models_own_routing_changes_nothing(models, kind):
    model, input_ids = models[kind], _batch()
    with torch.no_grad():
        free, layers = _run(model, input_ids)
        wrapped = torch.nn.ModuleDict({"_orig_mod": model})  # found by walking modules
        with replay(wrapped, _arrays(layers)):
            first = model(input_ids).logits
            second = model(input_ids).logits
    assert len(layers) == {"qwen3_moe": 2, "qwen2_moe": 1, "mixtral": 2, "olmoe": 2}[kind]  # dense layers skipped
    assert torch.allclose(first, free, atol=1e-5) and torch.allclose(second, free, atol=1e-5)
    _assert_unpatched(model)


def test_rows_may_come_as_a_stack_or_an_array_of_row_objects(models):
    """Rows of one length stacked into one 4-d array, or rows of any length in
    a 1-d object array (a dataframe column's values), are rows alike."""
    model, input_ids = models["qwen3_moe"], _batch()
    with torch.no_grad():
        free, layers = _run(model, input_ids)
        rows = _arrays(layers)
        objects = np.empty(len(rows), dtype=object)
        objects[:] = rows
        shortest = min(len(r) for r in rows)
        for given in (objects, np.stack([r[:shortest] for r in rows])):  # past an array, routing is free
            with replay(model, given):
                assert torch.allclose(model(input_ids).logits, free, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_forced_routing_is_used_with_the_trainers_gate_weights(models, kind):
    model, input_ids = models[kind], _batch()
    num_experts = moe_blocks(model)[0].gate.num_experts
    with torch.no_grad():
        free, layers = _run(model, input_ids)
        forced = _arrays(layers, shift=1, num_experts=num_experts)
        with replay(model, forced):
            logits, replayed = _run(model, input_ids)
    assert (logits - free).abs().max() > 1e-2
    for layer, seen in enumerate(replayed):
        for i, n in enumerate(ROW_LENS):
            want = torch.from_numpy(forced[i][:, layer].astype(np.int64))
            got = seen["ids"][i, : n - 1]
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)
            probs = torch.softmax(seen["router_logits"][i, : n - 1].float(), dim=-1).gather(-1, got)
            if RENORMALISES[kind]:
                probs = probs / probs.sum(-1, keepdim=True)
            assert torch.allclose(seen["weights"][i, : n - 1], probs, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_replay_keeps_a_drifted_router_close_and_trains_it(models, kind):
    model, input_ids = models[kind], _batch()
    with torch.no_grad():
        ref_logits, ref_layers = _run(model, input_ids)
    reference = _next_token_logprobs(ref_logits, input_ids)
    drifted = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for block in moe_blocks(drifted):
            block.gate.weight.add_(torch.randn_like(block.gate.weight) * 0.3 * block.gate.weight.std())
        free, free_layers = _run(drifted, input_ids)
    assert any(not torch.equal(a["ids"], b["ids"]) for a, b in zip(free_layers, ref_layers))  # routing flipped
    with replay(drifted, _arrays(ref_layers)):
        logits = drifted(input_ids).logits
        replayed = _next_token_logprobs(logits, input_ids)
        (-replayed.sum()).backward()
    free_gap = (_next_token_logprobs(free, input_ids) - reference).abs().mean()
    replay_gap = (replayed.detach() - reference).abs().mean()
    # What is left is the drift of the gate weights over the same experts (large
    # in these peaked random routers); the flipped experts are gone.
    assert replay_gap < free_gap, (replay_gap, free_gap)
    for block in moe_blocks(drifted):
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_backward_inside_the_context_with_gradient_checkpointing_sees_the_same_routing():
    input_ids = _batch()
    grads = []
    for checkpointing in (False, True):
        model = make_hf_model("qwen3_moe", seed=7).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        with torch.no_grad():
            _, layers = _run(model, input_ids)
        with replay(model, _arrays(layers, shift=3, num_experts=8)):
            _next_token_logprobs(model(input_ids).logits, input_ids).sum().backward()
        grads.append([b.gate.weight.grad for b in moe_blocks(model)])
    for plain, recomputed in zip(*grads):
        assert torch.allclose(plain, recomputed, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_positions_past_each_array_route_freely(models, kind):
    model, input_ids = models[kind], _batch()
    num_experts = moe_blocks(model)[0].gate.num_experts
    with torch.no_grad():
        _, free = _run(model, input_ids)
        with replay(model, _arrays(free)):
            _, own = _run(model, input_ids)
        with replay(model, _arrays(free, shift=1, num_experts=num_experts)):
            _, shifted = _run(model, input_ids)
    top_k = free[0]["ids"].shape[-1]
    for free_layer, own_layer, shifted_layer in zip(free, own, shifted):
        for i, n in enumerate(ROW_LENS):
            # the last token (position n - 1) and the padding after it
            assert torch.equal(own_layer["ids"][i, n - 1:], free_layer["ids"][i, n - 1:])
            free_choice = shifted_layer["router_logits"][i, n - 1:].topk(top_k, dim=-1).indices
            assert torch.equal(shifted_layer["ids"][i, n - 1:], free_choice)


def _break(kind: str):
    def edit(arrays, input_ids):
        if kind == "top_k":
            arrays[1] = arrays[1][:, :, :1]
        elif kind == "layers":
            arrays[2] = arrays[2][:, :1]
        elif kind == "out_of_range":
            arrays[0][4, 1, 0] = 8
        elif kind == "negative":
            arrays[1][0, 1, 1] = -1
        elif kind == "twice":
            arrays[3][2, 0, 1] = arrays[3][2, 0, 0]
        elif kind == "ndim":
            arrays[0] = arrays[0][:, 0]
        elif kind == "float":
            arrays[2] = arrays[2].astype(np.float32)
        elif kind == "missing":
            arrays[2] = None
        elif kind == "batch":
            arrays = arrays[:3]
        elif kind == "too_long":
            input_ids = input_ids[:, :6]
        elif kind == "one_array":  # one row's array where a list of them belongs
            arrays = arrays[0]
        return arrays, input_ids
    return edit


BAD = {
    "top_k": r"routed_experts\[1\]: top_k is 1, the model's num_experts_per_tok is 2",
    "layers": r"routed_experts\[2\]: moe_layers is 1, the model has 2 sparse MoE layers",
    "out_of_range": r"routed_experts\[0\]: expert id 8 at position 4, moe layer 1 is out of range \[0, 8\)",
    "negative": r"routed_experts\[1\]: expert id -1 at position 0, moe layer 1",
    "twice": r"routed_experts\[3\]: position 2, moe layer 0 names an expert twice",
    "ndim": r"routed_experts\[0\]: expected integer expert ids",
    "float": r"routed_experts\[2\]: expected integer expert ids .* float32",
    "missing": r"routed_experts\[2\] is None",
    "batch": r"the batch has 4 rows but routed_experts has 3 arrays",
    "too_long": r"routed_experts\[0\] covers 9 positions, the input has only 6",
    "one_array": r"routed_experts: expected one array per row of the batch, got one array of shape \(9, 2, 2\)",
}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("use", ["replay", "agreement"])
def test_bad_input_is_refused_by_name_and_leaves_the_model_unpatched(models, bad, use):
    """`replay` and `agreement` check the arrays alike: a wrong array is a
    ValueError naming it, never a silently wrong agreement."""
    model, input_ids = models["qwen3_moe"], _batch()
    with torch.no_grad():
        free, layers = _run(model, input_ids)
        arrays, ids = _break(bad)(_arrays(layers), input_ids)
        out = []
        with pytest.raises(ValueError, match=BAD[bad]):
            with replay(model, arrays) if use == "replay" else agreement(model, arrays, out):
                model(ids)
        assert out == []
        _assert_unpatched(model)
        assert torch.equal(model(input_ids).logits, free)
        out = []
        with agreement(model, _arrays(layers), out):  # its own routing: full agreement
            model(input_ids)
        assert out == [1.0]


def test_a_model_without_supported_moe_blocks_is_refused_naming_it():
    with pytest.raises(ValueError, match="does not support LlamaForCausalLM: supported architectures are "
                                         "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM, "
                                         "OlmoeForCausalLM"):
        with replay(make_hf_model("llama"), [np.zeros((3, 2, 2), np.int64)]):
            pass


def test_the_routers_are_restored_after_the_context_and_after_an_exception(models):
    model, input_ids = models["mixtral"], _batch()
    blocks = moe_blocks(model)
    users_patch = blocks[1].gate.forward  # someone else's instance-level forward is kept as it was
    blocks[1].gate.forward = users_patch
    with torch.no_grad():
        free, layers = _run(model, input_ids)
        with replay(model, _arrays(layers, shift=1, num_experts=4)):
            assert "forward" in blocks[0].gate.__dict__ and blocks[1].gate.forward is not users_patch
        assert "forward" not in blocks[0].gate.__dict__ and blocks[1].gate.forward is users_patch
        with pytest.raises(RuntimeError, match="inside"):
            with replay(model, _arrays(layers, shift=1, num_experts=4)):
                model(input_ids)
                raise RuntimeError("inside")
        assert blocks[1].gate.forward is users_patch
        del blocks[1].gate.forward
        _assert_unpatched(model)
        assert torch.equal(model(input_ids).logits, free)


def _left_padded(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The right-padded batch with each row's tokens moved to the end: (ids,
    attention_mask, position_ids), as a trainer that pads on the left has them."""
    seq_len = input_ids.shape[1]
    ids = torch.zeros_like(input_ids)
    mask = torch.zeros_like(input_ids)
    for i, n in enumerate(ROW_LENS):
        ids[i, seq_len - n:] = input_ids[i, :n]
        mask[i, seq_len - n:] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_rows_replay_from_their_first_real_token(models, kind):
    """With the batch's attention_mask, row i's array covers its real tokens
    wherever they start: the experts given are the forced ones there, and
    the next-token logprobs equal the right-padded batch's under the same
    replay; agreement with the model's own routing is 1.0."""
    model, input_ids = models[kind], _batch()
    num_experts = moe_blocks(model)[0].gate.num_experts
    left, mask, positions = _left_padded(input_ids)
    seq_len = input_ids.shape[1]
    with torch.no_grad():
        _, layers = _run(model, input_ids)
        forced = _arrays(layers, shift=1, num_experts=num_experts)
        with replay(model, forced):
            right_logits, _ = _run(model, input_ids)
        seen = []
        handles = [b.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1])) for b in moe_blocks(model)]
        try:
            with replay(model, forced, attention_mask=mask):
                left_logits = model(left, attention_mask=mask, position_ids=positions).logits
        finally:
            for h in handles:
                h.remove()
        out = []
        with agreement(model, _arrays(layers), out, attention_mask=mask):
            model(left, attention_mask=mask, position_ids=positions)
    assert out == [1.0]
    for layer, ids in enumerate(seen):
        ids = ids.reshape(len(ROW_LENS), seq_len, -1)
        for i, n in enumerate(ROW_LENS):
            want = torch.from_numpy(forced[i][:, layer].astype(np.int64)).sort(-1).values
            assert torch.equal(ids[i, seq_len - n: seq_len - 1].sort(-1).values, want)
    right = _next_token_logprobs(right_logits, input_ids)
    moved = torch.cat([torch.log_softmax(left_logits[i, seq_len - n: -1].float(), -1)
                       .gather(-1, left[i, seq_len - n + 1:, None])[:, 0] for i, n in enumerate(ROW_LENS)])
    torch.testing.assert_close(moved, right, atol=1e-4, rtol=0)


@pytest.mark.parametrize("use", ["replay", "agreement"])
def test_bad_attention_masks_are_refused_by_name(models, use):
    model, input_ids = models["qwen3_moe"], _batch()
    _, mask, _ = _left_padded(input_ids)
    with torch.no_grad():
        _, layers = _run(model, input_ids)
    arrays = _arrays(layers)
    holes = mask.clone()
    holes[2, -2] = 0
    short = mask.clone()
    short[1, -7:-3] = 0  # row 1: 7 tokens, its array covers 6; now 3 real tokens, one run at the end
    short[1, -3:] = 1
    cases = [(mask[:3], r"attention_mask: expected \[batch, seq\] with one row per array \(4\)"),
             (mask * 0.5, r"attention_mask: expected 1 for real tokens and 0 for padding, got \[0.0, 0.5\]"),
             (-mask, r"attention_mask: expected 1 for real tokens and 0 for padding, got \[-1, 0\]"),
             (np.array([["a"] * mask.shape[1]] * 4), r"attention_mask: expected 1 for real tokens .* got <U1"),
             (holes, r"attention_mask\[2\]: its real tokens are not one run"),
             (short, r"routed_experts\[1\] covers 6 positions, attention_mask\[1\] has 3 real tokens")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            with replay(model, arrays, attention_mask=bad) if use == "replay" else agreement(model, arrays, [],
                                                                                              attention_mask=bad):
                pass
        _assert_unpatched(model)
    # another batch's mask: one zero column more on the left moves every row's start by one
    wider = torch.cat([torch.zeros(len(ROW_LENS), 1, dtype=mask.dtype), mask], dim=1)
    left, _, positions = _left_padded(input_ids)
    with pytest.raises(ValueError, match="attention_mask has 11 columns but the input has 10"):
        with torch.no_grad():
            with replay(model, arrays, attention_mask=wider) if use == "replay" else agreement(
                    model, arrays, [], attention_mask=wider):
                model(left, attention_mask=mask, position_ids=positions)
    _assert_unpatched(model)
