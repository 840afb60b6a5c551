"""Row-wise inclusive prefix sums whose bits do not depend on the number of
rows (deterministic mode's sampler). torch's cumsum and sum pick their
parallel strategy by the whole tensor's shape (a single row takes another
path than many), so a row can round differently in another batch. Here one
program scans one row in fixed blocks, in order."""
from __future__ import annotations

import importlib.util

import torch

BLOCK = 2048

if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def row_cumsum_kernel(x_ptr, y_ptr, V, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, BLOCK)
        carry = tl.sum(tl.zeros([BLOCK], y_ptr.dtype.element_ty), axis=0)
        for start in range(0, V, BLOCK):
            offs = start + idx
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=0.0).to(y_ptr.dtype.element_ty)
            c = tl.cumsum(x, axis=0) + carry
            tl.store(y_ptr + row * V + offs, c, mask=offs < V)
            carry = tl.sum(tl.where(idx == BLOCK - 1, c, 0.0), axis=0)  # the block's last sum (masked lanes add 0)


def row_cumsum(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inclusive prefix sums along the last dimension of a [B, V] tensor
    (unit stride inside a row), in `dtype` (default: x's)."""
    rows, vocab = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, vocab), dtype=dtype or x.dtype, device=x.device)
    if rows and vocab:
        row_cumsum_kernel[(rows,)](x, out, vocab, x.stride(0), BLOCK=BLOCK)
    return out
