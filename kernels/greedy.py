"""Greedy sampling in two small launches: per row, the first index of the
maximum logit and the log-sum-exp (so the chosen token's logprob is
max - lse), instead of separate argmax, max and sum-exp passes over the
vocabulary. The row is split over several programs; a second launch
combines their partial results."""
from __future__ import annotations

import functools

import torch

SPLITS = 32
BLOCK = 1024


def argmax_logsumexp_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [B, V] float32 -> (argmax int64, max, logsumexp) per row."""
    return logits.argmax(dim=-1), logits.max(dim=-1).values, torch.logsumexp(logits, dim=-1)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(x_ptr, stride, V, CHUNK, m_ptr, s_ptr, i_ptr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 at ~14k rows of a 152k vocabulary
        part = tl.program_id(1)
        lo = part * CHUNK
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, CHUNK, BLOCK):
            offs = lo + start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride + offs, mask=(offs < V) & (start + tl.arange(0, BLOCK) < CHUNK),
                        other=float("-inf"))
            new = tl.maximum(m, x)
            finite = new > float("-inf")
            s = s * tl.where(finite, tl.exp(m - new), 0.0) + tl.where(finite, tl.exp(x - new), 0.0)
            idx = tl.where(x > m, offs, idx)  # strict: each lane keeps its first maximum
            m = new
        best = tl.max(m, axis=0)
        first = tl.min(tl.where(m == best, idx, 2147483647), axis=0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - best), 0.0), axis=0)
        tl.store(m_ptr + row * SPLITS + part, best)
        tl.store(s_ptr + row * SPLITS + part, total)
        tl.store(i_ptr + row * SPLITS + part, first)

    @triton.jit
    def combine_kernel(m_ptr, s_ptr, i_ptr, tok_ptr, max_ptr, lse_ptr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        p = tl.arange(0, SPLITS)
        m = tl.load(m_ptr + row * SPLITS + p)
        s = tl.load(s_ptr + row * SPLITS + p)
        idx = tl.load(i_ptr + row * SPLITS + p)
        best = tl.max(m, axis=0)
        first = tl.min(tl.where(m == best, idx, 2147483647), axis=0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - best), 0.0), axis=0)
        tl.store(tok_ptr + row, first.to(tl.int64))
        tl.store(max_ptr + row, best)
        tl.store(lse_ptr + row, best + tl.log(total))

    return partial_kernel, combine_kernel


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    dev = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    maxes = torch.empty(rows, dtype=torch.float32, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows:
        chunk = -(-vocab // SPLITS)
        part_m = torch.empty((rows, SPLITS), dtype=torch.float32, device=dev)
        part_s = torch.empty_like(part_m)
        part_i = torch.empty((rows, SPLITS), dtype=torch.int32, device=dev)
        partial, combine = _kernels()
        partial[(rows, SPLITS)](logits, logits.stride(0), vocab, chunk, part_m, part_s, part_i,
                                SPLITS=SPLITS, BLOCK=BLOCK)
        combine[(rows,)](part_m, part_s, part_i, tokens, maxes, lse, SPLITS=SPLITS)
    return tokens, maxes, lse
