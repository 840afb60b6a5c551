"""Paged attention in Triton, for machines without FlashInfer: decode (one
query token per sequence) and extend (new tokens over a cached prefix,
causal). K/V are read through the request table (token -> slot), so any page
size works, and converted to the queries' dtype as they load (an e4m3 KV
cache holds values that bf16 and fp16 represent exactly). One torch
reference (`paged_attention_ref`) serves both."""
from __future__ import annotations

import importlib.util

import numpy as np
import torch

from rollout_engine.kernels._triton import next_pow2

# bf16 queries over an e4m3 cache: the decode kernel's products in fp16
# (`decode_kernel`'s F16). A/B runs (benchmarks/decode_attention.py
# --backends triton triton-widen) turn it off.
E4M3_IN_F16 = True
# The decode kernel's launch shape, (keys per block, warps, pipeline
# stages): `decode_tile`'s pick, or this one where set (sweeps).
DECODE_TILE: tuple[int, int, int] | None = None


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                        rows: list[int], seq_lens: list[int], extend_lens: list[int], scale: float) -> torch.Tensor:
    """q: [T, Hq, D] (sequences' new tokens, concatenated); caches [S, Hk, D]."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    start = 0
    for row, kv_len, q_len in zip(rows, seq_lens, extend_lens):
        slots = table[row, :kv_len].long()
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        qi = q[start: start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(kv_len, device=q.device)[None, :] > q_pos, float("-inf"))
        out[start: start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        start += q_len
    return out


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the helpers
    import triton
    import triton.language as tl

    @triton.jit
    def online_update(q, k, v, allowed, scale, m, l, acc):
        """One block of keys into the online softmax (running max m, sum l and
        weighted values acc of the queries q), scores kept where `allowed`;
        k and v in q's dtype."""
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        return m_new, l, acc

    @triton.jit
    def attend_block(q, k_ptr, v_ptr, table_ptr, row, table_stride, start, kv_len, kvh, stride_ks, stride_kh, scale,
                     visible, m, l, acc, D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """One block of keys of the online softmax: the keys' slots come from
        the request table. With CAUSAL, `visible` holds the query positions."""
        d = tl.arange(0, D)
        n = start + tl.arange(0, BLOCK_N)
        valid = n < kv_len
        slots = tl.load(table_ptr + row * table_stride + n, mask=valid, other=0).to(tl.int64)
        kv_off = slots[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(q.dtype)  # an e4m3 cache: exact
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(q.dtype)
        allowed = valid[None, :]
        if CAUSAL:
            allowed = allowed & (n[None, :] <= visible[:, None])
        return online_update(q, k, v, allowed, scale, m, l, acc)

    @triton.jit
    def f16_queries(q, scale):
        """Queries for fp16 products (`decode_kernel`'s F16): scaled by 1/16,
        clamped to fp16's range, with the scale by 16."""
        return tl.minimum(tl.maximum(q.to(tl.float32) * 0.0625, -65504.0), 65504.0).to(tl.float16), scale * 16.0

    @triton.jit
    def merge_states(m, l, acc, part_ptr, ml_ptr, b, heads, real, state_rows, HQ: tl.constexpr, D: tl.constexpr,
                     CHUNKS: tl.constexpr):
        """A sequence's state (m, l, acc over its query `heads`, `real` where
        a head exists) merged with the states that `kernels.group_attention`'s
        prefix launch stored for it (its shared keys, CHUNKS chunks), in
        chunk order."""
        d = tl.arange(0, D)
        for c in tl.static_range(CHUNKS):
            state = (c * state_rows + b) * HQ + heads
            mc = tl.load(ml_ptr + state * 2, mask=real, other=float("-inf"))
            lc = tl.load(ml_ptr + state * 2 + 1, mask=real, other=0.0)
            ac = tl.load(part_ptr + state[:, None] * D + d[None, :], mask=real[:, None], other=0.0)
            top = tl.maximum(m, mc)
            top = tl.where(top == float("-inf"), 0.0, top)
            a0 = tl.exp(m - top)
            a1 = tl.exp(mc - top)
            acc = acc * a0[:, None] + ac * a1[:, None]
            l = l * a0 + lc * a1
            m = top
        return m, l, acc

    @triton.jit
    def sequence_of(qo_indptr_ptr, rows_ptr, lens_ptr, b):
        """Sequence b of an extend step: (first query, number of queries,
        request-table row, keys in all, keys before the first query)."""
        q_start = tl.load(qo_indptr_ptr + b)
        q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
        row = tl.load(rows_ptr + b).to(tl.int64)
        kv_len = tl.load(lens_ptr + b)
        return q_start, q_len, row, kv_len, kv_len - q_len

    @triton.jit
    def decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, rows_ptr, lens_ptr, order_ptr, lo_ptr, part_ptr, ml_ptr,
                      table_stride, scale, state_rows, stride_qt, stride_qh, stride_ks, stride_kh,
                      GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      F16: tl.constexpr = False, ORDERED: tl.constexpr = False, HQ: tl.constexpr = 1,
                      CHUNKS: tl.constexpr = 0):
        """One sequence's query heads of one KV head. ORDERED: program
        (h, i) takes KV head h of sequence order[i], so the programs start
        the longest sequences first, all heads of a sequence together (the
        GPU starts programs about in order: the short ones fill the tail);
        its request-table row and length are rows[i] and lens[i], sent in
        that order, so no load waits on the order's. Otherwise program
        (b, h): sequence b, KV head h. F16 (bf16 queries over
        an e4m3 cache): the products in fp16, which e4m3 widens to in one
        instruction per pair of values where bf16 takes several. The
        queries are scaled by 1/16 first (the scale by 16) and clamped to
        fp16's range: exact from 2^-10 to 2^20 in magnitude, smaller values
        rounding to fp16's subnormal steps (without the clamp a query of 3e5
        came out non-finite on the GPU). CHUNKS > 0: the sequence's keys
        before lo[i] were walked by `kernels.group_attention`'s prefix
        launch, whose CHUNKS states (part, ml) this program merges into its
        own."""
        if ORDERED:
            i = tl.program_id(1)
            b = tl.load(order_ptr + i)
            kvh = tl.program_id(0)
        else:
            b = tl.program_id(0)
            i = b
            kvh = tl.program_id(1)
        row = tl.load(rows_ptr + i).to(tl.int64)
        kv_len = tl.load(lens_ptr + i)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None],
                    other=0.0)
        if F16:
            q, scale = f16_queries(q, scale)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D], tl.float32)
        lo = 0
        if CHUNKS > 0:
            lo = tl.multiple_of(tl.load(lo_ptr + i), BLOCK_N)  # (`group_attention.ALIGN`)
        for start in range(lo, kv_len, BLOCK_N):
            m, l, acc = attend_block(q, k_ptr, v_ptr, table_ptr, row, table_stride, start, kv_len, kvh, stride_ks,
                                     stride_kh, scale, g, m, l, acc, D=D, BLOCK_N=BLOCK_N, CAUSAL=False)
        if CHUNKS > 0:
            if lo > 0:
                m, l, acc = merge_states(m, l, acc, part_ptr, ml_ptr, b, heads, g < GROUP, state_rows, HQ=HQ, D=D,
                                         CHUNKS=CHUNKS)
        out = acc / l[:, None]
        tl.store(o_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=(g < GROUP)[:, None])

    @triton.jit
    def extend_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, rows_ptr, lens_ptr, qo_indptr_ptr, table_stride, scale,
                      stride_qt, stride_qh, stride_ks, stride_kh,
                      GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        mblock = tl.program_id(2)
        q_start, q_len, row, kv_len, prefix = sequence_of(qo_indptr_ptr, rows_ptr, lens_ptr, b)
        if mblock * BLOCK_M >= q_len:
            return
        kvh = h // GROUP
        mi = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = mi < q_len
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (q_start + mi)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=m_valid[:, None],
                    other=0.0)
        q_pos = prefix + mi
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        end = tl.minimum(kv_len, prefix + (mblock + 1) * BLOCK_M)  # causal: later keys are never seen
        for start in range(0, end, BLOCK_N):
            m, l, acc = attend_block(q, k_ptr, v_ptr, table_ptr, row, table_stride, start, kv_len, kvh, stride_ks,
                                     stride_kh, scale, q_pos, m, l, acc, D=D, BLOCK_N=BLOCK_N, CAUSAL=True)
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(o_ptr + (q_start + mi)[:, None] * stride_qt + h * stride_qh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None])

    @triton.jit
    def invariant_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, rows_ptr, lens_ptr, qo_indptr_ptr, table_stride,
                         scale, stride_qt, stride_qh, stride_ks, stride_kh, GROUP: tl.constexpr,
                         GROUP_P: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        """Decode and extend alike (deterministic mode): a tile holds BLOCK_T
        query tokens x the GROUP heads of one KV head, and every query walks
        the same key blocks from position 0 with the same tile shapes, so its
        result does not depend on the other queries of its tile, on its batch,
        or on whether its step was a decode or a prefill."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        tblock = tl.program_id(2)
        q_start, q_len, row, kv_len, prefix = sequence_of(qo_indptr_ptr, rows_ptr, lens_ptr, b)
        if tblock * BLOCK_T >= q_len:
            return
        r = tl.arange(0, BLOCK_T * GROUP_P)
        t = tblock * BLOCK_T + r // GROUP_P
        g = r % GROUP_P
        ok = (t < q_len) & (g < GROUP)
        head = kvh * GROUP + g
        d = tl.arange(0, D)
        q_off = (q_start + t).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=ok[:, None], other=0.0)
        m = tl.full([BLOCK_T * GROUP_P], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_T * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_T * GROUP_P, D], tl.float32)
        # Blocks past a query's own position are fully masked: they leave its
        # running max, sum and output exactly as they were.
        end = tl.minimum(kv_len, prefix + (tblock + 1) * BLOCK_T)
        for start in range(0, end, BLOCK_N):
            m, l, acc = attend_block(q, k_ptr, v_ptr, table_ptr, row, table_stride, start, kv_len, kvh, stride_ks,
                                     stride_kh, scale, prefix + t, m, l, acc, D=D, BLOCK_N=BLOCK_N, CAUSAL=True)
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=ok[:, None])


def _kernels():
    return decode_kernel, extend_kernel


def f16_products(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the decode kernels multiply in fp16: bf16 queries over an e4m3
    cache, with E4M3_IN_F16."""
    return E4M3_IN_F16 and q.dtype == torch.bfloat16 and k_cache.dtype == torch.float8_e4m3fn


