"""Rotary embedding (neox layout) applied to q and k in one launch, reading
cos/sin from the model's table by position. Outputs are contiguous, so the
attention backend needs no extra copy."""
from __future__ import annotations

import functools

import torch

from rollout_engine.kernels._triton import next_pow2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D]; cos/sin: [max_pos, D] fp32 tables."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate(src_ptr, dst_ptr, stride_t, stride_h, t, c, s, NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
                HALF: tl.constexpr):
        heads = tl.arange(0, HEADS_P2)[:, None]
        offs = tl.arange(0, HALF)[None, :]
        mask = heads < NUM_HEADS
        base = src_ptr + t * stride_t + heads * stride_h
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        out = dst_ptr + (t * NUM_HEADS + heads) * (2 * HALF)
        tl.store(out + offs, (x1 * c - x2 * s).to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF + offs, (x2 * c + x1 * s).to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, q_st, q_sh, k_st, k_sh, cs_stride,
                    NQ: tl.constexpr, NQ_P2: tl.constexpr, NK: tl.constexpr, NK_P2: tl.constexpr,
                    HALF: tl.constexpr):
        t = tl.program_id(0)
        pos = tl.load(pos_ptr + t)
        offs = tl.arange(0, HALF)[None, :]
        # cos/sin rounded to the model dtype first, as the reference does
        c = tl.load(cos_ptr + pos * cs_stride + offs).to(qo_ptr.dtype.element_ty).to(tl.float32)
        s = tl.load(sin_ptr + pos * cs_stride + offs).to(qo_ptr.dtype.element_ty).to(tl.float32)
        _rotate(q_ptr, qo_ptr, q_st, q_sh, t, c, s, NQ, NQ_P2, HALF)
        _rotate(k_ptr, ko_ptr, k_st, k_sh, t, c, s, NK, NK_P2, HALF)

    return rope_kernel


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, nq, d = q.shape
    nk = k.shape[1]
    qo = torch.empty((tokens, nq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((tokens, nk, d), dtype=k.dtype, device=k.device)
    if tokens:
        _kernel()[(tokens,)](q, k, qo, ko, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                             cos.stride(0), NQ=nq, NQ_P2=next_pow2(nq), NK=nk, NK_P2=next_pow2(nk), HALF=d // 2)
    return qo, ko
