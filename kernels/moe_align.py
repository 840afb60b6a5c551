"""The align step of the fused MoE (kernels/moe.py): the T*k (token, slot)
pairs sorted by expert (stable), each expert's run padded to a multiple of
BLOCK_M with the sentinel T*k, the expert of every block of BLOCK_M and the
padded total, all on the device. Buffers are sized by the bound T*k +
min(E, T*k) * (BLOCK_M - 1), so nothing waits for the host and a CUDA graph
of the call replays with other ids of the same T. `align_ref` is the torch
reference."""
from __future__ import annotations

import importlib.util

import torch

from rollout_engine.kernels._triton import cdiv, next_pow2, pdl_args


def align_ref(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The align step in torch ops that stay on the device (no host sync):
    (sorted pair ids [NB * block_m] int32, padding = T*k, and past the total
    unset; block_expert [NB] int32; the padded total [1] int32)."""
    flat = ids.reshape(-1).long()
    pairs = flat.numel()
    blocks = _max_blocks(pairs, experts, block_m)
    dev = flat.device
    sorted_e, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_e, torch.arange(experts + 1, device=dev))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)
    start = end - padded
    dest = start[sorted_e] + torch.arange(pairs, device=dev) - bounds[:-1][sorted_e]
    sorted_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_expert = torch.searchsorted(end, torch.arange(blocks, device=dev) * block_m, right=True).to(torch.int32)
    return sorted_ids, block_expert, end[-1:].to(torch.int32)


def _max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Blocks of the padded pairs at most: every used expert's run rounds up."""
    return max(1, cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m))


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the kernels
    import triton
    import triton.language as tl

    @triton.jit
    def _chunk_counts(ids_ptr, P, first, e, CHUNK: tl.constexpr, SUB: tl.constexpr):
        """Pairs per expert (lanes e) among pairs [first, first + CHUNK)."""
        counts = tl.zeros(e.shape, tl.int32)
        for s in range(0, CHUNK, SUB):
            p = first + s + tl.arange(0, SUB)
            ex = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
            counts += tl.sum((ex[:, None] == e[None, :]).to(tl.int32), axis=0)
        return counts

    @triton.jit(do_not_specialize=["P"])
    def moe_count_kernel(ids_ptr, part_ptr, P, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
                         PDL: tl.constexpr):
        """Chunk c's pairs per expert, to part[c]."""
        if PDL:  # launched early: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        c = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        tl.store(part_ptr + c * BLOCK_E + e, _chunk_counts(ids_ptr, P, c * CHUNK, e, CHUNK=CHUNK, SUB=SUB))

    @triton.jit(do_not_specialize=["P", "NB", "NC", "BPP"])
    def moe_align_kernel(ids_ptr, part_ptr, sorted_ptr, block_expert_ptr, total_ptr, P, NB, NC, BPP,
                         BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
                         ONE_CHUNK: tl.constexpr, PART_ROWS: tl.constexpr, BLOCK_B: tl.constexpr,
                         PAD: tl.constexpr, PDL: tl.constexpr):
        """Chunk c's pairs to their sorted places: expert e's run starts at
        the padded sizes of experts < e, then come the earlier chunks' pairs
        of e, then this chunk's in pair order. The padding sentinels and
        block_expert are shared out between the programs (blocks [c * BPP,
        (c + 1) * BPP) to program c). ONE_CHUNK: one program that counts the
        pairs itself (no count launch). PDL: as the MoE kernels (kernels/moe.py)."""
        if PDL:  # launched early: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        c = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        if ONE_CHUNK:
            counts = _chunk_counts(ids_ptr, P, 0, e, CHUNK=CHUNK, SUB=SUB)
            before = tl.zeros([BLOCK_E], tl.int32)
        else:
            counts = tl.zeros([BLOCK_E], tl.int32)
            before = tl.zeros([BLOCK_E], tl.int32)
            for r0 in range(0, NC, PART_ROWS):
                r = r0 + tl.arange(0, PART_ROWS)
                part = tl.load(part_ptr + r[:, None] * BLOCK_E + e[None, :], mask=(r < NC)[:, None], other=0)
                counts += tl.sum(part, axis=0)
                before += tl.sum(tl.where((r < c)[:, None], part, 0), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, axis=0)
        start = end - padded
        if c == 0:
            tl.store(total_ptr, tl.sum(padded, axis=0))
        for j0 in range(c * PAD, BLOCK_M, NC * PAD):  # padding columns j0.. of every expert
            pos = (start + counts)[:, None] + j0 + tl.arange(0, PAD)[None, :]
            tl.store(sorted_ptr + pos, P, mask=pos < end[:, None])
        b_end = tl.minimum((c + 1) * BPP, NB)
        for b0 in range(c * BPP, b_end, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            ex = tl.sum((end[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, ex, mask=b < b_end)
        run = start + before
        i = tl.arange(0, SUB)
        for s in range(0, CHUNK, SUB):
            p = c * CHUNK + s + i
            ex = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32)
            hot = ex[:, None] == e[None, :]
            earlier = tl.sum(((ex[:, None] == ex[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
            tl.store(sorted_ptr + tl.sum(tl.where(hot, run[None, :], 0), axis=1) + earlier, p, mask=p < P)
            run += tl.sum(hot.to(tl.int32), axis=0)


def _align(ids: torch.Tensor, experts: int, block_m: int,
           max_chunks: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_ref's result in one launch (pairs that fit one program's chunk)
    or two (counts per chunk, then each chunk to its places), in at most
    `max_chunks` chunks (a power of two). Each program walks its chunk in
    steps of SUB pairs one after the other: at 16,384 pairs (2,048 tokens,
    top 8 of 128) 128 chunks took 12.3 us on an H200, 64 took 20.8, 256
    12.5 (benchmarks/moe_kernel.py --sweep). Fewer pairs give the same
    chunks under any of these."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    blocks = _max_blocks(pairs, experts, block_m)
    dev = flat.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = next_pow2(experts)
    sub = max(16, min(64, 8192 // block_e))  # pairs per step: a [sub, experts] one-hot, a [sub, sub] compare
    chunk = max(sub, next_pow2(cdiv(pairs, max_chunks)))
    chunks = cdiv(pairs, chunk)
    one = chunks == 1
    part = total
    if not one:
        part = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
        moe_count_kernel[(chunks,)](flat, part, pairs, CHUNK=chunk, SUB=sub, BLOCK_E=block_e, num_warps=4,
                                    **pdl_args(flat))
    per = cdiv(blocks, chunks)
    moe_align_kernel[(chunks,)](flat, part, sorted_ids, block_expert, total, pairs, blocks, chunks, per,
                                BLOCK_M=block_m, CHUNK=chunk, SUB=sub, BLOCK_E=block_e, ONE_CHUNK=one,
                                PART_ROWS=max(1, min(64, 8192 // block_e)),
                                BLOCK_B=max(1, min(next_pow2(per), 64, 8192 // block_e)), PAD=min(16, block_m),
                                num_warps=4, **pdl_args(flat))
    return sorted_ids, block_expert, total
