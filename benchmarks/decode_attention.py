"""FlashInfer's paged decode attention alone, for the shapes of a model, at
a few batch sizes and contexts (equal or ragged lengths): the CUDA-core
kernel against the tensor-core one (with FlashInfer's split-KV planning and
without), page sizes (1 and 16 by default) and layouts (`--layouts`: the
engine's NHD, or HND), called directly or replayed in a CUDA graph as the
engine does, as achieved KV read bandwidth (bytes of K and V read / kernel
time; `unique_kv_TBps` counts a shared prefix's pages once). Tells which kernel the backend
should pick for a head layout. `--backends triton` times the engine's own
Triton decode kernel (the triton backend's) over the same pages
(`triton-widen`: with an e4m3 cache's products in bf16, as before fp16).

    python3 benchmarks/decode_attention.py --model qwen3-0.6b --out /tmp/attn.json

Needs a CUDA GPU and flashinfer.
"""
from __future__ import annotations

import itertools
import json

import numpy as np
import torch

from rollout_engine.bench.common import cuda_time_ms
from rollout_engine.script_args import ScriptParser, needs_cuda, non_negative_int, positive_int, run_script
from rollout_engine.models.presets import PRESETS


def time_ms(fn) -> float:
    return cuda_time_ms(fn, reps=30)


def run_case(fi, heads: int, kv_heads: int, dim: int, lens: torch.Tensor, page: int, tensor_cores: bool,
             graph: bool, backend: str = "fa2", shared: int = 0, group: int = 1, kv_dtype: torch.dtype = torch.bfloat16,
             layout: str = "NHD", **plan_kw) -> float:
    """Milliseconds of one decode attention call over sequences of `lens`
    tokens; `graph`: planned and replayed as the engine's CUDA graphs are.
    `shared`: each `group` of consecutive sequences has the pages of its first
    `shared` tokens in common (n samples of one prompt). `kv_dtype`: the
    cache's (bf16, or e4m3 as kv_cache_dtype="fp8_e4m3" holds it). `layout`:
    a page as [tokens, heads, dim] (NHD, the engine's) or [heads, tokens, dim]
    (HND: each head's part of a page one contiguous run). `plan_kw`: more
    arguments for the plan (e.g. FlashInfer's split-KV controls)."""
    dev = torch.device("cuda")
    batch = len(lens)
    pages = -(-lens // page)
    indptr = torch.zeros(batch + 1, dtype=torch.int32)
    indptr[1:] = pages.cumsum(0)
    num_pages = int(indptr[-1])
    shape = (num_pages, page, kv_heads, dim) if layout == "NHD" else (num_pages, kv_heads, page, dim)
    k = torch.randn(shape, dtype=torch.bfloat16, device=dev).to(kv_dtype)
    v = torch.randn(shape, dtype=torch.bfloat16, device=dev).to(kv_dtype)
    # Pages of one sequence scattered over the pool, as after many requests came and went.
    indices = torch.randperm(num_pages, device=dev, dtype=torch.int64).to(torch.int32)
    if shared:
        common = shared // page  # whole pages only
        for b in range(batch):
            if b % group:
                head = int(indptr[b - b % group])
                indices[int(indptr[b]): int(indptr[b]) + common] = indices[head: head + common]
    last = (lens - (pages - 1) * page).to(torch.int32)
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=dev)
    if backend.startswith("triton"):
        return _triton_ms(q, k, v, indices, indptr, lens, page, dim, widen=backend == "triton-widen")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    kw = {}
    if graph:
        kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr.to(dev), paged_kv_indices_buffer=indices,
                  paged_kv_last_page_len_buffer=last.to(dev))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tensor_cores, backend=backend, **kw)

    def plan(indptr, last):
        w.plan(indptr, indices, last, heads, kv_heads, dim, page, q_data_type=torch.bfloat16,
               kv_data_type=kv_dtype, **plan_kw)

    if not graph:
        plan(indptr, last)
        return time_ms(lambda: w.run(q, (k, v)))
    # As the engine does: captured over a one-token-per-sequence plan, planned
    # again for the real lengths before each replay.
    plan(torch.arange(batch + 1, dtype=torch.int32), torch.ones(batch, dtype=torch.int32))
    w.run(q, (k, v))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, (k, v))
    plan(indptr, last)
    return time_ms(g.replay)


