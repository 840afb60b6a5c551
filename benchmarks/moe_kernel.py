"""The MoE layer's kernels alone (kernels/moe.py) at the expert shapes of
the models `--shape` names (one layer each, bf16): routing, align, and the whole fused call (align,
gate/up product with SiLU * up, down product, slot sum) at several token
counts, each captured in a CUDA graph as the engine runs it and timed by
CUDA events (median over replays, after warm-up). The ids come from `route`
on random logits (about uniform over the experts).

Each call's share of the limit that binds: the bytes of the distinct experts
picked (their w13 and w2 read once) plus x and the output, over the copy
bandwidth measured in the same run, or 2*T*k*3*H*I FLOPs over the measured
bf16 rate of an 8192^3 matmul. On a CUDA GPU:

    python3 benchmarks/moe_kernel.py --shape qwen3-30b-a3b --tokens 8,64,256,2048 --out /tmp/moe.json

Where the launch shape runs short tails (moe.MoeLaunch.tails) the report also
has the same launch without them (`whole_blocks_us`, `up_whole_us`,
`down_whole_us`). At one token the report also has the blocks path's time (`blocks_us`: with
the align launch) beside the one-token path's (`moe_us`: one pair per block,
no align), and the whole sparse MLP after the attention (norm, router,
routing, experts) in kernels/moe_row.py's three launches (`row_us`) and
unfused (`row_unfused_us`).

`experts_us` is the gate/up and down launches and the slot sum after the
align, in one graph, as the engine runs them (`up_us`, `down_us` and
`sum_us` time them one by one).

`--sweep` also times every candidate launch shape of the two products per
block size (SWEEP_UP, SWEEP_DOWN), the data behind moe.pick's tables, and
from 64-pair blocks the whole call with short tails for the best of them."""
from __future__ import annotations

import json
import statistics

import torch
from gemm_shapes import write_out  # benchmarks/, the script's own folder

from rollout_engine.bench.roofline import measure_device
from rollout_engine.script_args import ScriptParser, needs_cuda, run_script
from rollout_engine.kernels import moe, moe_align, moe_route, moe_row
from rollout_engine.kernels.gemv import linear
from rollout_engine.kernels.rmsnorm import rmsnorm
from rollout_engine.kernels.moe import Tiles

SHAPES = {  # experts, top_k, hidden, intermediate (per expert), renormalize
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral": (8, 2, 4096, 14336, True),
    "olmoe": (64, 8, 2048, 1024, False),
}

# (block_n, block_k, warps, stages) per block_m
SWEEP_UP = {
    16: [Tiles(64, 128, 4, 4), Tiles(32, 128, 4, 4), Tiles(64, 256, 4, 3), Tiles(32, 256, 4, 4), Tiles(64, 128, 4, 6)],
    32: [Tiles(64, 128, 4, 4), Tiles(64, 256, 4, 3), Tiles(128, 64, 4, 4)],
    64: [Tiles(64, 128, 4, 3), Tiles(64, 64, 4, 4), Tiles(128, 64, 8, 3), Tiles(64, 128, 4, 4), Tiles(128, 64, 8, 4),
         Tiles(128, 128, 8, 3), Tiles(64, 64, 4, 6), Tiles(64, 128, 8, 4), Tiles(128, 64, 8, 4, 16),
         Tiles(128, 64, 4, 4)],
    128: [Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 4), Tiles(64, 64, 4, 3), Tiles(128, 32, 8, 5), Tiles(64, 64, 8, 4),
          Tiles(64, 128, 8, 3), Tiles(128, 128, 8, 2), Tiles(128, 64, 8, 4, 16), Tiles(128, 64, 8, 4, 4),
          Tiles(64, 64, 4, 5)],
}
SWEEP_DOWN = {
    16: [Tiles(64, 128, 4, 4), Tiles(64, 256, 4, 3), Tiles(32, 256, 4, 4), Tiles(128, 64, 4, 4)],
    32: [Tiles(64, 128, 4, 4), Tiles(128, 64, 4, 4), Tiles(64, 256, 4, 3)],
    64: [Tiles(128, 64, 8, 3), Tiles(64, 128, 4, 4), Tiles(128, 128, 8, 3), Tiles(128, 64, 4, 4), Tiles(256, 64, 8, 3),
         Tiles(64, 64, 4, 5), Tiles(128, 64, 8, 4), Tiles(128, 64, 8, 3, 16)],
    128: [Tiles(128, 64, 8, 3), Tiles(256, 64, 8, 3), Tiles(128, 64, 8, 4), Tiles(256, 32, 8, 4), Tiles(64, 128, 4, 4),
          Tiles(128, 128, 8, 3), Tiles(64, 64, 4, 4), Tiles(128, 64, 8, 3, 16), Tiles(64, 128, 8, 3)],
}
# One token's sparse MLP (kernels/moe_row.py, blocks of 16: one row each): the
# gate/up tiles with the down launch's fixed to DECODE's, then the other way.
SWEEP_ROW_UP = [Tiles(64, 256, 4, 3), Tiles(32, 256, 4, 4), Tiles(32, 128, 4, 6), Tiles(16, 256, 4, 4),
                Tiles(32, 512, 4, 2), Tiles(64, 128, 4, 6), Tiles(32, 256, 2, 4), Tiles(16, 512, 4, 3),
                Tiles(64, 256, 8, 3), Tiles(16, 256, 2, 6)]
