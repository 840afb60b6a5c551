"""quantization="fp8" for MoE models on the CPU: the experts held in e4m3
with one scale a row, under either naming (transformers 5's fused tensors,
the checkpoints' per-expert ones, Mixtral's w1/w3/w2), through every load
and update path: equal to a fresh fp8 engine on the new weights, bitwise;
checksums and get_weight as the trainer's side computes them; non-finite
values refused by name; FP8 checkpoints' block-scaled experts re-quantized
into the engine's layout."""
from __future__ import annotations

import pytest
import torch

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.fidelity import weights_checksum
from rollout_engine.kernels.fp8 import FP8
from rollout_engine.quantization import as_held
from test_moe import _per_expert

PROMPTS = [[5, 17, 3, 99, 250, 7], [1, 2, 3], list(range(40, 75))]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, logprobs=True, ignore_eos=True)


def _engine(folder, **kw):
    return RolloutEngine(folder, device="cpu", max_total_tokens=2048, quantization="fp8", **kw)


def _run(engine):
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [o.output_token_ids for o in outs], [o.output_logprobs for o in outs]


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """Per kind: (old model, its folder, new model, the fresh fp8 engine's
    (checksums, outputs) on the new weights)."""
    out = {}
    for kind in ("qwen3_moe", "mixtral"):
        old, new = make_hf_model(kind, seed=5), make_hf_model(kind, seed=9)
        folder = save_model(old, tmp_path_factory.mktemp(f"{kind}-old"))
        new_folder = save_model(new, tmp_path_factory.mktemp(f"{kind}-new"))
        fresh = _engine(new_folder)
        out[kind] = (old, folder, new, new_folder, fresh.weights_checksum(), _run(fresh))
        fresh.shutdown()
    return out


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_updates_under_both_namings_equal_a_fresh_fp8_engine(moe_pair, kind):
    """Fused tensors (a trainer's named_parameters()), per-expert ones
    (Mixtral: w1/w3/w2), a streamed mix of both, and the disk: the fresh
    engine's checksums and outputs, bitwise; the experts stay e4m3."""
    old, folder, new, new_folder, want_sums, want = moe_pair[kind]
    engine = _engine(folder)
    params = dict(engine.core.parts.model.named_parameters())
    experts = [n for n in params if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and all(params[n].dtype == FP8 for n in experts)
    old_sums = engine.weights_checksum()
    assert old_sums != want_sums
    mixed = [(n, t) for i, (n, t) in enumerate(_per_expert(new)) if "experts." not in n or i % 2]
    mixed += [(n, t) for n, t in new.named_parameters() if "experts" in n]
    updates = {"fused": lambda: engine.update_weights(list(new.named_parameters())),
               "per-expert": lambda: engine.update_weights(_per_expert(new)),
               "mixed stream": lambda: engine.update_weights(pair for pair in mixed),
               "disk": lambda: engine.update_weights_from_disk(new_folder)}
    for form, update in updates.items():
        engine.update_weights_from_disk(folder)
        assert engine.weights_checksum() == old_sums, form
        update()
        assert engine.weights_checksum() == want_sums, form
        assert _run(engine) == want, form
    engine.check_integrity()
    engine.shutdown()


def test_checksums_and_get_weight_show_the_quantized_experts(moe_pair):
    """The engine's checksums equal the trainer's side with quantization=
    "fp8" on the fused tensors; get_weight gives what e4m3 holds, for the
    fused name and per expert (a slice of a row-quantized tensor is the
    quantized slice: each row has its own scale)."""
    old, folder, *_ = moe_pair["qwen3_moe"]
    engine = _engine(folder)
    trainer = dict(old.named_parameters())
    theirs = weights_checksum(trainer, torch.float32, quantization="fp8")
    ours = engine.weights_checksum()
    assert ours == {n: theirs[n] for n in ours}
    plain = weights_checksum(trainer, torch.float32)
    assert ours["model.layers.2.mlp.experts.gate_up_proj"] != plain["model.layers.2.mlp.experts.gate_up_proj"]
    fused, down = trainer["model.layers.2.mlp.experts.gate_up_proj"], trainer["model.layers.2.mlp.experts.down_proj"]
    inter = fused.shape[1] // 2
    assert torch.equal(engine.get_weight("model.layers.2.mlp.experts.gate_up_proj"), as_held(fused, torch.float32))
    assert torch.equal(engine.get_weight("model.layers.2.mlp.experts.5.up_proj.weight"),
                       as_held(fused[5, inter:], torch.float32))
    assert torch.equal(engine.get_weight("model.layers.2.mlp.experts.5.down_proj.weight"),
                       as_held(down[5], torch.float32))
    engine.shutdown()


def test_a_non_finite_expert_is_refused_by_name(moe_pair):
    """An infinity in a fused expert tensor, or NaN in one expert's tensor:
    a whole update is refused before any copy, naming the tensor; the
    engine's weights and outputs are unchanged."""
    from rollout_engine.layers.weight_copy import NonFiniteWeights

    old, folder, new, *_ = moe_pair["qwen3_moe"]
    engine = _engine(folder)
    before, outs = engine.weights_checksum(), _run(engine)
    fused = dict(new.named_parameters())
    bad = fused["model.layers.0.mlp.experts.down_proj"].detach().clone()
    bad[3, 7, 1] = float("inf")
    with pytest.raises(NonFiniteWeights, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*refused"):
        engine.update_weights([(n, bad if n.endswith("layers.0.mlp.experts.down_proj") else t)
                               for n, t in fused.items()])
    per_expert = _per_expert(new)
    name = "model.layers.2.mlp.experts.6.gate_proj.weight"
    nan = [(n, torch.full_like(t, float("nan")) if n == name else t) for n, t in per_expert]
    with pytest.raises(NonFiniteWeights, match=name.replace(".", r"\.")):
        engine.update_weights(nan)
    assert engine.weights_checksum() == before
    assert _run(engine)[0] == outs[0]  # tokens (the logprobs of a cache hit may differ in fp32's last bits)
    engine.shutdown()


def test_fp8_checkpoint_experts_load_requantized(moe_pair, tmp_path):
    """An FP8 checkpoint's per-expert tensors (e4m3 with 128x128 block
    scales beside them): an fp8 engine holds their values re-quantized
    into its per-row layout, as for the linear layers."""
    import json
    import os

    from safetensors.torch import save_file

    from rollout_engine.kernels.fp8 import dequantize_blocks, quantize_blocks

    old, *_ = moe_pair["qwen3_moe"]
    tensors = {}
    for name, t in _per_expert(old):
        if ".experts." in name or name.endswith(("proj.weight",)):
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t.detach())
        else:
            tensors[name] = t.detach().contiguous()
    os.makedirs(tmp_path / "ckpt")
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    config = old.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(tmp_path / "ckpt" / "config.json", "w") as f:
        json.dump(config, f)
    engine = _engine(str(tmp_path / "ckpt"))
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    blocks = dequantize_blocks(tensors[name], tensors[name + "_scale_inv"])
    assert torch.equal(engine.get_weight(name), as_held(blocks, torch.float32))
    assert engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    engine.shutdown()


def test_tp2_holds_the_experts_as_tp1_does(moe_pair):
    """tp_size 2 over gloo: each rank holds its slice of every expert, a down
    row's scale taken over the whole row, so the checksums (the trainer's
    side too) and get_weight equal tp_size 1's, under both namings."""
    old, folder, *_ = moe_pair["qwen3_moe"]
    name = "model.layers.2.mlp.experts.4.down_proj.weight"
    sums, held = [], []
    for tp in (1, 2):
        engine = _engine(folder, tp_size=tp)
        try:
            sums.append(engine.weights_checksum())
            held.append((engine.get_weight(name), engine.get_weight("model.layers.0.mlp.experts.gate_up_proj")))
        finally:
            engine.shutdown()
    theirs = weights_checksum(dict(old.named_parameters()), torch.float32, quantization="fp8")
    assert sums[0] == sums[1] == {n: theirs[n] for n in sums[0]}
    assert all(torch.equal(a, b) for a, b in zip(*held))
