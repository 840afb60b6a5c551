"""Decode attention of one sequence (batch-1 steps) in one launch.

At one query token the attention of a layer reads a few megabytes of K/V,
about a microsecond of memory time, yet a decode kernel built for batches
plus its merge pass take ~12 us of the step (BENCHMARKS.md, "Attention at
batch 1"). Here the keys of each KV head are split over `SPLITS` programs
(key block s, s + SPLITS, ... of BLOCK_N keys each: one block each up to
SPLITS * BLOCK_N keys); every program keeps
its online-softmax state (max, sum, weighted values) for the GROUP query
heads of its KV head, and the last program of the head to finish (a counter,
as `kernels.batch_gemm` counts split products) merges the states in split
order and writes the output. The sequence's request-table row and its
length (the new token's position + 1) are read on the device, so a CUDA
graph captured once serves every length, without a plan.

With programmatic dependent launch the program loads its first block of
keys and values before waiting for the kernel before it: the cache entries
of earlier tokens were written by earlier steps. The new token's entry,
which this step's rotary kernel (or qkv product) writes, is read after the
wait. Given the qkv product's raw row instead (`NewEntry`: models whose
per-head q/k norms keep the rotation out of the product), the launch
rotates its queries itself, and the one program whose keys end at the new
token rotates and stores that token's K and V, then reads them back.

K/V are read through the request table (token -> slot), so any page size
works; an e4m3 cache is widened as it loads."""
from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from rollout_engine.kernels._triton import next_pow2, pdl_args
from rollout_engine.kernels.rope import QKNorm

BLOCK_N = 64  # keys per block
# Programs per KV head (a power of two: the merge adds the splits unrolled). On
# an H200, decode llama-3.1-8b batch 1 at 1,000 tokens: 3.90 ms a step with 32,
# 3.92 with 16, 3.99 with 64; at 8,000 tokens 4.46 with 16, 4.66 with 64, and
# FlashInfer's kernels 4.27 (`attention.one_seq`).
SPLITS = 32


