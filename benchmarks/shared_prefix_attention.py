"""Decode attention for GRPO groups, two ways, with FlashInfer's kernels as
the engine plans them (tensor cores, no split, replayed in a CUDA graph):

- one call over each sequence's whole context (what the engine runs): the
  pages of a group's prompt are read once per sample, from L2 when the
  samples' programs run close together;
- two levels: the shared prompt once per group (a prefill-style call, the
  group's queries together, non-causal), each sample's own pages in a
  decode call, and the two states merged (FlashInfer's merge with a row
  mask, as a graph replays it), the queries put in group order and back.

Each batch holds groups of --group sequences sharing a prompt of
--shared-prefixes tokens (whole pages), each with its own tokens on top
(ragged, mean --unique-lens).
`--orders`: the batch's rows in group order (samples of a prompt adjacent,
as the engine admits them) or shuffled. Reports each way's time, the
two-level one's parts, and their largest difference (bf16 rounding).

    python3 benchmarks/shared_prefix_attention.py --model qwen2.5-7b --out /tmp/shared.json

Needs a CUDA GPU and flashinfer.
"""
from __future__ import annotations

import itertools

import torch

from decode_attention import flashinfer_or_exit, head_layout, write_rows  # benchmarks/, the script's own folder
from gemm_shapes import graph_time_us
from rollout_engine.script_args import ScriptParser, positive_int, run_script
from rollout_engine.models.presets import PRESETS

WORKSPACE = 256 << 20


