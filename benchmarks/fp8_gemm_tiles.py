"""The fp8 products at prefill and large decode batches (from 65 rows the
engine calls cuBLAS's row-scaled fp8 GEMM, `torch._scaled_mm`): against
a Triton tile kernel reading both operands through TMA (e4m3, fp32 sums, the
row and column scales and the bf16 rounding in its epilogue), over a few
tile shapes, one tile per program or persistent programs; bf16 F.linear for
scale. Each product replayed in a CUDA graph over weight copies past L2.

    python3 benchmarks/fp8_gemm_tiles.py --model qwen2.5-7b --rows 256 512 --out /tmp/tiles.json

Needs a CUDA GPU with fp8 tensor cores (Hopper) and Triton.
"""
from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F

from gemm_shapes import graph_time_us  # benchmarks/, the script's own folder
from rollout_engine.script_args import ScriptParser, needs_cuda, positive_int, run_script
from rollout_engine.models.presets import PRESETS

# (BLOCK_M, BLOCK_N, warps, stages, persistent); BLOCK_K 128
TILES = ((128, 128, 8, 4, False), (128, 256, 8, 3, False), (64, 256, 4, 4, False), (128, 128, 4, 4, False),
         (64, 128, 4, 5, False), (128, 128, 8, 4, True), (128, 256, 8, 3, True))


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def tile(x_desc, w_desc, sx_ptr, sw_ptr, y_ptr, M, N, K, stride_ym, pid, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GROUP: tl.constexpr):
        """Output tile `pid`, tiles ordered by groups of GROUP row tiles (L2 reuse of the weight)."""
        tiles_m = tl.cdiv(M, BM)
        width = GROUP * tl.cdiv(N, BN)
        first_m = (pid // width) * GROUP
        size_m = min(tiles_m - first_m, GROUP)
        pm = first_m + (pid % width) % size_m
        pn = (pid % width) // size_m
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            a = x_desc.load([pm * BM, k * BK])
            b = w_desc.load([pn * BN, k * BK])
            acc = tl.dot(a, b.T, acc)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
        sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
        y = acc * sx[:, None] * sw[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(tl.bfloat16),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit
    def fp8_mm_kernel(x_desc, w_desc, sx_ptr, sw_ptr, y_ptr, M, N, K, stride_ym,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
        """One output tile per program."""
        tile(x_desc, w_desc, sx_ptr, sw_ptr, y_ptr, M, N, K, stride_ym, tl.program_id(0), BM, BN, BK, GROUP)

    @triton.jit
    def fp8_mm_persistent(x_desc, w_desc, sx_ptr, sw_ptr, y_ptr, M, N, K, stride_ym,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                          NUM_SMS: tl.constexpr):
        """The same tiles, each program walking every NUM_SMS-th of them."""
        for pid in range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), NUM_SMS):
            tile(x_desc, w_desc, sx_ptr, sw_ptr, y_ptr, M, N, K, stride_ym, pid, BM, BN, BK, GROUP)

    return fp8_mm_kernel, fp8_mm_persistent


def fp8_tiles(x: torch.Tensor, w: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, cfg) -> torch.Tensor:
    """x [M, K] e4m3, w [N, K] e4m3, sx [M] and sw [N] float32 -> bf16 [M, N]."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, warps, stages, persistent = cfg
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    xd, wd = TensorDescriptor.from_tensor(x, [bm, 128]), TensorDescriptor.from_tensor(w, [bn, 128])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    one_each, walking = _kernels()
    if persistent:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        walking[(min(sms, tiles),)](xd, wd, sx, sw, y, m, n, k, y.stride(0), BM=bm, BN=bn, BK=128, GROUP=8,
                                    NUM_SMS=sms, num_warps=warps, num_stages=stages)
    else:
        one_each[(tiles,)](xd, wd, sx, sw, y, m, n, k, y.stride(0), BM=bm, BN=bn, BK=128, GROUP=8,
                           num_warps=warps, num_stages=stages)
    return y


def _graph_us(fn, copies) -> float:
    """Device time of fn(c) per call, replayed in a CUDA graph over the copies in turn."""
    return graph_time_us(lambda: [fn(c) for c in copies], reps=10) / len(copies)


def products(model: str) -> dict[str, tuple[int, int]]:
    mc = PRESETS[model]
    h, heads, kv = mc["hidden_size"], mc["num_attention_heads"], mc["num_key_value_heads"]
    d = mc.get("head_dim", h // heads)
    inter = mc["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h), "down": (h, inter)}


def main(argv: list[str] | None = None) -> None:
    p = ScriptParser("fp8_gemm_tiles.py", __doc__)
    dense = sorted(n for n, c in PRESETS.items() if not {"num_experts", "num_local_experts"} & set(c))
    p.add_argument("--model", default="qwen2.5-7b", choices=dense, help="the products of this dense preset's layer")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[256, 512], help="rows of each product")
    p.add_argument("--products", nargs="+", choices=["qkv", "o", "gate_up", "down"],
                   default=["qkv", "o", "gate_up", "down"], help="which of the layer's products")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_checked(argv)
    needs_cuda(p, "it times fp8 tensor-core products")
    if torch.cuda.get_device_capability()[0] < 9:
        p.error(f"needs fp8 tensor cores (Hopper or later); this GPU is {torch.cuda.get_device_name()}")
    dev, e4m3 = torch.device("cuda"), torch.float8_e4m3fn
    rows = []
    for name in args.products:
        n, k = products(args.model)[name]
        weights = [torch.randn(n, k, device=dev).div(4).to(e4m3) for _ in range(3)]
        bf16_weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        sw = torch.rand(n, device=dev) * 0.01 + 0.001
        for m in args.rows:
            x = torch.randn(m, k, device=dev).div(4).to(e4m3)
            sx = torch.rand(m, device=dev) * 0.01 + 0.001
            xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            def scaled_mm(w):
                return torch._scaled_mm(x, w.t(), scale_a=sx.view(-1, 1), scale_b=sw.view(1, -1),
                                        out_dtype=torch.bfloat16)

            ref = scaled_mm(weights[0]).float()
            row = {"product": name, "rows": m, "n": n, "k": k,
                   "bf16_us": round(_graph_us(lambda w: F.linear(xb, w), bf16_weights), 1),
                   "scaled_mm_us": round(_graph_us(scaled_mm, weights), 1), "tiles": []}
            for cfg in TILES:
                err = ((fp8_tiles(x, weights[0], sx, sw, cfg).float() - ref).abs().max() / ref.abs().max()).item()
                us = _graph_us(lambda w: fp8_tiles(x, w, sx, sw, cfg), weights)
                row["tiles"].append({"tile": cfg, "us": round(us, 1), "rel_err": err})
            best = min(row["tiles"], key=lambda t: t["us"])
            row.update(best_tile=best["tile"], best_us=best["us"],
                       scaled_mm_over_best=round(row["scaled_mm_us"] / best["us"], 3))
            print({key: v for key, v in row.items() if key != "tiles"}, flush=True)
            rows.append(row)
    res = {"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
