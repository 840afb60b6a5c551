"""FP8 (e4m3) tensors with scales: the quantize / dequantize references
that fp8 weights and activations are held to.

A quantized tensor is e4m3 values `q` and fp32 multipliers `scale_inv`:
x ~= q * scale_inv, each multiplier shared by one group of elements. Each
group's scale maps its largest magnitude to E4M3_MAX (448, up to the last
bit of the multiplier), so that value is stored as 448 and the others to
e4m3's precision: 3 mantissa bits, a relative rounding error of at most
2^-4 for normal values, an absolute one of at most scale_inv * 2^-10 below
the smallest normal (2^-6 * scale_inv).
Layouts:

- `quantize_blocks`: weights [N, K] in tiles of BLOCK x BLOCK (the
  `weight_scale_inv` [ceil(N / 128), ceil(K / 128)] of Qwen3 and DeepSeek
  FP8 checkpoints); ragged edge tiles take the scale of what they hold.
- `quantize_channels`: one scale per output row [N, 1].
- `quantize_rows`: activations [T, K], one scale per token, or per group of
  `group` columns of a token ([T, ceil(K / group)]).

An all-zero group gets scale_inv 1 (and zeros), as does one whose largest
magnitude is below ~5e-36 (`FP32_TINY`: its values become zeros). Non-finite
input is not representable (e4m3 has no infinities): callers check
finiteness first, as weight updates do."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# 1 / 448 rounded to fp32, so that amax * INV_E4M3_MAX is the same correctly rounded fp32 product on every
# device and in the Triton kernels (a division by a Python number is a multiplication by its reciprocal on
# CUDA and a true division on the CPU: their multipliers differed in the last bit).
INV_E4M3_MAX = float(torch.tensor(1 / E4M3_MAX, dtype=torch.float32))
# The smallest normal fp32: a multiplier below it (a group whose largest magnitude is under 448 times it,
# ~5e-36) has no finite reciprocal to scale by, or is flushed to zero on a GPU; such a group takes 1, as an
# all-zero one does, and its values round to e4m3 zeros.
FP32_TINY = float(torch.finfo(torch.float32).tiny)
BLOCK = 128


def _scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """Per-group multipliers (fp32) from the groups' largest magnitudes:
    amax * (1 / 448); 1 for an all-zero group and for one so small that
    its multiplier would not be a normal fp32 (`FP32_TINY`)."""
    scale = amax.float() * INV_E4M3_MAX
    return torch.where(scale >= FP32_TINY, scale, torch.ones_like(scale))


def _cast(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x in e4m3 units of `scale_inv` (broadcast): the fp32 product of x and
    the multiplier's reciprocal (each correctly rounded, so equal on every
    device and in the Triton kernels, which compute the reciprocal once per
    group), clamped (a rounding can push a value a hair past the largest
    finite e4m3) and cast round-to-nearest-even."""
    return (x.float() * torch.reciprocal(scale_inv)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _tiles(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """w [N, K] zero-padded to whole tiles, viewed [N / b, b, K / b, b]."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, cols * block - k, 0, rows * block - n))
    return padded.view(rows, block, cols, block), n, k


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q e4m3 [N, K], scale_inv fp32 [ceil(N / block), ceil(K / block)])."""
    tiles, n, k = _tiles(w, block)
    scale_inv = _scale_inv(tiles.abs().amax(dim=(1, 3)))
    q = _cast(tiles, scale_inv[:, None, :, None])
    return q.view(tiles.shape[0] * block, -1)[:n, :k].contiguous(), scale_inv


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """quantize_blocks's inverse: fp32 [N, K]."""
    n, k = q.shape
    full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return q.float() * full


def channel_amax(w: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude [N, 1] (NaN where a row holds one)."""
    return w.abs().amax(dim=1, keepdim=True)


def quantize_channels(w: torch.Tensor, whole_rows: torch.Tensor | None = None, amax: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q e4m3 [N, K], scale_inv fp32 [N, 1]): one scale per
    output row. `whole_rows` [N, K'] (w a column slice of it): the rows the
    scales are taken over, so that a slice quantizes as it would in the
    whole matrix (a tensor-parallel rank's part of a row-split weight);
    `amax`: their `channel_amax`, when the caller has it."""
    if amax is None:
        amax = channel_amax(w if whole_rows is None else whole_rows)
    scale_inv = _scale_inv(amax)
    return _cast(w, scale_inv), scale_inv


def dequantize_channels(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """quantize_channels's inverse: fp32 [N, K]."""
    return q.float() * scale_inv


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [T, K] -> (q e4m3 [T, K], scale_inv fp32 [T, groups]):
    one scale per token (`group` None) or per `group` columns of a token."""
    t, k = x.shape
    if group is None or group >= k:  # one scale per token: no padding
        scale_inv = _scale_inv(channel_amax(x))
        return _cast(x, scale_inv), scale_inv
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale_inv = _scale_inv(padded.abs().amax(dim=2))
    q = _cast(padded, scale_inv[:, :, None]).view(t, groups * group)[:, :k].contiguous()
    return q, scale_inv


def dequantize_rows(q: torch.Tensor, scale_inv: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """quantize_rows's inverse (the same `group`): fp32 [T, K]."""
    k = q.shape[1]
    return q.float() * scale_inv.repeat_interleave(group or k, 1)[:, :k]