SWEEP_ROW_DOWN = [Tiles(64, 256, 4, 3), Tiles(32, 256, 4, 3), Tiles(128, 128, 4, 4), Tiles(64, 128, 4, 4),
                  Tiles(16, 256, 4, 3), Tiles(32, 512, 4, 2), Tiles(64, 256, 2, 3), Tiles(32, 128, 4, 6),
                  Tiles(128, 256, 8, 3)]


def sweep_block_ms(rows: float) -> list[int]:
    """Block sizes worth timing at `rows` mean pairs per expert (64, the
    invariant shape's, always; 16 and 32 up to 96, 128 from 24)."""
    return ([16, 32] if rows <= 96 else []) + [64] + ([128] if rows > 24 else [])


def graph_us(fn, calls: int = 1, reps: int = 30, warmup: int = 5) -> float:
    """Median device time of one call of `fn`: `calls` calls captured in one
    CUDA graph, each of `reps` replays between two events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in events) / calls


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def run_shape(name: str, tokens: list[int], limits, sweep: bool, dev: str = "cuda") -> dict:
    experts, top_k, hidden, inter, renorm = SHAPES[name]
    dt = torch.bfloat16
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=dev, dtype=dt) * 0.02
    expert_bytes = 3 * hidden * inter * w13.element_size()
    rows, sweeps = [], []
    for t in tokens:
        logits = torch.randn(t, experts, device=dev, dtype=dt)
        x = torch.randn(t, hidden, device=dev, dtype=dt)
        weights, ids = moe_route.route(logits, top_k, renorm)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * expert_bytes + 2 * t * hidden * x.element_size() + t * top_k * 8
        flops = 2 * t * top_k * 3 * hidden * inter
        bw_us, fl_us = nbytes / limits.bandwidth * 1e6, flops / limits.flops * 1e6
        cfg = moe.pick(t, top_k, experts)
        pairs = t * top_k
        aligned = moe_align._align(ids, experts, cfg.block_m)
        act = moe._up(x, w13, aligned, pairs, top_k, cfg.block_m, cfg.up, tails=cfg.tails)
        rw = weights.reshape(-1).float()
        y = moe._down(act, w2, rw, aligned, cfg.block_m, cfg.down, tails=cfg.tails)
        row = {"tokens": t, "distinct_experts": distinct, "bytes": nbytes, "flops": flops,
               "bound": "bandwidth" if bw_us >= fl_us else "compute", "limit_us": round(max(bw_us, fl_us), 2),
               "config": cfg._asdict() | {"up": cfg.up._asdict(), "down": cfg.down._asdict()},
               "moe_us": graph_us(lambda: moe.fused_moe(x, w13, w2, weights, ids), calls=3),
               "invariant_us": graph_us(lambda: moe.fused_moe(x, w13, w2, weights, ids, invariant=True), calls=3),
               "route_us": graph_us(lambda: moe_route.route(logits, top_k, renorm), calls=10),
               "align_us": graph_us(lambda: moe_align._align(ids, experts, cfg.block_m), calls=10),
               "align_torch_us": graph_us(lambda: moe_align.align_ref(ids, experts, cfg.block_m), calls=10),
               "up_us": graph_us(lambda: moe._up(x, w13, aligned, pairs, top_k, cfg.block_m, cfg.up,
                                                 tails=cfg.tails), calls=3),
               "down_us": graph_us(lambda: moe._down(act, w2, rw, aligned, cfg.block_m, cfg.down, tails=cfg.tails),
                                   calls=3),
               "sum_us": graph_us(lambda: moe._sum_slots(y, t, top_k), calls=10),
               "experts_us": graph_us(lambda: moe._experts(x, w13, w2, rw, aligned, top_k, cfg), calls=3)}
        if cfg.tails:  # the same launch with every block running all its rows
            whole = cfg._replace(tails=False)
            row["whole_blocks_us"] = round(graph_us(lambda: moe._fused_moe_triton(x, w13, w2, weights, ids, whole),
                                                    calls=3), 2)
            row["up_whole_us"] = round(graph_us(lambda: moe._up(x, w13, aligned, pairs, top_k, cfg.block_m, cfg.up),
                                                calls=3), 2)
            row["down_whole_us"] = round(graph_us(lambda: moe._down(act, w2, weights.reshape(-1), aligned,
                                                                    cfg.block_m, cfg.down), calls=3), 2)
        if t == 1:  # one token without the align launch (moe._fused_moe_one) against the blocks path
            row["blocks_us"] = round(graph_us(lambda: moe._fused_moe_triton(x, w13, w2, weights, ids, moe.DECODE),
                                              calls=3), 2)
            row.update(sparse_mlp_row_us(x, w13, w2, top_k, renorm))
            if sweep:
                sweeps += sweep_row(name, x, w13, w2, top_k, renorm)
        row["share"] = round(row["limit_us"] / row["moe_us"], 3)
        row["invariant_share"] = round(row["limit_us"] / row["invariant_us"], 3)
        ref = moe.fused_moe_ref(x, w13, w2, weights, ids)
        ref32 = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        row["rel_err"] = round(_rel_err(moe.fused_moe(x, w13, w2, weights, ids), ref32), 6)
        row["ref_rel_err"] = round(_rel_err(ref, ref32), 6)
        row["invariant_rel_err"] = round(_rel_err(moe.fused_moe(x, w13, w2, weights, ids, invariant=True), ref32), 6)
        for key in ("moe_us", "invariant_us", "route_us", "align_us", "align_torch_us", "up_us", "down_us", "sum_us",
                    "experts_us"):
            row[key] = round(row[key], 2)
        rows.append(row)
        print(f"{name} T={t}: {row['moe_us']} us ({row['share']:.0%} of the {row['bound']} limit "
              f"{row['limit_us']} us; {distinct} experts, {nbytes / 1e6:.0f} MB, {flops / 1e9:.1f} GFLOP) "
              f"invariant {row['invariant_us']} us ({row['invariant_share']:.0%}) | route {row['route_us']} "
              f"align {row['align_us']} (torch {row['align_torch_us']}) up {row['up_us']} down {row['down_us']} "
              f"sum {row['sum_us']} (the three in one graph {row['experts_us']}) | block_m {cfg.block_m} "
              f"| err {row['rel_err']} (ref {row['ref_rel_err']})"
              + (f" | blocks path {row['blocks_us']} us" if t == 1 else "")
              + (f" | whole blocks {row['whole_blocks_us']} us (up {row['up_whole_us']} down {row['down_whole_us']})"
                 if cfg.tails else ""))
        if sweep:
            sweeps += sweep_tokens(name, t, x, w13, w2, weights, ids)
        del aligned, act, y
    return {"shape": name, "experts": experts, "top_k": top_k, "hidden": hidden, "intermediate": inter,
            "rows": rows, "sweep": sweeps}


def _row_inputs(x: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's residual stream, post-attention norm weight and router, beside x."""
    residual = torch.randn_like(x)
    norm_w = torch.ones(x.shape[1], device=x.device, dtype=x.dtype)
    router = torch.randn(experts, x.shape[1], device=x.device, dtype=x.dtype) * 0.02
    return residual, norm_w, router


