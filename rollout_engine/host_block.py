"""Several small arrays sent to the device in one copy.

Each host-to-device copy is a driver call the host pays for on every step
(tens to hundreds of microseconds on the machines measured), so a step's
index and sampling arrays travel together: one int64 block, each array
starting on a 16-byte boundary (Triton compiles a kernel anew for each
alignment of its pointers, so an array at an odd offset would cost a
compile mid-run), read on the device through views of the block.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class BlockLayout:
    """Where arrays of the given dtypes and lengths sit in one int64 block."""

    def __init__(self, dtypes: Sequence[np.dtype], lengths: Sequence[int]):
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.lengths = list(lengths)
        self.offsets = []  # in bytes, each a multiple of 16
        at = 0
        for dtype, n in zip(self.dtypes, self.lengths):
            self.offsets.append(at)
            at += -(-n * dtype.itemsize // 16) * 16
        self.words = at // 8

    def host(self, arrays: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """The int64 block holding `arrays` (each cast to its dtype; shorter
        ones zero-padded to their length), written into `out` when given."""
        block = np.zeros(self.words, dtype=np.int64) if out is None else out
        if out is not None:
            block.fill(0)
        raw = block.view(np.uint8)
        for values, dtype, n, at in zip(arrays, self.dtypes, self.lengths, self.offsets):
            raw[at: at + n * dtype.itemsize].view(dtype)[: len(values)] = values
        return block

    def views(self, block: torch.Tensor) -> list[torch.Tensor]:
        """The arrays inside a block of this layout (on any device), as views."""
        if not block.numel():  # (an empty tensor has no unit stride to view through)
            return [torch.empty(0, dtype=_TORCH[d], device=block.device) for d in self.dtypes]
        raw = block.view(torch.uint8)
        return [raw[at: at + n * dtype.itemsize].view(_TORCH[dtype]) for dtype, n, at in
                zip(self.dtypes, self.lengths, self.offsets)]

    def upload(self, arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
        """`arrays` on `device` in one copy, as views of one block."""
        return self.views(torch.from_numpy(self.host(arrays)).to(device, non_blocking=True))


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
          np.dtype(np.float64): torch.float64, np.dtype(np.uint8): torch.uint8, np.dtype(np.bool_): torch.bool}
