"""The fp8 one-row products (batch-1 decode, `kernels.fp8_row`) by launch
shape: for each linear layer of a preset, the product as the decoder runs
it at one row (qkv with the RMSNorm, rotary embedding and K/V store inside,
o and down alone, gate_up with the norm and SiLU * mul inside) at the
engine's launch shape and over a grid, against the unfused kernels it
replaced (RMSNorm, the quantize launch, the fp8 batch product, rotary or
SiLU * mul), each over weight copies that spill the L2 cache, in CUDA
graphs. On a CUDA GPU:

    python3 benchmarks/fp8_row_configs.py --model llama-3.1-8b --out /tmp/fp8_row.json
"""
from __future__ import annotations

import itertools
import json

import torch

from gemm_shapes import graph_time_us, write_out  # benchmarks/, the script's own folder
from rollout_engine.script_args import ScriptParser, needs_cuda, run_script
from rollout_engine.kernels.activation import silu_and_mul
from rollout_engine.kernels.batch_gemm import GemmConfig, fp8_batch_gemm, new_counters, use_counters
from rollout_engine.kernels.fp8 import quantize_channels
from rollout_engine.kernels.fp8_quantize import quantize_rows_gpu
from rollout_engine.kernels.fp8_row import config, fp8_row, pairs_fit
from rollout_engine.kernels.gemv import RopeStore
from rollout_engine.kernels.rmsnorm import rmsnorm
from rollout_engine.kernels.rope import rope_and_store
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS, PresetConfig

SPILL_BYTES = 256 << 20  # bytes of fp8 weight copies per shape: past the L2 cache


def grid(n: int, k: int, segment: int | None) -> list[GemmConfig]:
    out = []
    for bn, bk, warps, stages, split in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4), (1, 2, 4, 8)):
        if (bn * bk > 128 * 256 or (bn < 128 and warps == 8) or k // split < bk
                or (segment and not (n % segment == 0 and (segment // 2) % (bn // 2) == 0))):
            continue
        out.append(GemmConfig(16, bn, bk, split, warps, stages, swap=True))
    return out


def run(model: str, only: list[str] | None, full_grid: bool) -> dict:
    mc = ModelConfig.from_hf(PresetConfig(**PRESETS[model]))
    h, d, nq, nk, inter = mc.hidden_size, mc.head_dim, mc.num_heads, mc.num_kv_heads, mc.intermediate_size
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1, h, device=dev).to(torch.bfloat16)
    res = torch.randn(1, h, device=dev).to(torch.bfloat16)
    g = torch.rand(h, device=dev, dtype=torch.bfloat16) + 0.5
    act = torch.randn(1, inter, device=dev).to(torch.bfloat16)
    attn = torch.randn(1, nq * d, device=dev).to(torch.bfloat16)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.outer(torch.arange(64, device=dev).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    pos, slot = torch.tensor([7], device=dev), torch.tensor([3], device=dev)
    k_cache = torch.zeros(8, nk, d, device=dev, dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    rope = RopeStore(pos, cos, sin, k_cache, v_cache, slot, nq, nk)
    norm = dict(norm=(g, mc.rms_norm_eps), residual=res)

    def q_gemm(inp, w):
        qx, sx = quantize_rows_gpu(inp)
        return fp8_batch_gemm(qx, sx, w[0], w[1], None, torch.bfloat16)

    def unfused_qkv(w):
        y = q_gemm(rmsnorm(x, g, mc.rms_norm_eps, res)[0], w)
        q, k, v = y.split([nq * d, nk * d, nk * d], dim=-1)
        return rope_and_store(pos, q.view(1, nq, d), k.view(1, nk, d), v.view(1, nk, d), cos, sin, k_cache, v_cache,
                              slot)

    products = {  # name: (n, k, fused call, unfused call, rows paired per segment)
        "qkv": ((nq + 2 * nk) * d, h, lambda w, c: fp8_row(x, *w, rope=rope, launch=c, **norm), unfused_qkv, d),
        "o": (h, nq * d, lambda w, c: fp8_row(attn, *w, launch=c), lambda w: q_gemm(attn, w), None),
        "gate_up": (2 * inter, h, lambda w, c: fp8_row(x, *w, gated=True, launch=c, **norm),
                    lambda w: silu_and_mul(q_gemm(rmsnorm(x, g, mc.rms_norm_eps, res)[0], w)), 2 * inter),
        "down": (h, inter, lambda w, c: fp8_row(act, *w, launch=c), lambda w: q_gemm(act, w), None),
    }
    out = {"model": model, "device": torch.cuda.get_device_name(), "rows": []}
    for name, (n, k, fused, unfused, segment) in products.items():
        if only and name not in only:
            continue
        if mc.moe is not None and name in ("gate_up", "down"):  # experts run the MoE kernels, not these
            print(f"{name}: {model} is a mixture of experts, whose experts run the MoE kernels; skipped", flush=True)
            continue
        if segment and not pairs_fit(n, k, segment):
            print(f"{name}: rows do not pair at the engine's tiles; skipped", flush=True)
            continue
        copies = max(2, SPILL_BYTES // (n * k))
        held = [quantize_channels(torch.randn(n, k, device=dev) * k ** -0.5) for _ in range(copies)]

        def timed(fn):
            return round(graph_time_us(lambda: [fn(w) for w in held], reps=3) / len(held), 2)

        engine = config(n, k)
        row = {"shape": name, "n": n, "k": k, "engine_launch": list(engine), "unfused_us": timed(unfused),
               "engine_us": timed(lambda w: fused(w, engine))}
        results = {}
        for c in grid(n, k, segment) if full_grid else []:
            try:
                results[",".join(map(str, c))] = timed(lambda w: fused(w, c))
            except Exception as e:  # noqa: BLE001 - a shape the GPU cannot run (shared memory)
                results[",".join(map(str, c))] = str(e).splitlines()[0][:80]
        ok = {c: v for c, v in results.items() if isinstance(v, float)}
        row["best"] = {c: ok[c] for c in sorted(ok, key=ok.get)[:6]}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        held.clear()
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("fp8_row_configs.py", __doc__)
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-3.1-8b", help="preset whose shapes to time")
    p.add_argument("--shapes", nargs="+", choices=["qkv", "o", "gate_up", "down"], help="only these products")
    p.add_argument("--no-grid", action="store_true", help="time the engine's launch shape only")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_checked(argv)
    needs_cuda(p, "the products are timed on the GPU")
    with use_counters(new_counters(torch.device("cuda", torch.cuda.current_device()))):
        write_out(args.out, run(args.model, args.shapes, not args.no_grid))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