def sparse_mlp_row_us(x, w13, w2, top_k, renorm) -> dict:
    """One token's whole sparse MLP after the attention: kernels/moe_row.py's
    three launches (`row_us`) against the launches they replace
    (`row_unfused_us`: norm, router product, routing, experts)."""
    residual, norm_w, router = _row_inputs(x, w13.shape[0])

    def unfused():
        h, r = rmsnorm(x, norm_w, 1e-6, residual)
        weights, ids = moe_route.route(linear(h, router), top_k, renorm)
        return moe.fused_moe(h, w13, w2, weights, ids), r

    out = {"row_us": graph_us(lambda: moe_row.moe_row(x, residual, norm_w, 1e-6, router, w13, w2, top_k, renorm),
                              calls=3),
           "row_unfused_us": graph_us(unfused, calls=3)}
    print(f"  one token's sparse MLP: {out['row_us']:.2f} us in three launches, {out['row_unfused_us']:.2f} unfused")
    return {k: round(v, 2) for k, v in out.items()}


def sweep_row(name, x, w13, w2, top_k, renorm) -> list[dict]:
    """One token's sparse MLP in moe_row's three launches with each candidate
    gate/up tile (down as DECODE's), then each down tile (gate/up as DECODE's)."""
    residual, norm_w, router = _row_inputs(x, w13.shape[0])
    out = []
    for product, cands in (("row_up", SWEEP_ROW_UP), ("row_down", SWEEP_ROW_DOWN)):
        for tiles in cands:
            launch = moe.DECODE._replace(**{product[4:]: tiles})
            fn = lambda: moe_row.moe_row(x, residual, norm_w, 1e-6, router, w13, w2, top_k, renorm,  # noqa: E731
                                         config=launch)
            try:
                rec = {"us": round(graph_us(fn, calls=3, reps=20), 2)}
            except Exception as exc:  # noqa: BLE001 - a shape the GPU cannot run (shared memory)
                rec = {"error": str(exc)[:200]}
            out.append({"shape": name, "tokens": 1, "product": product, "tiles": list(tiles)} | rec)
        print(f"  sweep {name} T=1 {product}: " + " ".join(f"{tuple(r['tiles'])}={r.get('us', 'x')}" for r in out
                                                         if r["product"] == product))
    return out


