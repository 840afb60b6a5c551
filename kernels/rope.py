"""Rotary embedding (neox layout) in one launch per layer: q is rotated into a
new contiguous tensor; k is rotated and written, with v, straight into the
layer's KV cache at each token's slot (`rope_and_store`), so a step stores
its new K/V without a separate kernel. With `qk_norm` (Qwen3's per-head
RMSNorm of q and k) the same launch normalises each head first, rounding as
the separate norm would. `rope` returns rotated q and k instead, for callers
that keep K/V themselves."""
from __future__ import annotations

import importlib.util

import torch

from rollout_engine.kernels._triton import next_pow2, pdl_args
from rollout_engine.kernels.e4m3 import to_kv
from rollout_engine.kernels.rmsnorm import rmsnorm_ref

QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q weight [D], k weight [D], eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D]; cos/sin: [max_pos, D] fp32 tables."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def rope_and_store_ref(positions, q, k, v, cos, sin, k_cache, v_cache, loc,
                       qk_norm: QKNorm | None = None) -> torch.Tensor:
    """Reference of `rope_and_store`: returns rotated q; k_cache[loc] and
    v_cache[loc] receive rotated k and v."""
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rmsnorm_ref(q, q_weight, eps)[0], rmsnorm_ref(k, k_weight, eps)[0]
    qo, ko = rope_ref(positions, q, k, cos, sin)
    k_cache[loc] = to_kv(ko, k_cache.dtype)
    v_cache[loc] = to_kv(v, v_cache.dtype)
    return qo


