"""The one-row product's weight blocks read before its dependent-launch
wait (`kernels.gemv.PRELOAD_BLOCKS`): the same bits as one block read early,
for every epilogue, under Triton's interpreter on the CPU (run with
TRITON_INTERPRET=1; skipped otherwise); how many blocks a launch reads early."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from rollout_engine.kernels import gemv

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1)")


def test_blocks_read_early_are_capped_by_k_the_registers_and_four():
    assert gemv.preload_blocks(4096, 4, 1024, 4) == 1  # the default: one block, as before
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemv, "PRELOAD_BLOCKS", 4)
        assert gemv.preload_blocks(4096, 4, 1024, 4) == 4  # 128 elements a thread
        assert gemv.preload_blocks(2500, 4, 1024, 4) == 3  # K has three blocks
        assert gemv.preload_blocks(4096, 16, 512, 8) == 4
        assert gemv.preload_blocks(14336, 16, 1024, 8) == 2  # 16 x 1024 a block: two fit 8 warps' registers
        for wrong in (0, 8):  # the kernel reads one to four
            mp.setattr(gemv, "PRELOAD_BLOCKS", wrong)
            with pytest.raises(ValueError, match="PRELOAD_BLOCKS"):
                gemv.preload_blocks(1 << 16, 1, 64, 4)


def _both(fn):
    """fn() with one weight block read early, then with four."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemv, "PRELOAD_BLOCKS", 1)
        one = fn()
        mp.setattr(gemv, "PRELOAD_BLOCKS", 4)
        four = fn()
    return one, four


@interpreted
@pytest.mark.parametrize("n,k", [(64, 2500), (48, 4096), (40, 700), (64, 9000)])
def test_interpreted_blocks_read_early_keep_the_bits(n, k):
    """Plain, normalised (with the residual) and biased products: K of one
    block, of three with a short tail, of exactly four, of more than four."""
    torch.manual_seed(0)
    x, r = torch.randn(1, k), torch.randn(1, k)
    g, w, b = torch.rand(k) + 0.5, torch.randn(n, k) * k ** -0.5, torch.randn(n)
    for fn in (lambda: gemv.gemv(x, w, b, config=(4, 1024, 4)),
               lambda: gemv._launch(x, w, None, None, (4, 1024, 4), norm=(g, 1e-6), residual=r)[0]):
        one, four = _both(fn)
        assert torch.equal(one, four)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(gemv.gemv(x, w, b, config=(4, 1024, 4)), ref, atol=1e-4, rtol=1e-4)


@interpreted
def test_interpreted_blocks_read_early_keep_the_bits_of_the_gated_and_rotary_epilogues():
    from rollout_engine.kernels.gemv import RopeStore

    torch.manual_seed(1)
    k, inter = 2100, 32
    x, g = torch.randn(1, k), torch.rand(k) + 0.5
    gate_up = torch.randn(2 * inter, k) * k ** -0.5
    one, four = _both(lambda: gemv._launch(x, gate_up, config=(4, 512, 4), norm=(g, 1e-6), gated=True)[0])
    assert one.shape == (1, inter) and torch.equal(one, four)
    nq, nk, d, slots = 2, 1, 16, 8
    qkv = torch.randn((nq + 2 * nk) * d, k) * k ** -0.5
    pos, loc = torch.tensor([5]), torch.tensor([3])
    angles = torch.arange(64.0)[:, None] * torch.rand(d // 2)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotated():
        caches = torch.zeros(slots, nk, d), torch.zeros(slots, nk, d)
        q = gemv._launch(x, qkv, config=(4, 512, 4), norm=(g, 1e-6),
                         rope=RopeStore(pos, cos, sin, *caches, loc, nq, nk))[0]
        return torch.cat([q.flatten(), caches[0].flatten(), caches[1].flatten()])

    one, four = _both(rotated)
    assert torch.equal(one, four) and one[-2 * slots * nk * d:].abs().sum() > 0
