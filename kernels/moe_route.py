"""MoE routing: softmax over the router logits and the top k, in one
launch on the GPU (`route`), with its torch reference (`route_ref`).

One program per few tokens: softmax over the experts in fp32, then the top
k by repeated argmax (ties: the lower expert first), divided by their sum
when renormalized. With a record (routing capture, KVPool.routes) the same
launch also writes each token's expert ids into its KV slot's row."""
from __future__ import annotations

import importlib.util

import torch

from rollout_engine.kernels._triton import cdiv, next_pow2, pdl_args, use_kernel


def route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int32 [T, k]): the k largest of softmax(logits)
    in fp32, descending, ties to the lower expert; divided by their sum when
    `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    vals, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = vals[:, :top_k], order[:, :top_k].to(torch.int32)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.contiguous(), ids.contiguous()


if importlib.util.find_spec("triton") is not None:  # module level: Triton's interpreter sees the kernels
    import triton
    import triton.language as tl

    @triton.jit
    def top_k_rows(x, e, e_ok, TOPK: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
        """For fp32 logits x [rows, BLOCK_E] (lanes e; e_ok: real experts):
        the softmax, then TOPK rounds of argmax (leftmost on ties) with the
        chosen expert masked out. Returns (weights fp32, ids int32), each
        [rows, BLOCK_K], divided by their sum when RENORM."""
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        prob = tl.where(e_ok[None, :], p / tl.sum(p, axis=1)[:, None], -1.0)
        j = tl.arange(0, BLOCK_K)
        vals = tl.zeros([x.shape[0], BLOCK_K], tl.float32)
        idx = tl.zeros([x.shape[0], BLOCK_K], tl.int32)
        for i in tl.static_range(TOPK):
            v = tl.max(prob, axis=1)
            a = tl.argmax(prob, axis=1, tie_break_left=True)
            vals = tl.where(j[None, :] == i, v[:, None], vals)
            idx = tl.where(j[None, :] == i, a[:, None], idx)
            prob = tl.where(e[None, :] == a[:, None], -2.0, prob)
        if RENORM:
            vals = vals / tl.sum(vals, axis=1)[:, None]
        return vals, idx

    @triton.jit(do_not_specialize=["T"])
    def moe_route_kernel(x_ptr, w_ptr, id_ptr, loc_ptr, rec_ptr, T, E, stride_x, stride_rec, ROWS: tl.constexpr,
                         BLOCK_E: tl.constexpr, TOPK: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr,
                         RECORD: tl.constexpr, PDL: tl.constexpr):
        """ROWS tokens: softmax over E in fp32, then TOPK rounds of argmax
        (leftmost on ties) with the chosen expert masked out. RECORD: the ids
        also go to rec[loc[t]] (a token's KV slot: routing capture). PDL: as
        the MoE kernels (kernels/moe.py)."""
        if PDL:  # launched early: nothing read or written before the kernel before has finished
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        row = tl.minimum(t, T - 1).to(tl.int64)  # rows past T repeat the last one, never stored
        x = tl.load(x_ptr + row[:, None] * stride_x + e[None, :], mask=e_ok[None, :], other=float("-inf"))
        vals, idx = top_k_rows(x.to(tl.float32), e, e_ok, TOPK, BLOCK_K, RENORM)
        j = tl.arange(0, BLOCK_K)
        out = t[:, None].to(tl.int64) * TOPK + j[None, :]
        ok = (t < T)[:, None] & (j < TOPK)[None, :]
        tl.store(w_ptr + out, vals, mask=ok)
        tl.store(id_ptr + out, idx, mask=ok)
        if RECORD:
            slot = tl.load(loc_ptr + row).to(tl.int64)
            tl.store(rec_ptr + slot[:, None] * stride_rec + j[None, :], idx.to(rec_ptr.dtype.element_ty), mask=ok)


Record = tuple[torch.Tensor, torch.Tensor]  # (dest [slots, k] with unit last stride, KV slot per token [T])


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          record: Record | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route_ref's (weights fp32 [T, k], ids int32 [T, k]) in one launch on
    the GPU; the reference elsewhere. `record` (dest, loc): also dest[loc[t]]
    = the ids of token t, in dest's dtype (routing capture, in the same launch)."""
    if not use_kernel(logits):
        weights, ids = route_ref(logits, top_k, renormalize)
        if record is not None and len(ids):
            dest, loc = record
            dest[loc] = ids.to(dest.dtype)
        return weights, ids
    return _route_triton(logits, top_k, renormalize, record)


def _route_triton(logits: torch.Tensor, top_k: int, renormalize: bool, record: Record | None = None,
                  rows: int = 4, warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dest, loc = record if record is not None else (ids, ids)
    if record is not None:
        assert dest.stride(1) == 1 and dest.shape[1] == top_k, "the record's rows hold a token's k ids"
    moe_route_kernel[(cdiv(tokens, rows),)](logits, weights, ids, loc, dest, tokens, experts, logits.stride(0),
                                            dest.stride(0), ROWS=rows, BLOCK_E=next_pow2(experts), TOPK=top_k,
                                            BLOCK_K=next_pow2(top_k), RENORM=renormalize,
                                            RECORD=record is not None, num_warps=warps, **pdl_args(logits))
    return weights, ids
