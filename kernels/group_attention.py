"""Decode attention for sequences that share the start of their context (the
n samples of one prompt: a GRPO group), the shared part read once a group.

The batch decode kernel (`kernels.attention.decode_kernel`) has one program
per sequence and KV head, each walking the sequence's whole context, so a
group of n samples walks its prompt's keys n times; the kernel is bound by
the latency of those gathers, not by their bytes (BENCHMARKS.md, "Triton
decode tiles"). Here a step with such groups takes two launches:

1. `prefix_kernel`: per (group, KV head, chunk of the shared keys), the
   group's queries stacked into one tile (its members x the query heads of
   the KV head: 56 rows for 8 samples of 7 heads, where a sequence's own
   program fills 7 of 16) walk the chunk once, through the first member's
   request-table row, and store each query's online-softmax state (running
   max, sum, weighted values) under its sequence and head.
2. The batch decode kernel with `lo`: each sequence walks its own keys only
   (from the shared length on), then merges the chunks' states into its own
   in chunk order before the output. Stream order makes the first launch's
   states visible to the second.

A group is only sound where its members' request-table rows hold the same
slots over the shared length (the scheduler groups sequences that hold the
same prefix-cache node: `prefix_groups`' keys). Batch-invariant mode does not
take this path: a sequence's bits here depend on the group it is in."""
from __future__ import annotations

import importlib.util
from typing import NamedTuple

import numpy as np
import torch

from rollout_engine.kernels._triton import next_pow2, pdl_args
from rollout_engine.kernels.attention import f16_products

ROWS = 64  # queries of one prefix program at most (members x query heads of a KV head)
BLOCK_N = 64  # keys per block of a prefix program
WARPS = 4
STAGES = 3
# Shared keys shorter than this are walked by each sequence's own program:
# a chunk of the prefix launch costs about what a few blocks of keys do.
MIN_SHARED = 128
# A group's shared length is cut to a multiple of this, so that the batch
# kernel's own walk starts on a block boundary of any of its tiles (32 to
# 128 keys): its loads of the request table stay aligned (vectorised).
ALIGN = 128