def sweep_tokens(name, t, x, w13, w2, weights, ids) -> list[dict]:
    experts, top_k = w13.shape[0], ids.shape[1]
    pairs = t * top_k
    rw = weights.reshape(-1)
    out = []
    for bm in sweep_block_ms(pairs / experts):
        aligned = moe_align._align(ids, experts, bm)
        align_us = graph_us(lambda: moe_align._align(ids, experts, bm), calls=10)
        for most in (16, 32, 64, 256, 512):  # the align's chunks at most (128 in the engine)
            us = round(graph_us(lambda: moe_align._align(ids, experts, bm, most), calls=10), 2)
            out.append({"shape": name, "tokens": t, "block_m": bm, "product": "align", "max_chunks": most, "us": us})
        print(f"  sweep {name} T={t} block_m={bm} align: 128 chunks {align_us:.2f} us, "
              + " ".join(f"{r['max_chunks']}: {r['us']}" for r in out if r.get("product") == "align"
                         and r["tokens"] == t and r["block_m"] == bm))
        best = {}
        act = None
        for product, cands in (("up", SWEEP_UP[bm]), ("down", SWEEP_DOWN[bm])):
            for tiles in cands:
                if product == "up":
                    fn = lambda: moe._up(x, w13, aligned, pairs, top_k, bm, tiles)  # noqa: E731
                else:
                    fn = lambda: moe._down(act, w2, rw, aligned, bm, tiles)  # noqa: E731
                try:
                    us = round(graph_us(fn, calls=3, reps=15), 2)
                except Exception as exc:  # noqa: BLE001 - a shape the GPU cannot run (shared memory)
                    out.append({"shape": name, "tokens": t, "block_m": bm, "product": product,
                                "tiles": list(tiles), "error": str(exc)[:200]})
                    continue
                if product == "up" and act is None:
                    act = fn()
                out.append({"shape": name, "tokens": t, "block_m": bm, "product": product, "tiles": list(tiles),
                            "us": us})
                if us < best.get(product, (1e30,))[0]:
                    best[product] = (us, tiles)
        if len(best) == 2:
            total = align_us + best["up"][0] + best["down"][0]
            print(f"  sweep {name} T={t} block_m={bm}: align {align_us:.1f} + up {best['up'][0]} {tuple(best['up'][1])}"
                  f" + down {best['down'][0]} {tuple(best['down'][1])} = {total:.1f} us (+ sum)")
            for product in ("up", "down"):
                print("    " + product + ": " + " ".join(f"{tuple(r['tiles'])}={r.get('us', 'x')}" for r in out
                                                         if r["tokens"] == t and r["block_m"] == bm
                                                         and r["product"] == product))
        if bm >= 64:  # short tails (MoeLaunch.tails): the whole call, the three best tiles of each product
            out += sweep_tails(name, t, bm, x, w13, w2, weights, ids, out)
    return out