if importlib.util.find_spec("triton") is not None:  # module level: the one-sequence attention calls these
    import triton
    import triton.language as tl

    from rollout_engine.kernels.e4m3 import kv_value

    @triton.jit
    def _normed(x, w_ptr, offs, inv, dtype):
        """One half of each head through RMSNorm: rounded before and after the weight."""
        w = tl.load(w_ptr + offs).to(tl.float32)
        return ((x * inv).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)

    @triton.jit
    def cos_sin(cos_ptr, sin_ptr, pos, cs_stride, dt, HALF: tl.constexpr):
        """The rotation's [1, HALF] cos and sin at position `pos`, rounded to
        the model's dtype `dt` first, as the reference does."""
        offs = tl.arange(0, HALF)[None, :]
        c = tl.load(cos_ptr + pos * cs_stride + offs).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * cs_stride + offs).to(dt).to(tl.float32)
        return c, s

    @triton.jit
    def rotated_halves(base, mask, c, s, w_ptr, eps, dt, HALF: tl.constexpr, NORM: tl.constexpr):
        """Heads at `base` ([H, 1] pointers to each head's first element;
        `mask` [H, 1]) per-head RMS-normalised (NORM, weight at w_ptr) and
        rotated: their first and second halves [H, HALF] in fp32, not yet
        rounded."""
        offs = tl.arange(0, HALF)[None, :]
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            inv = tl.rsqrt(ss / (2 * HALF) + eps)[:, None]
            x1 = _normed(x1, w_ptr, offs, inv, dt)
            x2 = _normed(x2, w_ptr + HALF, offs, inv, dt)
        return x1 * c - x2 * s, x2 * c + x1 * s

    @triton.jit
    def rotate_heads(src_ptr, dst_ptr, stride_t, stride_h, t, dst_row, c, s, w_ptr, eps, dt, NUM_HEADS: tl.constexpr,
                     HEADS_P2: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, ONE_HEAD: tl.constexpr = False,
                     head=0):
        """Heads of token t rotated (`dt`: the model's dtype, which every step
        rounds to) into row `dst_row` of dst, as the KV cache holds them
        when dst is a cache (`kv_value`). ONE_HEAD: only head `head` (read
        and stored; the others masked, the tile the same)."""
        heads = tl.arange(0, HEADS_P2)[:, None]
        offs = tl.arange(0, HALF)[None, :]
        mask = heads < NUM_HEADS
        if ONE_HEAD:
            mask = heads == head
        r1, r2 = rotated_halves(src_ptr + t * stride_t + heads * stride_h, mask, c, s, w_ptr, eps, dt, HALF, NORM)
        out = dst_ptr + (dst_row * NUM_HEADS + heads) * (2 * HALF)
        tl.store(out + offs, kv_value(r1, dt, dst_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF + offs, kv_value(r2, dt, dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_k_store_v(k_ptr, v_ptr, ko_ptr, vo_ptr, loc_ptr, k_st, k_sh, v_st, v_sh, t, c, s, kw_ptr, eps, dt,
                          NK: tl.constexpr, NK_P2: tl.constexpr, HALF: tl.constexpr, STORE: tl.constexpr,
                          NORM: tl.constexpr):
        if STORE:  # k and v go to the cache slot of token t
            slot = tl.load(loc_ptr + t).to(tl.int64)
            rotate_heads(k_ptr, ko_ptr, k_st, k_sh, t, slot, c, s, kw_ptr, eps, dt, NK, NK_P2, HALF, NORM)
            heads = tl.arange(0, NK_P2)[:, None]
            d = tl.arange(0, 2 * HALF)[None, :]
            mask = heads < NK
            val = tl.load(v_ptr + t * v_st + heads * v_sh + d, mask=mask, other=0.0)
            tl.store(vo_ptr + (slot * NK + heads) * (2 * HALF) + d, kv_value(val, dt, vo_ptr.dtype.element_ty),
                     mask=mask)
        else:
            rotate_heads(k_ptr, ko_ptr, k_st, k_sh, t, t, c, s, kw_ptr, eps, dt, NK, NK_P2, HALF, NORM)

    @triton.jit
    def rope_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, loc_ptr, cos_ptr, sin_ptr, pos_ptr, qw_ptr, kw_ptr,
                    eps, q_st, q_sh, k_st, k_sh, v_st, v_sh, cs_stride, NQ: tl.constexpr, NQ_P2: tl.constexpr,
                    NK: tl.constexpr, NK_P2: tl.constexpr, HALF: tl.constexpr, STORE: tl.constexpr,
                    NORM: tl.constexpr, KV_PART: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # programmatic dependent launch: wait for the kernel before (the qkv product)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0)
        pos = tl.load(pos_ptr + t)
        dt = qo_ptr.dtype.element_ty  # the model's dtype (the caches may hold e4m3)
        c, s = cos_sin(cos_ptr, sin_ptr, pos, cs_stride, dt, HALF)
        part = tl.program_id(1)  # KV_PART 1: two programs per token, q in one, k (and v) in the other
        if part == 0:
            rotate_heads(q_ptr, qo_ptr, q_st, q_sh, t, t, c, s, qw_ptr, eps, dt, NQ, NQ_P2, HALF, NORM)
        if part == KV_PART:
            _rotate_k_store_v(k_ptr, v_ptr, ko_ptr, vo_ptr, loc_ptr, k_st, k_sh, v_st, v_sh, t, c, s, kw_ptr, eps, dt,
                              NK, NK_P2, HALF, STORE, NORM)


# q and k of a token rotated by two programs: faster at every size measured
# (benchmarks/small_kernels.py, H200, qwen3-0.6b with q/k norm: 2.94 -> 2.46 us
# at 256 tokens, 2.41 -> 1.88 at one; qwen2.5-7b 2.67 -> 2.52 at 256).
TWO_PROGRAMS_PER_TOKEN = True


def _launch(positions, q, k, v, qo, ko, vo, loc, cos, sin, store: bool, qk_norm=None,
            split: bool | None = None, warps: int = 4) -> None:
    tokens, nq, d = q.shape
    nk = k.shape[1]
    if not tokens:
        return
    v_strides = (v.stride(0), v.stride(1)) if store else (0, 0)
    qw, kw, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    split = TWO_PROGRAMS_PER_TOKEN if split is None else split
    rope_kernel[(tokens, 2 if split else 1)](
        q, k, v if store else k, qo, ko, vo if store else ko, loc if store else positions, cos, sin, positions, qw, kw,
        eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_strides, cos.stride(0), NQ=nq,
        NQ_P2=next_pow2(nq), NK=nk, NK_P2=next_pow2(nk), HALF=d // 2, STORE=store, NORM=qk_norm is not None,
        KV_PART=int(split), num_warps=warps, **pdl_args(q))


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k), contiguous."""
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(positions, q, k, None, qo, ko, None, None, cos, sin, store=False)
    return qo, ko


def rope_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                   qk_norm: QKNorm | None = None) -> torch.Tensor:
    """Rotated q (contiguous); rotated k and v written to the caches
    ([slots, Hk, D], contiguous) at `loc` ([T] int64). With `qk_norm`,
    q and k are RMS-normalised per head before the rotation."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(positions, q, k, v, qo, k_cache, v_cache, loc, cos, sin, store=True, qk_norm=qk_norm)
    return qo
