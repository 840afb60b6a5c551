"""The Triton decode attention with groups sharing a prompt
(`kernels/group_attention.py`: the shared keys once a group, then each
sequence's own) against the batch kernel alone (every sequence its whole
context), for one preset's heads, replayed in CUDA graphs of `--layers`
calls as a decode step runs them. Also times the grouped launch pair on a
step without groups (the cost a graph captured for groups adds to other
steps) and checks the outputs against the batch kernel's.

    python3 benchmarks/group_attention.py --model qwen2.5-7b --batch-sizes 256 512 --out /tmp/group.json

Needs a CUDA GPU with Triton.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from rollout_engine.bench.common import cuda_time_ms
from rollout_engine.models.presets import PRESETS
from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script


def head_layout(model: str) -> tuple[int, int, int]:
    mc = PRESETS[model]
    heads = mc["num_attention_heads"]
    return heads, mc["num_key_value_heads"], mc.get("head_dim", mc["hidden_size"] // heads)


def make_case(batch: int, group: int, prompt: int, own_max: int, page: int, heads: int, kv_heads: int, dim: int,
              seed: int = 0, device: str = "cuda"):
    """Sequences in groups of `group` sharing a `prompt`-token prefix (whole
    pages), each with U[1, own_max] tokens of its own, pages scattered over
    the pool; the request table as the engine holds it (token -> slot)."""
    rng = np.random.default_rng(seed)
    dev = torch.device(device)
    own = rng.integers(1, own_max + 1, size=batch)
    shared_pages = -(-prompt // page)
    groups = -(-batch // group)
    own_pages = -(-own // page)
    total_pages = groups * shared_pages + int(own_pages.sum()) + 1
    perm = rng.permutation(np.arange(1, total_pages + 1))
    width = prompt + own_max
    table = np.zeros((batch + 1, width), dtype=np.int32)
    t = np.arange(width)
    at = 0
    prefix = {}
    for b in range(batch):
        gi = b // group
        if gi not in prefix:
            prefix[gi] = perm[at: at + shared_pages]
            at += shared_pages
        mine = perm[at: at + own_pages[b]]
        at += own_pages[b]
        n = prompt + own[b]
        tt = t[:n]
        # the shared part: the group's pages; then its own, from a page of its own
        mine_t = np.maximum(tt - prompt, 0)
        slot = np.where(tt < prompt, prefix[gi][np.minimum(tt // page, shared_pages - 1)] * page + tt % page,
                        mine[np.minimum(mine_t // page, len(mine) - 1)] * page + mine_t % page)
        table[b + 1, :n] = slot
    slots = (total_pages + 2) * page
    k = torch.randn(slots, kv_heads, dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn(slots, kv_heads, dim, dtype=torch.bfloat16, device=dev)
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=dev)
    lens = (prompt + own).astype(np.int32)
    keys = np.arange(batch) // group
    return q, k, v, torch.from_numpy(table).to(dev), np.arange(1, batch + 1), lens, keys


def graph_ms(fn, layers: int) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(layers):
            fn()
    return cuda_time_ms(g.replay, reps=30) / layers * 1000.0  # us a call


def run(model: str, batch: int, group: int, prompt: int, own_max: int, page: int, layers: int,
        chunks_list: list[int]) -> dict:
    from rollout_engine.kernels.attention import decode_attention, in_order, longest_first
    from rollout_engine.kernels.group_attention import members_per_group, prefix_attention, prefix_groups

    heads, kv_heads, dim = head_layout(model)
    q, k, v, table, trows, lens, keys = make_case(batch, group, prompt, own_max, page, heads, kv_heads, dim)
    dev = q.device
    scale = dim ** -0.5
    i32 = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32)).to(dev)  # noqa: E731

    order = longest_first(lens)
    r_o, l_o = in_order(order, trows, lens)
    plain_args = (i32(r_o), i32(l_o), i32(order))
    plain = lambda: decode_attention(q, k, v, table, plain_args[0], plain_args[1], scale, plain_args[2])  # noqa: E731
    ref = plain()
    row = {"batch": batch, "group": group, "prompt": prompt, "own_max": own_max, "page": page,
           "plain_us": graph_ms(plain, layers)}
    members = members_per_group(heads // kv_heads)
    pg = prefix_groups(keys, np.full(batch, prompt), trows, members)
    order = longest_first(lens - pg.lo)
    r_o, l_o, lo_o = in_order(order, trows, lens, pg.lo)
    dev_args = [i32(x) for x in (r_o, l_o, order, lo_o, pg.rows, pg.lens, pg.members)]
    # no groups: a graph's room for batch // 2 of them, every length 0 (what a graph captured for groups
    # runs on other steps)
    spare = max(1, batch // 2)
    none_args = [i32(x) for x in (*in_order(longest_first(lens), trows, lens), longest_first(lens),
                                  np.zeros(batch), np.zeros(spare), np.zeros(spare), np.full((spare, members), -1))]
    for chunks in chunks_list:
        def grouped(a=dev_args, chunks=chunks):
            part, ml = prefix_attention(q, k, v, table, a[4], a[5], a[6], scale, chunks, batch)
            return decode_attention(q, k, v, table, a[0], a[1], scale, a[2], prefix=(a[3], part, ml))

        out = grouped()
        row[f"grouped_c{chunks}_us"] = graph_ms(grouped, layers)
        a = dev_args
        row[f"prefix_only_c{chunks}_us"] = graph_ms(
            lambda: prefix_attention(q, k, v, table, a[4], a[5], a[6], scale, chunks, batch), layers)
        states = prefix_attention(q, k, v, table, a[4], a[5], a[6], scale, chunks, batch)
        row[f"own_only_c{chunks}_us"] = graph_ms(
            lambda: decode_attention(q, k, v, table, a[0], a[1], scale, a[2], prefix=(a[3], *states)), layers)
        row[f"grouped_c{chunks}_max_err"] = float((out.float() - ref.float()).abs().max())
        row[f"no_groups_c{chunks}_us"] = graph_ms(lambda: grouped(none_args), layers)
        assert torch.equal(grouped(none_args), ref), "without groups the outputs must be the batch kernel's"
    return row


def tile(text: str) -> tuple[int, int, int]:
    """keys-per-block,warps,stages, each a positive integer."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"a prefix tile is keys-per-block,warps,stages (three positive integers), got {text!r}")
    return tuple(int(p) for p in parts)


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("group_attention.py", __doc__)
    p.add_argument("--model", default="qwen2.5-7b", choices=sorted(PRESETS), help="the head layout of this preset")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[64, 256, 512])
    p.add_argument("--group", type=positive_int, default=8, help="sequences sharing a prompt")
    p.add_argument("--prompt", type=positive_int, default=640, help="shared tokens a group")
    p.add_argument("--own-max", type=positive_int, default=1024, help="own tokens a sequence: U[1, this]")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--layers", type=positive_int, default=8, help="calls a graph replays")
    p.add_argument("--chunks", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--prefix-tiles", nargs="+", type=tile, default=[],
                   help="prefix launch shapes to try, each keys-per-block,warps,stages (default: the module's)")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_args(argv)
    needs_cuda(p, "it times Triton kernels")
    rows = []
    from rollout_engine.kernels import group_attention

    for shape in args.prefix_tiles or [None]:
        if shape is not None:
            group_attention.BLOCK_N, group_attention.WARPS, group_attention.STAGES = shape
        for bs in args.batch_sizes:
            r = run(args.model, bs, args.group, args.prompt, args.own_max, args.page_size, args.layers, args.chunks)
            r["prefix_tile"] = [group_attention.BLOCK_N, group_attention.WARPS, group_attention.STAGES]
            print(json.dumps(r), flush=True)
            rows.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
