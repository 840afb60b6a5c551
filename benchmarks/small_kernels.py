"""The small kernels of a decode step, alone: add + RMSNorm, rotary (with
Qwen3's q/k norm and the KV store) and SiLU * mul, at the shapes a running
batch has, each replayed in a CUDA graph as the engine runs it, per launch
variant (warps per program; for the rotary kernel, one program per token or
two: q in one, k and v in the other). Their memory traffic is small, so the
time is mostly the latency of one program's chain of loads and stores; the
variants say which launch shape hides it best. On a CUDA GPU:

    python3 benchmarks/small_kernels.py --rows 1 64 256 --out /tmp/small.json
"""
from __future__ import annotations

import torch
from gemm_shapes import graph_time_us, write_out  # benchmarks/, the script's own folder

from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script
from rollout_engine.kernels.activation import silu_and_mul
from rollout_engine.kernels.rmsnorm import rmsnorm
from rollout_engine.kernels.rope import _launch as rope_launch
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS, PresetConfig


def rows_for(model: str, m: int) -> list[dict]:
    mc = ModelConfig.from_hf(PresetConfig(**PRESETS[model]))
    dev, dt = "cuda", torch.bfloat16
    h, d, nq, nk = mc.hidden_size, mc.head_dim, mc.num_heads, mc.num_kv_heads
    out = []
    x, res, w = (torch.randn(m, h, device=dev, dtype=dt), torch.randn(m, h, device=dev, dtype=dt),
                 torch.ones(h, device=dev, dtype=dt))
    for warps in (1, 2, 4, 8, 16):
        out.append({"kernel": "add_rmsnorm", "variant": f"w{warps}",
                    "us": graph_time_us(lambda: rmsnorm(x, w, 1e-6, res, warps=warps))})
    qkv = torch.randn(m, (nq + 2 * nk) * d, device=dev, dtype=dt)
    q, k, v = qkv.split([nq * d, nk * d, nk * d], dim=-1)
    q, k, v = q.view(m, nq, d), k.view(m, nk, d), v.view(m, nk, d)
    slots = 4096
    kc, vc = (torch.zeros(slots, nk, d, device=dev, dtype=dt) for _ in range(2))
    loc = torch.randperm(slots, device=dev)[:m]
    pos = torch.randint(0, 2048, (m,), device=dev)
    cos, sin = torch.randn(4096, d // 2, device=dev), torch.randn(4096, d // 2, device=dev)
    qo = torch.empty_like(q, memory_format=torch.contiguous_format)
    norm = (torch.ones(d, device=dev, dtype=dt), torch.ones(d, device=dev, dtype=dt), 1e-6) if mc.qk_norm else None
    for split in (False, True):
        for warps in (1, 2, 4, 8):
            out.append({"kernel": "rope_store", "variant": f"{'split' if split else 'one'}_w{warps}",
                        "us": graph_time_us(lambda: rope_launch(pos, q, k, v, qo, kc, vc, loc, cos, sin, True, norm,
                                                                 split=split, warps=warps))})
    gu = torch.randn(m, 2 * mc.intermediate_size, device=dev, dtype=dt)
    for block in (512, 1024, 2048, 4096):
        for warps in (2, 4, 8):
            out.append({"kernel": "silu_mul", "variant": f"b{block}_w{warps}",
                        "us": graph_time_us(lambda: silu_and_mul(gu, block=block, warps=warps))})
    for row in out:
        row.update(model=model, m=m, us=round(row["us"], 2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("small_kernels.py", __doc__)
    p.add_argument("--models", nargs="+", choices=sorted(PRESETS), default=["qwen3-0.6b", "qwen2.5-7b", "llama-3.1-8b"])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 64, 256], help="row counts (tokens)")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_args(argv)
    needs_cuda(p, "the kernels are timed on the GPU")
    result = {"device": torch.cuda.get_device_name(), "rows": []}
    for model in args.models:
        for m in args.rows:
            rows = rows_for(model, m)
            result["rows"] += rows
            for kernel in ("add_rmsnorm", "rope_store", "silu_mul"):
                mine = [r for r in rows if r["kernel"] == kernel]
                best = min(mine, key=lambda r: r["us"])
                print(f"{model} m={m} {kernel}: " + " ".join(f"{r['variant']}={r['us']}" for r in mine)
                      + f"  best {best['variant']}")
    write_out(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