def members_per_group(group: int) -> int:
    """Sequences of one prefix program: as many as fit ROWS query rows
    (`group` query heads a KV head), at most 32."""
    return min(32, ROWS // group) if group <= ROWS // 2 else 0


def prefix_chunks(groups: int, kv_heads: int, sms: int = 132) -> int:
    """Chunks per group's shared keys: about two prefix programs a
    streaming multiprocessor for `groups` groups, rounded down to a power of
    two from 1 to 4 (an H100 at qwen2.5-7b's heads, groups of 8 sharing 640
    tokens: 64 rows best at 4, 256 at 2, 512 at 1; BENCHMARKS.md, "Shared
    prompts read once a group")."""
    want = max(1, 2 * sms // max(1, groups * kv_heads))
    return min(4, 1 << (want.bit_length() - 1))


class PrefixGroups(NamedTuple):
    """A step's groups: per group, the first member's request-table row, the
    shared length and the members' batch indices (`members` wide, -1 where
    none); per sequence, where its own keys start (`lo`: 0 outside a group)."""
    rows: np.ndarray  # [G] int32
    lens: np.ndarray  # [G] int32
    members: np.ndarray  # [G, members] int32
    lo: np.ndarray  # [B] int32

    @property
    def count(self) -> int:
        return len(self.rows)


def prefix_groups(keys: np.ndarray, shared: np.ndarray, table_rows: np.ndarray, members: int,
                  min_shared: int = MIN_SHARED, align: int = ALIGN) -> PrefixGroups:
    """Group a decode step's sequences: those with the same key (>= 0; -1:
    none) share their first `shared` tokens' slots; a group takes the least
    of its members' lengths cut to a multiple of `align`, at least
    `min_shared`, and holds at most
    `members` sequences (a larger one is cut into several). Sequences left
    alone keep lo = 0."""
    b = len(keys)
    lo = np.zeros(b, dtype=np.int32)
    empty = PrefixGroups(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, max(members, 1)), np.int32), lo)
    if members < 2 or b < 2:
        return empty
    keys = np.asarray(keys, dtype=np.int64)
    cand = np.flatnonzero((keys >= 0) & (np.asarray(shared) >= min_shared))
    if cand.size < 2:
        return empty
    order = cand[np.argsort(keys[cand], kind="stable")]
    k = keys[order]
    new_run = np.r_[True, k[1:] != k[:-1]]
    starts = np.flatnonzero(new_run)
    run = np.cumsum(new_run) - 1  # each sorted sequence's run of equal keys
    piece_of = (np.arange(len(order)) - starts[run]) // members  # a run cut into pieces of `members`
    first = np.flatnonzero(np.r_[True, (run[1:] != run[:-1]) | (piece_of[1:] != piece_of[:-1])])
    sizes = np.diff(np.r_[first, len(order)])
    lengths = np.minimum.reduceat(np.asarray(shared, dtype=np.int64)[order], first) // align * align
    keep = (sizes >= 2) & (lengths >= max(min_shared, 1))
    if not keep.any():
        return empty
    first, sizes, lengths = first[keep], sizes[keep], lengths[keep]
    col = np.arange(members)
    place = first[:, None] + col[None, :]
    held = col[None, :] < sizes[:, None]
    out_members = np.where(held, order[np.minimum(place, len(order) - 1)], -1).astype(np.int32)
    lo[out_members[held]] = np.repeat(lengths, sizes)
    rows = np.asarray(table_rows)[order[first]].astype(np.int32)
    return PrefixGroups(rows, lengths.astype(np.int32), out_members, lo)


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the helpers
    import triton
    import triton.language as tl

    from rollout_engine.kernels.attention import attend_block, f16_queries

    @triton.jit
    def prefix_kernel(q_ptr, k_ptr, v_ptr, table_ptr, grp_rows_ptr, grp_lens_ptr, members_ptr, part_ptr, ml_ptr,
                      table_stride, scale, state_rows, stride_qt, stride_qh, stride_ks, stride_kh,
                      GROUP: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, MEMBERS: tl.constexpr,
                      R_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, F16: tl.constexpr,
                      PDL: tl.constexpr):
        c = tl.program_id(0)
        kvh = tl.program_id(1)
        grp = tl.program_id(2)
        shared = tl.load(grp_lens_ptr + grp)
        if PDL:  # every program waits, so this launch ends after the one before it
            tl.extra.cuda.gdc_wait()
        if shared > 0:
            row = tl.load(grp_rows_ptr + grp).to(tl.int64)
            per = tl.cdiv(tl.cdiv(shared, BLOCK_N), CHUNKS) * BLOCK_N
            lo = c * per
            hi = tl.minimum(shared, lo + per)
            r = tl.arange(0, R_P)
            j = r // GROUP
            head = kvh * GROUP + r % GROUP
            b = tl.load(members_ptr + grp * MEMBERS + j, mask=j < MEMBERS, other=-1)
            real = b >= 0
            d = tl.arange(0, D)
            bq = tl.where(real, b, 0).to(tl.int64)
            q = tl.load(q_ptr + bq[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=real[:, None],
                        other=0.0)
            if F16:  # as decode_kernel: bf16 queries over an e4m3 cache, fp16 products
                q, scale = f16_queries(q, scale)
            m = tl.full([R_P], float("-inf"), tl.float32)
            l = tl.zeros([R_P], tl.float32)
            acc = tl.zeros([R_P, D], tl.float32)
            for start in range(lo, hi, BLOCK_N):
                m, l, acc = attend_block(q, k_ptr, v_ptr, table_ptr, row, table_stride, start, hi, kvh, stride_ks,
                                         stride_kh, scale, r, m, l, acc, D=D, BLOCK_N=BLOCK_N, CAUSAL=False)
            state = (c * state_rows + bq) * HQ + head  # [R_P]
            tl.store(part_ptr + state[:, None] * D + d[None, :], acc, mask=real[:, None])
            tl.store(ml_ptr + state * 2, m, mask=real)
            tl.store(ml_ptr + state * 2 + 1, l, mask=real)


def prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     grp_rows: torch.Tensor, grp_lens: torch.Tensor, members: torch.Tensor, scale: float,
                     chunks: int, state_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first launch: the states of every group's shared keys, `chunks`
    per group, as (part [chunks, state_rows, Hq, D], ml [chunks, state_rows,
    Hq, 2]) fp32, indexed by batch index (rows outside a group left
    unwritten). `grp_lens` 0: no group in that place (a graph's spare ones).
    q: [B, Hq, D]; members: [G, m] int32 device tensors."""
    _, hq, d = q.shape
    hk = k_cache.shape[1]
    group = hq // hk
    width = members.shape[1]
    part = torch.empty((chunks, state_rows, hq, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((chunks, state_rows, hq, 2), dtype=torch.float32, device=q.device)
    g = grp_rows.numel()
    if g:
        prefix_kernel[(chunks, hk, g)](
            q, k_cache, v_cache, table, grp_rows, grp_lens, members, part, ml, table.stride(0),
            scale, state_rows, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            GROUP=group, HQ=hq, D=d, MEMBERS=width, R_P=max(16, next_pow2(width * group)), BLOCK_N=BLOCK_N,
            CHUNKS=chunks, F16=f16_products(q, k_cache),
            num_warps=WARPS, num_stages=STAGES, **pdl_args(q))
    return part, ml