def _triton_ms(q, k, v, indices, indptr, lens, page: int, dim: int, widen: bool = False) -> float:
    """The engine's Triton decode kernel (`kernels.attention`, the triton
    backend's) over the same pages, through a token -> slot table, replayed
    in a CUDA graph, its programs longest sequence first as the backend
    starts them (`triton_backend.LONGEST_FIRST`). `widen`: an e4m3 cache
    widened to bf16 for the products (`E4M3_IN_F16` off) rather than to fp16."""
    from rollout_engine.attention import triton_backend
    from rollout_engine.kernels import attention
    from rollout_engine.kernels.attention import decode_attention, in_order, longest_first

    attention.E4M3_IN_F16 = not widen
    dev = q.device
    batch, width = len(lens), int(lens.max())
    t = torch.arange(width)
    table = torch.zeros(batch, width, dtype=torch.int32)
    idx = indices.cpu()
    for b in range(batch):
        pages_b = idx[int(indptr[b]): int(indptr[b + 1])].long()
        table[b] = (pages_b[(t // page).clamp(max=len(pages_b) - 1)] * page + t % page).int()
    table = table.to(dev)
    kc, vc = k.view(-1, k.shape[2], dim), v.view(-1, v.shape[2], dim)  # NHD pages as slots
    rows, seq, order = np.arange(batch), lens.numpy(), None
    if triton_backend.LONGEST_FIRST:  # the rows and lengths go in the order too, as the backend sends them
        order = longest_first(seq)
        rows, seq = in_order(order, rows, seq)
        order = torch.from_numpy(order).to(dev)
    rows, seq = (torch.from_numpy(np.asarray(x, dtype=np.int32)).to(dev) for x in (rows, seq))
    out = decode_attention(q, kc, vc, table, rows, seq, dim ** -0.5, order)
    if order is not None:  # the same bits as in row order, or the timing is of something else
        plain = torch.arange(batch, dtype=torch.int32, device=dev)
        assert torch.equal(out, decode_attention(q, kc, vc, table, plain, lens.to(dev, torch.int32), dim ** -0.5))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode_attention(q, kc, vc, table, rows, seq, dim ** -0.5, order)
    return time_ms(g.replay)


def flashinfer_or_exit(p: ScriptParser):
    """FlashInfer on a CUDA machine, or the script's one-line error."""
    needs_cuda(p, "it times FlashInfer's kernels")
    try:
        import flashinfer
    except ImportError:
        p.error("needs flashinfer (the gpu extra)")
    return flashinfer


def head_layout(model: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a preset."""
    mc = PRESETS[model]
    heads = mc["num_attention_heads"]
    return heads, mc["num_key_value_heads"], mc.get("head_dim", mc["hidden_size"] // heads)


def write_rows(out: str | None, model: str, rows: list[dict]) -> None:
    """The report (the preset's head layout, the device, the rows) as JSON at `out`, if given."""
    if out:
        heads, kv_heads, dim = head_layout(model)
        res = {"model": model, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
               "device": torch.cuda.get_device_name(), "rows": rows}
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("decode_attention.py", __doc__)
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(PRESETS), help="the head layout of this preset")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 32, 128, 256], help="requests per batch")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[512, 1024, 4096],
                   help="mean tokens of KV per request")
    p.add_argument("--backends", nargs="+", default=["fa2"], choices=["fa2", "fa3", "triton", "triton-widen"],
                   help="FlashInfer kernels, or the engine's Triton decode kernel (NHD pages only; triton-widen: "
                        "an e4m3 cache widened to bf16, not fp16)")
    p.add_argument("--shared-prefix", type=non_negative_int, default=0,
                   help="tokens at the start of each sequence whose pages a group of --group sequences shares")
    p.add_argument("--group", type=positive_int, default=8, help="sequences per shared prefix")
    p.add_argument("--page-sizes", type=positive_int, nargs="+", default=[1, 16], help="tokens per KV page")
    p.add_argument("--kv-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8_e4m3"],
                   help="KV cache dtypes (kv_cache_dtype): auto is bf16")
    p.add_argument("--layouts", nargs="+", default=["NHD"], choices=["NHD", "HND"],
                   help="page layouts: NHD (the engine's) or HND (heads first)")
    p.add_argument("--engine-only", action="store_true",
                   help="only what the engine runs from 64 rows on: tensor cores, no split, in a graph, "
                        "ragged lengths")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_checked(argv)
    flashinfer = flashinfer_or_exit(p)
    heads, kv_heads, dim = head_layout(args.model)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch in args.batch_sizes:
        for context in args.contexts:
            for ragged in (True,) if args.engine_only else (False, True):
                # ragged: lengths spread over [context / 4, 7 context / 4), mean `context`
                lens = (torch.randint(context // 4, 7 * context // 4, (batch,), generator=gen) if ragged
                        else torch.full((batch,), context))
                if args.shared_prefix:
                    lens = lens + args.shared_prefix
                for page, kv_name in itertools.product(args.page_sizes, args.kv_dtypes):
                    kv_dtype = torch.bfloat16 if kv_name == "auto" else torch.float8_e4m3fn
                    kv_bytes = 2 * int(lens.sum()) * kv_heads * dim * kv_dtype.itemsize
                    # shared pages counted once: the bytes a kernel must bring from memory
                    unique = int(lens.sum()) - (batch - -(-batch // args.group)) * (args.shared_prefix // page * page)
                    unique_bytes = 2 * unique * kv_heads * dim * kv_dtype.itemsize
                    kernels = (((True, False),) if args.engine_only
                               else ((False, True), (True, True), (True, False)))
                    for (tc, split), backend, layout in itertools.product(kernels, args.backends, args.layouts):
                        triton = backend.startswith("triton")
                        if (backend != "fa2" and not tc) or (triton and (split or layout != "NHD")):
                            continue
                        for graph in (True,) if args.engine_only or triton else (False, True):
                            kw = {} if split else {"disable_split_kv": True}
                            try:
                                ms = run_case(flashinfer, heads, kv_heads, dim, lens, page, tc, graph, backend,
                                              args.shared_prefix, args.group, kv_dtype, layout, **kw)
                            except Exception as e:  # a kernel this build lacks: recorded
                                print(backend, "failed:", str(e).splitlines()[0][:200], flush=True)
                                continue
                            row = {"batch": batch, "context": context, "ragged": ragged, "page_size": page,
                                   "kv_cache_dtype": kv_name,
                                   "tensor_cores": tc, "split_kv": split, "graph": graph, "backend": backend,
                                   "layout": layout,
                                   "shared_prefix": args.shared_prefix, "group": args.group,
                                   "us": round(ms * 1e3, 1), "kv_TBps": round(kv_bytes / ms / 1e9, 3),
                                   "unique_kv_TBps": round(unique_bytes / ms / 1e9, 3)}
                            rows.append(row)
                            print(row, flush=True)
    write_rows(args.out, args.model, rows)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