def takes_heads(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `one_seq_attention` takes these heads: bf16/fp16 queries, a
    head size that is a power of two from 16 to 256, the query heads in
    equal groups over the KV heads."""
    return (dtype in (torch.bfloat16, torch.float16) and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
            and num_heads % num_kv_heads == 0)


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `one_seq_attention` takes these tensors: one query token of
    heads it takes (`takes_heads`), a cache laid out [slots, kv_heads,
    head_dim] with unit stride in the last, V as K."""
    return (q.dim() == 3 and q.shape[0] == 1 and q.stride(-1) == 1 and k_cache.dim() == 3
            and takes_heads(q.dtype, q.shape[1], k_cache.shape[1], q.shape[-1]) and k_cache.shape[-1] == q.shape[-1]
            and k_cache.stride(-1) == 1 and v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride())


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the helpers
    import triton
    import triton.language as tl

    from rollout_engine.kernels.attention import attend_block, online_update
    from rollout_engine.kernels.e4m3 import kv_value
    from rollout_engine.kernels.rope import cos_sin, rotate_heads, rotated_halves

    @triton.jit
    def _rotated_q(q_ptr, heads, real, c, sn, qw_ptr, eps, stride_qh, dt, GROUP_P: tl.constexpr, D: tl.constexpr,
                   NORM: tl.constexpr):
        """The group's query heads normalised and rotated as the rotary
        kernel writes them (rounded to `dt`): [GROUP_P, D]."""
        q1, q2 = rotated_halves(q_ptr + heads[:, None] * stride_qh, real[:, None], c, sn, qw_ptr, eps, dt, D // 2, NORM)
        return tl.reshape(tl.permute(tl.join(q1.to(dt), q2.to(dt)), (0, 2, 1)), (GROUP_P, D))

    @triton.jit
    def _store_new_entry(kn_ptr, vn_ptr, k_ptr, v_ptr, loc_ptr, kvh, c, sn, kw_ptr, eps, stride_ks, stride_kh, dt,
                         NK: tl.constexpr, NK_P2: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
        """This step's K (normalised and rotated) and V of KV head `kvh`
        into the caches at slot loc[0]: K through the rotary kernel's own
        code and tile (`rope.rotate_heads`, this head only), so its norm sums
        in the same order and the cache gets the same bytes."""
        slot = tl.load(loc_ptr).to(tl.int64)
        rotate_heads(kn_ptr, k_ptr, 0, D, 0, slot, c, sn, kw_ptr, eps, dt, NK, NK_P2, D // 2, NORM, True, kvh)
        d = tl.arange(0, D)
        tl.store(v_ptr + slot * stride_ks + kvh * stride_kh + d,
                 kv_value(tl.load(vn_ptr + kvh * D + d), dt, v_ptr.dtype.element_ty))

    @triton.jit
    def one_seq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, rows_ptr, pos_ptr, part_ptr, ml_ptr, cnt_ptr,
                       kn_ptr, vn_ptr, loc_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, cs_stride,
                       table_stride, scale, stride_qh, stride_ks, stride_kh,
                       GROUP: tl.constexpr, GROUP_P: tl.constexpr, GROUP_S: tl.constexpr, D: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr, NORM: tl.constexpr,
                       NK: tl.constexpr, NK_P2: tl.constexpr, PDL: tl.constexpr):
        """ROPE: q is the qkv product's unrotated query, kn/vn its new K and
        V rows [Hk, D]: each program rotates (NORM: after the per-head
        RMSNorm) its group's queries, and the program whose keys end at the
        new token rotates K and stores K and V at loc[0] before it reads them."""
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.load(rows_ptr).to(tl.int64)
        kv_len = tl.load(pos_ptr).to(tl.int32) + 1
        blocks = tl.cdiv(kv_len, BLOCK_N)
        active = tl.minimum(blocks, SPLITS)  # programs with keys to read
        if s < active:
            d = tl.arange(0, D)
            n = s * BLOCK_N + tl.arange(0, BLOCK_N)
            newest = kv_len - 1
            slots = tl.load(table_ptr + row * table_stride + n, mask=n < kv_len, other=0).to(tl.int64)
            off = slots[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            earlier = (n < newest)[:, None]  # written by earlier steps: read before the wait
            dt = q_ptr.dtype.element_ty  # an e4m3 cache: exact in it
            k = tl.load(k_ptr + off, mask=earlier, other=0.0).to(dt)
            v = tl.load(v_ptr + off, mask=earlier, other=0.0).to(dt)
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            g = tl.arange(0, GROUP_P)
            heads = kvh * GROUP + g
            if ROPE:
                c, sn = cos_sin(cos_ptr, sin_ptr, newest, cs_stride, dt, D // 2)
                q = _rotated_q(q_ptr, heads, g < GROUP, c, sn, qw_ptr, eps, stride_qh, dt, GROUP_P, D, NORM)
                if s == (newest // BLOCK_N) % SPLITS:  # the program whose blocks hold the new token
                    _store_new_entry(kn_ptr, vn_ptr, k_ptr, v_ptr, loc_ptr, kvh, c, sn, kw_ptr, eps, stride_ks,
                                     stride_kh, dt, NK, NK_P2, D, NORM)
                    tl.debug_barrier()  # stored before any thread of the program reads it back
            else:
                q = tl.load(q_ptr + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
            new = (n == newest)[:, None]  # this step's entry, written by the kernel before (ROPE: just above)
            k = tl.where(new, tl.load(k_ptr + off, mask=new, other=0.0).to(dt), k)
            v = tl.where(new, tl.load(v_ptr + off, mask=new, other=0.0).to(dt), v)
            m = tl.full([GROUP_P], float("-inf"), tl.float32)
            l = tl.zeros([GROUP_P], tl.float32)
            acc = tl.zeros([GROUP_P, D], tl.float32)
            m, l, acc = online_update(q, k, v, (n < kv_len)[None, :], scale, m, l, acc)
            for b in range(s + SPLITS, blocks, SPLITS):
                m, l, acc = attend_block(q, k_ptr, v_ptr, table_ptr, row, table_stride, b * BLOCK_N, kv_len, kvh,
                                         stride_ks, stride_kh, scale, g, m, l, acc, D=D, BLOCK_N=BLOCK_N,
                                         CAUSAL=False)
            # this program's state (the group's real heads), then the count; the head's last program merges
            state = kvh * SPLITS + s
            real = (g < GROUP_S)[:, None]
            tl.store(part_ptr + (state * GROUP_S + g[:, None]) * D + d[None, :], acc, mask=real)
            tl.store(ml_ptr + state * 2 * GROUP_S + g, m, mask=g < GROUP_S)
            tl.store(ml_ptr + state * 2 * GROUP_S + GROUP_S + g, l, mask=g < GROUP_S)
            tl.debug_barrier()  # every thread's state stored before the count
            if tl.atomic_add(cnt_ptr + kvh, 1, sem="acq_rel", scope="gpu") == active - 1:
                first = kvh * SPLITS
                gs = tl.arange(0, GROUP_S)
                j = tl.arange(0, SPLITS)
                ml = ml_ptr + (first + j)[:, None] * 2 * GROUP_S + gs[None, :]
                on = (j < active)[:, None]
                ms = tl.load(ml, mask=on, other=float("-inf"), cache_modifier=".cg")  # [SPLITS, GROUP_S]
                top = tl.max(ms, axis=0)
                total = tl.sum(tl.load(ml + GROUP_S, mask=on, other=0.0, cache_modifier=".cg")
                               * tl.exp(ms - top[None, :]), axis=0)
                out = tl.zeros([GROUP_S, D], tl.float32)
                for i in tl.static_range(SPLITS):  # unrolled, without branches: the loads go out at once
                    used = i < active
                    mi = tl.load(ml_ptr + (first + i) * 2 * GROUP_S + gs, mask=used, other=float("-inf"),
                                 cache_modifier=".cg")
                    part = tl.load(part_ptr + ((first + i) * GROUP_S + gs[:, None]) * D + d[None, :], mask=used,
                                   other=0.0, cache_modifier=".cg")
                    out += part * tl.exp(mi - top)[:, None]  # in split order
                out = out / total[:, None]
                h = kvh * GROUP + gs
                tl.store(o_ptr + h[:, None] * stride_qh + d[None, :], out.to(o_ptr.dtype.element_ty),
                         mask=(gs < GROUP)[:, None])
                tl.store(cnt_ptr + kvh, 0)  # back to zero for the next launch or replay


class NewEntry(NamedTuple):
    """This step's K and V as the qkv product leaves them, for
    `one_seq_attention` to rotate and store itself: k and v [1, Hk, D]
    (each head contiguous), the rotation's cos/sin tables [positions, D]
    (`RotaryEmbedding`), the slot loc [1], and Qwen3's per-head q/k RMSNorm
    (`kernels.rope.QKNorm`) or None."""
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    loc: torch.Tensor
    qk_norm: QKNorm | None


def takes_new_entry(q: torch.Tensor, entry: NewEntry, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `one_seq_attention` can rotate and store `entry` itself:
    shapes it takes (`supported`), contiguous caches, q and the new K/V
    rows [1, Hk, D] with contiguous heads, one slot."""
    return (supported(q, k_cache, v_cache) and k_cache.is_contiguous() and q.stride(1) == q.shape[-1]
            and entry.loc.numel() == 1
            and all(t.shape == (1, k_cache.shape[1], q.shape[-1]) and t.stride(-1) == 1 and t.stride(1) == t.shape[-1]
                    for t in (entry.k, entry.v))
            and entry.cos.stride(-1) == 1 and entry.sin.stride() == entry.cos.stride())


def one_seq_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      rows: torch.Tensor, positions: torch.Tensor, scale: float,
                      counters: torch.Tensor, new: NewEntry | None = None) -> torch.Tensor:
    """Attention of one new query token over its sequence: q [1, Hq, D];
    caches [slots, Hk, D]; the sequence is table[rows[0], :positions[0] + 1]
    (device tensors: `rows` int32/int64, `positions` the new token's
    position). `counters`: at least Hk int32 zeros, left zero (launches in
    stream order, as `kernels.batch_gemm.use_counters`). `new`: q is not
    yet rotated and the new token's K/V not yet stored; the launch does
    both, as `kernels.rope.rope_and_store` would (`takes_new_entry`).
    Returns [1, Hq, D] in q's dtype (`supported` shapes)."""
    _, hq, d = q.shape
    hk = k_cache.shape[1]
    group = hq // hk
    group_s = next_pow2(group)  # the heads each program's state keeps
    group_p = max(16, group_s)  # the tensor cores' smallest tile
    if counters.numel() < hk:
        raise ValueError(f"one_seq_attention: {counters.numel()} counters for {hk} KV heads")
    if new is None:
        q = q.contiguous()  # the output takes its strides
        kn = vn = loc = cos = sin = qw = kw = q
        eps = 0.0
    else:
        kn, vn, cos, sin, loc, qk_norm = new
        qw, kw, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    out = torch.empty((1, hq, d), dtype=q.dtype, device=q.device)
    part = torch.empty(hk * SPLITS * group_s * d, dtype=torch.float32, device=q.device)
    ml = torch.empty(hk * SPLITS * 2 * group_s, dtype=torch.float32, device=q.device)
    one_seq_kernel[(SPLITS, hk)](q, k_cache, v_cache, out, table, rows, positions, part, ml, counters,
                                 kn, vn, loc, cos, sin, qw, kw, eps, cos.stride(0),
                                 table.stride(0), scale, q.stride(1), k_cache.stride(0), k_cache.stride(1),
                                 GROUP=group, GROUP_P=group_p, GROUP_S=group_s, D=d, BLOCK_N=BLOCK_N, SPLITS=SPLITS,
                                 ROPE=new is not None, NORM=new is not None and new.qk_norm is not None,
                                 NK=hk, NK_P2=next_pow2(hk), num_warps=4, **pdl_args(q))
    return out
