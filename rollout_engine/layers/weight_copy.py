"""How a weight reaches its parameter: `copy_into`, used by every
parameter's loader for a cold load and a hot swap alike, and the finiteness
of an update, checked as the weights are copied.

Each tensor of an update gets one int32 flag on the device; the copies set it
(kernels/copy_check.py) and the whole update is read back once at the end,
so there is no host sync per tensor. A non-finite value makes the update
fail with `NonFiniteWeights`, naming the first bad tensor."""
from __future__ import annotations

import contextvars

import torch

from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.copy_check import check_finite, copy_and_check
from rollout_engine.kernels.fp8 import channel_amax, quantize_channels
from rollout_engine.kernels.fp8_quantize import quantize_rows_gpu

FLAGS_PER_BUFFER = 1024


class NonFiniteWeights(ValueError):
    pass


class FiniteCheck:
    def __init__(self) -> None:
        self.names: list[str] = []
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}

    def start(self, name: str) -> None:
        """The copies that follow belong to tensor `name`."""
        self.names.append(name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy_and_check(dst, src, self._flag(dst.device, len(self.names) - 1))

    def flag_if_not_finite(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Flag the current tensor if `x` (derived from it), cast to `dtype`
        (default its own), is not all finite (reads only)."""
        check_finite(x, x.dtype if dtype is None else dtype, self._flag(x.device, len(self.names) - 1))

    def check(self, name: str, src: torch.Tensor, dtype: torch.dtype) -> None:
        """Flag tensor `name` if `src` cast to `dtype` is not finite (reads only)."""
        self.start(name)
        check_finite(src.detach(), dtype, self._flag(src.device, len(self.names) - 1))

    def _flag(self, device: torch.device, index: int) -> torch.Tensor:
        buffers = self._buffers.setdefault(device, [])
        while len(buffers) <= index // FLAGS_PER_BUFFER:
            buffers.append(torch.zeros(FLAGS_PER_BUFFER, dtype=torch.int32, device=device))
        return buffers[index // FLAGS_PER_BUFFER][index % FLAGS_PER_BUFFER:][:1]

    def first_bad(self) -> str | None:
        """The first tensor holding a non-finite value (one host read per device)."""
        bad = []
        for buffers in self._buffers.values():
            flags = torch.cat(buffers).cpu()
            hits = torch.nonzero(flags).flatten()
            if len(hits):
                bad.append(int(hits[0]))
        return self.names[min(bad)] if bad else None

    def raise_if_bad(self, refused: bool = True) -> None:
        """`refused`: nothing was copied (a check before the copy)."""
        name = self.first_bad()
        if name is not None:
            raise NonFiniteWeights(f"{name}: holds NaN or infinite values" +
                                   ("; the update was refused" if refused else " (as copied)"))


# Set while WeightLoader copies an update: copy_into routes through it.
FINITE_CHECK: contextvars.ContextVar[FiniteCheck | None] = contextvars.ContextVar("finite_check", default=None)
# Set while WeightLoader validates a whole update before copying anything:
# loaders run as usual (slicing views, so shapes are checked) but copy nothing.
VALIDATE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("validate_only", default=False)


def expect_shape(src: torch.Tensor, shape: tuple[int, ...], name: str = "") -> None:
    """ValueError unless `src` has `shape`. The loaders check the full
    (unsharded) tensor before they slice their part of it: a slice of a
    larger tensor would fit and be taken silently."""
    if tuple(src.shape) != tuple(shape):
        where = f" for {name}" if name else ""
        raise ValueError(f"shape mismatch{where}: expected {tuple(shape)}, got {tuple(src.shape)}")


def copy_into(dst: torch.Tensor, src: torch.Tensor, name: str = "") -> None:
    expect_shape(src, tuple(dst.shape), name)
    if VALIDATE_ONLY.get():
        return
    check = FINITE_CHECK.get()
    if check is not None:
        check.copy(dst, src)
    else:
        dst.copy_(src.to(dtype=dst.dtype))


def quantize_into(dst: torch.Tensor, scale_inv: torch.Tensor, src: torch.Tensor,
                  whole_rows: torch.Tensor | None = None, name: str = "") -> None:
    """copy_into for an fp8 weight: the rows of `src` quantized into `dst`
    (e4m3) and `scale_inv` (fp32 [rows, 1]), each row's scale taken over
    `whole_rows` (the full rows `src` is a column slice of) or `src`
    (kernels/fp8.py: quantize_channels), on the device. Finiteness is
    checked on the rows the scales come from: e4m3 holds no infinity, and
    a NaN or inf in a row makes its largest magnitude non-finite. Past two
    dimensions (MoE experts [E, N, K], scale_inv [E, N, 1]) the rows are
    those of the last dimension: one pass where dst's rows are evenly
    spaced, else one per leading index."""
    expect_shape(src, tuple(dst.shape), name)
    if VALIDATE_ONLY.get():
        return
    if dst.dim() > 2:
        k = dst.shape[-1]
        if dst.is_contiguous() and scale_inv.is_contiguous():
            quantize_into(dst.view(-1, k), scale_inv.view(-1, 1), src.reshape(-1, k),
                          None if whole_rows is None else whole_rows.reshape(-1, whole_rows.shape[-1]))
        else:
            for i in range(dst.shape[0]):
                quantize_into(dst[i], scale_inv[i], src[i], None if whole_rows is None else whole_rows[i])
        return
    check = FINITE_CHECK.get()
    if use_kernel(dst):  # one pass on the device (kernels/fp8_quantize.py), equal to the reference below
        amax = None if whole_rows is None else channel_amax(whole_rows).to(dst.device)
        rows = src.to(dst.device, non_blocking=True)
        quantize_rows_gpu(rows if rows.stride(-1) == 1 else rows.contiguous(), dst, scale_inv, amax)
        if check is not None:  # a row with NaN or an infinity has a non-finite multiplier
            check.flag_if_not_finite(scale_inv if amax is None else amax)
        return
    amax = channel_amax(src if whole_rows is None else whole_rows)
    if check is not None:
        check.flag_if_not_finite(amax)
    q, scales = quantize_channels(src, amax=amax)
    dst.copy_(q)
    scale_inv.copy_(scales)