def sweep_tails(name, t, bm, x, w13, w2, weights, ids, rows: list[dict]) -> list[dict]:
    """The whole fused call with short tails at block size `bm`, for the
    three fastest gate/up and down tiles of `rows` (timed whole-block)."""
    def best(product):
        timed = [r for r in rows if r["tokens"] == t and r["block_m"] == bm and r["product"] == product and "us" in r]
        return [Tiles(*r["tiles"]) for r in sorted(timed, key=lambda r: r["us"])[:3]]

    out = []
    for up in best("up"):
        for down in best("down"):
            launch = moe.MoeLaunch(bm, up, down, tails=True)
            us = round(graph_us(lambda: moe._fused_moe_triton(x, w13, w2, weights, ids, launch), calls=3, reps=15), 2)
            out.append({"shape": name, "tokens": t, "block_m": bm, "product": "fused_tails", "up": list(up),
                        "down": list(down), "us": us})
    print(f"  sweep {name} T={t} block_m={bm} with short tails: " + " ".join(
        f"{tuple(r['up'])}/{tuple(r['down'])}={r['us']}" for r in out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("moe_kernel.py", __doc__)
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["qwen3-30b-a3b"],
                   help="expert shapes of these models")
    p.add_argument("--tokens", nargs="+", default=["1,8,64,256,2048"],
                   help="token counts, separated by commas or spaces")
    p.add_argument("--sweep", action="store_true", help="also time every candidate launch shape")
    p.add_argument("--out", help="write the report here (JSON)")
    args = p.parse_checked(argv)
    try:
        tokens = [int(v) for text in args.tokens for v in text.split(",")]
    except ValueError:
        tokens = []
    if not tokens or any(v <= 0 for v in tokens):
        p.error(f"argument --tokens: positive integers separated by commas or spaces, not {' '.join(args.tokens)!r}")
    needs_cuda(p, "the kernels are timed on the GPU")
    limits = measure_device()
    result = {"device": torch.cuda.get_device_name(), "copy_TBps": round(limits.bandwidth / 1e12, 3),
              "matmul_TFLOPs": round(limits.flops / 1e12, 1), "shapes": []}
    print(f"{result['device']}: copy {result['copy_TBps']} TB/s, bf16 matmul {result['matmul_TFLOPs']} TFLOP/s")
    for name in args.shape:
        result["shapes"].append(run_shape(name, tokens, limits, args.sweep))
        write_out(args.out, result)  # after each shape: a run cut short keeps what it measured
    if not args.out:
        print(json.dumps({k: v for k, v in result.items() if k != "shapes"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
