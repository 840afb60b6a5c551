"""Weight checksums: the same digest for a whole tensor and any split of it,
on the engine (any tp_size) and on the trainer's tensors."""
from __future__ import annotations

import pytest
import torch

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine
from rollout_engine.fidelity import weights_checksum
from rollout_engine.kernels.checksum import block_sums_ref, digest, tensor_sums, words_per_row


def _digest(t):
    return digest(tuple(tensor_sums(t).tolist()))


@pytest.mark.parametrize("dtype,cols", [(torch.float32, 10), (torch.bfloat16, 12), (torch.float16, 7),
                                        (torch.bfloat16, 1)])
def test_blocks_add_up_to_the_whole(dtype, cols):
    torch.manual_seed(0)
    full = torch.randn(9, cols).to(dtype)
    per_word = 4 // full.element_size()
    w = words_per_row(cols, full.element_size())
    whole = block_sums_ref(full, w, 0, 0)
    # rows split at 4; columns split at a word boundary (the right part may end a row unevenly)
    cut = min(per_word * max(1, cols // (2 * per_word)), cols)
    parts = [block_sums_ref(full[r0:r1, c0:c1], w, r0, c0 // per_word)
             for r0, r1 in ((0, 4), (4, 9)) for c0, c1 in ((0, cut), (cut, cols)) if c1 > c0]
    assert torch.equal(sum(parts) & 0xFFFFFFFF, whole)


def test_a_changed_swapped_or_moved_value_changes_the_digest():
    torch.manual_seed(1)
    t = torch.randn(16, 16).to(torch.bfloat16)
    base = _digest(t)
    one = t.clone()
    one.view(torch.int16)[3, 4] ^= 1  # one bit
    swapped = t.clone()
    swapped[0, 0], swapped[5, 7] = t[5, 7], t[0, 0]
    assert len({base, _digest(one), _digest(swapped), _digest(t.t().contiguous()), _digest(t.float())}) == 5
    assert _digest(t.clone()) == base


def test_engine_and_trainer_agree_and_follow_updates(llama):
    hf, folder = llama
    engine = RolloutEngine(folder, max_total_tokens=1024)
    sums = engine.weights_checksum()
    assert sums == weights_checksum(hf.state_dict(), "float32")  # every weight, same digests
    assert set(sums) == set(engine.weight_names())
    other = make_hf_model("llama", seed=3)
    name = "model.layers.0.mlp.gate_proj.weight"
    engine.update_weights([(name, other.state_dict()[name])])
    after = engine.weights_checksum([name, "model.norm.weight"])
    assert after[name] == weights_checksum({name: other.state_dict()[name]}, torch.float32)[name] != sums[name]
    assert after["model.norm.weight"] == sums["model.norm.weight"]
    with pytest.raises(ValueError, match="unknown weight name 'bogus'"):
        engine.weights_checksum(["bogus"])
    with pytest.raises(ValueError, match="names must be a list"):
        engine.weights_checksum("model.norm.weight")
    assert len(engine.weights_checksum([name])) == 1  # still usable


@pytest.mark.slow  # multi-process; run by .ci/run after the fast tests
def test_tensor_parallel_ranks_give_the_tp1_digests(tmp_path):
    """bf16, a vocabulary that does not divide by the ranks (padding rows),
    biases split over ranks, and at tp=4 K/V heads replicated on two ranks."""
    hf = make_hf_model("qwen2", vocab_size=509)
    folder = save_model(hf, tmp_path / "m")
    expected = weights_checksum(hf.state_dict(), torch.bfloat16)
    for tp in (2, 4):
        engine = RolloutEngine(folder, max_total_tokens=512, tp_size=tp, dtype="bfloat16")
        try:
            assert engine.weights_checksum() == expected
        finally:
            engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernel_equals_the_reference(dtype):
    from rollout_engine.kernels.checksum import block_sums

    torch.manual_seed(2)
    full = torch.randn(300, 4104, device="cuda").to(dtype)
    w = words_per_row(4104, full.element_size())
    per_word = 4 // full.element_size()
    assert torch.equal(block_sums(full, w, 0, 0), block_sums_ref(full.cpu(), w, 0, 0).cuda())
    block = full[17:200, 8 * per_word: 8 * per_word + 2048]  # a strided block, as a row-parallel shard
    assert torch.equal(block_sums(block, w, 17, 8), block_sums_ref(block.cpu(), w, 17, 8).cuda())
    assert torch.equal(tensor_sums(full[:, :1]), block_sums_ref(full[:, :1].cpu(), 1, 0, 0).cuda())


@pytest.mark.gpu
def test_gpu_one_launch_over_many_blocks_equals_the_reference(monkeypatch):
    """Blocks of one call in one table: aligned and unaligned starts, odd
    row lengths, strided shards, an empty tensor, a CPU tensor, and rows
    split into pieces (MAX_ROW_WORDS made small)."""
    from rollout_engine.kernels import checksum

    monkeypatch.setattr(checksum, "MAX_ROW_WORDS", 5000)
    torch.manual_seed(4)
    full = torch.randn(64, 1030, device="cuda").to(torch.bfloat16)
    flat = torch.randn(3 * 5000 + 17, device="cuda").to(torch.bfloat16)  # pieces of a long row
    even = torch.randn(16, 1032, device="cuda").to(torch.bfloat16)  # rows of whole 16-byte words
    blocks = [checksum.whole(full), checksum.whole(flat), (full[3:40, 2:514], 515, 3, 1),  # unaligned start
              (full[:, 8:1030], 515, 0, 4), checksum.whole(torch.empty(0, 4, device="cuda")),
              checksum.whole(torch.randn(7, 3)), checksum.whole(full[5]), (full[9:10, :6], 515, 9, 0),
              (even[2:14, 8:520], 516, 2, 4)]  # a strided block with vector loads
    got = checksum.many_sums(blocks).cpu()
    want = torch.stack([block_sums_ref(b, w, r, c).cpu() for b, w, r, c in blocks])
    assert torch.equal(got, want)