def decode_tile(programs: int, e4m3: bool) -> tuple[int, int, int]:
    """(keys per block, warps, stages) for `programs` (sequences x KV heads):
    about 1,024 warps in all, so one warp a program from 1,024 programs (the
    16-row products then run on one warp's tensor cores, and more programs
    stay resident to hide the gathers' latency), four below 256; blocks of 32
    keys a warp. Five stages for an e4m3 cache, three for bf16 / fp16.
    Measured on an H200 at qwen2.5-7b's heads, 64 to 512 rows
    (BENCHMARKS.md, "Triton decode tiles")."""
    if DECODE_TILE is not None:
        return DECODE_TILE
    warps = 4 if programs < 256 else max(1, 1024 // next_pow2(programs))
    return 32 * warps, warps, 5 if e4m3 else 3


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """`decode_attention`'s `order` for these lengths: the rows by length,
    longest first (ties in row order), as int32."""
    return np.argsort(-seq_lens.astype(np.int64), kind="stable").astype(np.int32)


def in_order(order: np.ndarray, *rows: np.ndarray) -> list[np.ndarray]:
    """Each array's rows in `order`, as int32: what `decode_attention`
    takes with that order."""
    return [np.ascontiguousarray(r[order], dtype=np.int32) for r in rows]


def decode_attention(q, k_cache, v_cache, table, rows, seq_lens, scale: float,
                     order: torch.Tensor | None = None, prefix: tuple | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; rows, seq_lens: [B] device tensors. bf16 queries over
    an e4m3 cache take fp16 products (`decode_kernel`'s F16). `order`: a
    permutation of the B rows as an int32 device tensor (`longest_first`):
    the programs start in that order, longest sequences first, so ragged
    lengths do not leave a tail of long ones; the outputs are the same.
    With an order, `rows` and `seq_lens` come in it too (`rows[i]`,
    `seq_lens[i]` are query `order[i]`'s: `in_order`). `prefix`: (lo,
    part, ml), the keys before lo (int32 [B], in the order too) already
    walked by `kernels.group_attention.prefix_attention`, whose states
    (part, ml) the programs merge."""
    bsz, hq, d = q.shape
    hk = k_cache.shape[1]
    group = hq // hk
    out = torch.empty_like(q)
    if not bsz:
        return out
    block_n, warps, stages = decode_tile(bsz * hk, k_cache.dtype == torch.float8_e4m3fn)
    grid = (bsz, hk) if order is None else (hk, bsz)
    lo, part, ml = prefix if prefix is not None else (seq_lens, out, out)
    chunks, state_rows = part.shape[:2] if prefix is not None else (0, 0)
    _kernels()[0][grid](q, k_cache, v_cache, out, table, rows, seq_lens, rows if order is None else order, lo, part,
                        ml, table.stride(0), scale, state_rows, q.stride(0), q.stride(1), k_cache.stride(0),
                        k_cache.stride(1), GROUP=group, GROUP_P=max(16, next_pow2(group)), D=d, BLOCK_N=block_n,
                        F16=f16_products(q, k_cache), ORDERED=order is not None, HQ=hq, CHUNKS=chunks,
                        num_warps=warps, num_stages=stages)
    return out


def extend_attention(q, k_cache, v_cache, table, rows, seq_lens, qo_indptr, max_q_len: int,
                     scale: float) -> torch.Tensor:
    """q: [T, Hq, D] new tokens; qo_indptr: [B + 1] device tensor."""
    t, hq, d = q.shape
    hk = k_cache.shape[1]
    out = torch.empty_like(q)
    bsz = rows.numel()
    block_m = 64
    if t:
        _kernels()[1][(bsz, hq, -(-max_q_len // block_m))](
            q, k_cache, v_cache, out, table, rows, seq_lens, qo_indptr, table.stride(0), scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            GROUP=hq // hk, D=d, BLOCK_M=block_m, BLOCK_N=64)
    return out


def invariant_attention(q, k_cache, v_cache, table, rows, seq_lens, qo_indptr, max_q_len: int,
                        scale: float) -> torch.Tensor:
    """Batch-invariant paged attention (deterministic mode): one kernel for
    decode (qo_indptr = 0, 1, ..., B) and extend. q: [T, Hq, D]."""
    t, hq, d = q.shape
    hk = k_cache.shape[1]
    group = hq // hk
    group_p = next_pow2(group)
    block_t = max(1, 16 // group_p)  # at least 16 rows per tile, the smallest tensor-core tile
    out = torch.empty_like(q)
    bsz = rows.numel()
    if t:
        invariant_kernel[(bsz, hk, -(-max_q_len // block_t))](
            q, k_cache, v_cache, out, table, rows, seq_lens, qo_indptr, table.stride(0), scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            GROUP=group, GROUP_P=group_p, D=d, BLOCK_T=block_t, BLOCK_N=64)
    return out
