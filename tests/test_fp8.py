"""FP8 (e4m3) quantization references (kernels/fp8.py) against a float64
model of e4m3 rounding: every stored value is the nearest e4m3 value (ties
to even) of the element over its group's scale, each group's largest
magnitude lands on 448 exactly, and the round trip is within e4m3's
precision, for each scale layout, on ragged shapes, zero groups and
magnitudes across the subnormal range. The multiplier is amax * fp32(1/448)
and elements are multiplied by its reciprocal: both correctly rounded fp32
operations, equal on every device and in the Triton kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_engine.kernels import fp8


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """float64 model of rounding to e4m3 (fn): 3 mantissa bits, exponents
    down to -6 (subnormals below, quantum 2^-9), round half to even,
    magnitudes capped at 448."""
    a = np.abs(v)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = np.exp2(np.maximum(e, -6) - 3)
    r = np.round(a / quantum) * quantum  # numpy rounds half to even
    return np.sign(v) * np.minimum(r, fp8.E4M3_MAX)


def _check(w: torch.Tensor, q: torch.Tensor, full_scale: torch.Tensor) -> None:
    """q is the e4m3 rounding of w times the scale's reciprocal (the fp32
    product the cast sees: `kernels.fp8._cast`), and the round trip is within
    e4m3's precision (relative 2^-4, or 2^-10 of the scale below normals)."""
    w64, s64 = w.double().numpy(), full_scale.double().numpy()
    want = e4m3_round((w.float() * torch.reciprocal(full_scale)).double().numpy())
    assert np.array_equal(q.double().numpy(), want)
    err = np.abs(q.double().numpy() * s64 - w64)
    assert (err <= np.maximum(np.abs(w64) * 2 ** -4, s64 * 2 ** -10) * (1 + 1e-6) + 1e-30).all()


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-6, 1, k)[None, :]  # magnitudes from 1e-6 to 10
    w[:, : min(k, 5)] = 0.0
    return w


@pytest.mark.parametrize("n,k,block", [(256, 384, 128), (200, 300, 128), (7, 5, 128), (64, 96, 32)])
def test_block_scales_map_each_tiles_largest_value_to_448(n, k, block):
    w = _weights(n, k)
    w[:block, :block] = 0.0  # an all-zero tile
    q, scale_inv = fp8.quantize_blocks(w, block)
    assert q.dtype == fp8.FP8 and q.shape == w.shape
    assert scale_inv.shape == (-(-n // block), -(-k // block)) and scale_inv.dtype == torch.float32
    full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    _check(w, q, full)
    assert scale_inv[0, 0] == 1.0 and not q[:block, :block].float().any()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            if tile.abs().max() > 0:
                assert scale_inv[i, j] == tile.abs().max() * fp8.INV_E4M3_MAX  # the fp32 product
                assert q[i * block:(i + 1) * block, j * block:(j + 1) * block].float().abs().max() == 448.0
    torch.testing.assert_close(fp8.dequantize_blocks(q, scale_inv, block), q.float() * full, rtol=0, atol=0)


def test_channel_scales_and_bf16_input():
    w = _weights(96, 200, seed=1).to(torch.bfloat16)
    w[3] = 0.0
    q, scale_inv = fp8.quantize_channels(w)
    assert scale_inv.shape == (96, 1)
    _check(w.float(), q, scale_inv.expand(-1, 200))
    assert scale_inv[3, 0] == 1.0
    assert torch.equal(q.float().abs().amax(1)[torch.arange(96) != 3], torch.full((95,), 448.0))


@pytest.mark.parametrize("group", [None, 128, 100])
def test_row_scales_per_token_or_per_group(group):
    x = _weights(9, 300, seed=2)
    q, scale_inv = fp8.quantize_rows(x, group)
    g = group or 300
    assert scale_inv.shape == (9, -(-300 // g))
    _check(x, q, scale_inv.repeat_interleave(g, 1)[:, :300])
    torch.testing.assert_close(fp8.dequantize_rows(q, scale_inv, group),
                               q.float() * scale_inv.repeat_interleave(g, 1)[:, :300], rtol=0, atol=0)


def test_a_product_through_fp8_stays_within_its_rounding():
    """x @ W^T with both sides quantized (weights in 128-tiles, activations
    per token) against float64: within the bound the roundings imply."""
    w, x = _weights(256, 512, seed=3), torch.randn(4, 512)
    qw, sw = fp8.quantize_blocks(w)
    qx, sx = fp8.quantize_rows(x)
    got = fp8.dequantize_rows(qx, sx).double() @ fp8.dequantize_blocks(qw, sw).double().T
    want = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * (2 * 2 ** -4 + 2 ** -8) + 1e-6
    assert ((got - want).abs() <= bound).all()


def test_a_row_too_small_for_a_normal_multiplier_quantizes_to_zeros_not_nan():
    """A group whose largest magnitude is below 448 times the smallest normal
    fp32 (~5e-36) would get a multiplier with no finite reciprocal (or one
    a GPU flushes to zero): it takes 1, as an all-zero group, and reads back
    as zeros; just above it the group keeps its own multiplier."""
    w = torch.zeros(4, 16)
    w[0, 3], w[1, 5], w[2, :] = 1e-40, 1e-44, 1e-30
    w[3, 0] = 448 * fp8.FP32_TINY
    q, scale_inv = fp8.quantize_channels(w)
    held = fp8.dequantize_channels(q, scale_inv)
    assert torch.isfinite(held).all() and scale_inv[0, 0] == scale_inv[1, 0] == 1.0
    assert torch.equal(held[:2], torch.zeros(2, 16))
    assert scale_inv[2, 0] == w[2].abs().max() * fp8.INV_E4M3_MAX and torch.allclose(held[2], w[2], rtol=0.07)
    assert scale_inv[3, 0] == fp8.FP32_TINY and held[3, 0] == w[3, 0]
    for group in (None, 8):
        assert torch.isfinite(fp8.dequantize_rows(*fp8.quantize_rows(w, group), group)).all()