def _layout(batch: int, group: int, shared: int, unique_mean: int, page: int, grouped: bool, gen):
    """Page lists: each group's shared pages, each row's own, rows in order."""
    unique = torch.randint(max(1, unique_mean // 4), max(2, 7 * unique_mean // 4), (batch,), generator=gen)
    groups, shared_pages = batch // group, shared // page
    own = -(-unique // page)
    total = groups * shared_pages + int(own.sum()) + 1  # page 0 stays unused
    ids = (torch.randperm(total - 1, generator=gen) + 1).to(torch.int32)
    group_pages = [ids[g * shared_pages:(g + 1) * shared_pages] for g in range(groups)]
    offsets = torch.cumsum(own, 0) - own + groups * shared_pages
    order = torch.arange(batch) if grouped else torch.randperm(batch, generator=gen)
    rows = [(int(b) // group, ids[int(offsets[b]): int(offsets[b]) + int(own[b])], int(unique[b])) for b in order]
    return total, group_pages, rows


def run_case(fi, heads: int, kv_heads: int, dim: int, batch: int, group: int, shared: int, unique_mean: int,
             page: int, grouped: bool, seed: int = 0) -> dict:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    total, group_pages, rows = _layout(batch, group, shared, unique_mean, page, grouped, gen)
    k = torch.randn(total, page, kv_heads, dim, dtype=bf16, device=dev)
    v = torch.randn(total, page, kv_heads, dim, dtype=bf16, device=dev)
    q = torch.randn(batch, heads, dim, dtype=bf16, device=dev)
    i32 = dict(dtype=torch.int32)

    def table(page_lists):
        indptr = torch.zeros(len(page_lists) + 1, **i32)
        indptr[1:] = torch.cumsum(torch.tensor([len(p) for p in page_lists]), 0)
        return indptr, torch.cat(page_lists).to(dev)

    last = torch.tensor([n - (-(-n // page) - 1) * page for _, _, n in rows], **i32)

    def decode_wrapper(indptr, indices):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(WORKSPACE, dtype=torch.uint8, device=dev), "NHD", use_tensor_cores=True, backend="fa2",
            use_cuda_graph=True, paged_kv_indptr_buffer=indptr.to(dev),
            paged_kv_indices_buffer=torch.zeros(len(indices), device=dev, **i32),
            paged_kv_last_page_len_buffer=last.to(dev))
        w.plan(indptr, indices, last, heads, kv_heads, dim, page, q_data_type=bf16, kv_data_type=bf16,
               disable_split_kv=True)
        return w

    whole = decode_wrapper(*table([torch.cat([group_pages[g], own]) for g, own, _ in rows]))
    one_us, reference = graph_time_us(lambda: whole.run(q, (k, v))), whole.run(q, (k, v))

    own_level = decode_wrapper(*table([own for _, own, _ in rows]))
    row_group = torch.tensor([g for g, _, _ in rows])
    perm = torch.argsort(row_group, stable=True)
    qo_indptr = torch.arange(0, batch + 1, group, **i32)
    g_indptr, g_indices = table(group_pages)
    g_last = torch.full((len(group_pages),), page, **i32)
    prompt_level = fi.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True,
        qo_indptr_buf=qo_indptr.to(dev), paged_kv_indptr_buf=g_indptr.to(dev),
        paged_kv_indices_buf=torch.zeros(len(g_indices), device=dev, **i32),
        paged_kv_last_page_len_buf=g_last.to(dev), backend="fa2")
    prompt_level.plan(qo_indptr, g_indptr, g_indices, g_last, heads, kv_heads, dim, page, causal=False,
                      q_data_type=bf16, kv_data_type=bf16, disable_split_kv=True)
    perm_d, inverse_d = perm.to(dev), torch.argsort(perm).to(dev)
    mask = torch.ones(batch, dtype=torch.bool, device=dev)

    def two_levels():
        o_prompt, s_prompt = prompt_level.run(q.index_select(0, perm_d), (k, v), return_lse=True)
        o, s = own_level.run(q, (k, v), return_lse=True)
        fi.merge_state_in_place(o, s, o_prompt.index_select(0, inverse_d), s_prompt.index_select(0, inverse_d),
                                mask)
        return o

    two_us, merged = graph_time_us(two_levels), two_levels()
    prompt_us = graph_time_us(lambda: prompt_level.run(q, (k, v), return_lse=True))
    own_us = graph_time_us(lambda: own_level.run(q, (k, v), return_lse=True))
    return {"batch": batch, "group": group, "shared_prefix": shared, "unique_mean": unique_mean, "page_size": page,
            "order": "grouped" if grouped else "shuffled", "one_call_us": round(one_us, 1),
            "two_levels_us": round(two_us, 1), "prompt_level_us": round(prompt_us, 1),
            "own_level_us": round(own_us, 1), "speedup": round(one_us / two_us, 3),
            "max_abs_diff": (merged.float() - reference.float()).abs().max().item()}


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("shared_prefix_attention.py", __doc__)
    p.add_argument("--model", default="qwen2.5-7b", choices=sorted(PRESETS), help="the head layout of this preset")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[64, 256, 512], help="sequences per batch")
    p.add_argument("--shared-prefixes", type=positive_int, nargs="+", default=[640],
                   help="tokens of each group's shared prompt: a whole number of pages of every page size")
    p.add_argument("--unique-lens", type=positive_int, nargs="+", default=[64, 512, 1024],
                   help="mean tokens of each sequence's own (ragged over [mean / 4, 7 mean / 4))")
    p.add_argument("--group", type=positive_int, default=8, help="sequences per shared prompt")
    p.add_argument("--page-sizes", type=positive_int, nargs="+", default=[16], help="tokens per KV page")
    p.add_argument("--orders", nargs="+", choices=["grouped", "shuffled"], default=["grouped", "shuffled"],
                   help="the batch's rows in group order, or shuffled")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_checked(argv)
    for batch in args.batch_sizes:
        if batch % args.group:
            p.error(f"argument --batch-sizes: {batch} is not a multiple of --group {args.group}")
    for shared, page in itertools.product(args.shared_prefixes, args.page_sizes):
        if shared % page:
            p.error(f"argument --shared-prefixes: {shared} is not a whole number of pages of {page} tokens")
    flashinfer = flashinfer_or_exit(p)
    heads, kv_heads, dim = head_layout(args.model)
    rows = []
    for batch, shared, unique, page, order in itertools.product(args.batch_sizes, args.shared_prefixes,
                                                                 args.unique_lens, args.page_sizes, args.orders):
        row = run_case(flashinfer, heads, kv_heads, dim, batch, args.group, shared, unique, page, order == "grouped")
        print(row, flush=True)
        rows.append(row)
    write_rows(args.out, args.model, rows)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
