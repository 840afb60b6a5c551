"""One side of an A/B of decode attention over an e4m3 KV cache: `flashinfer`
(FlashInfer's e4m3 decode kernels, the engine's default) or `triton`
(`flashinfer_backend.E4M3_DECODE_TRITON`: decode steps through the Triton
backend's kernel, whose products run in fp16; prefill stays FlashInfer's).
Then runs `rollout-engine <args>` in this process. Alternate the sides in
one device call:

    python3 benchmarks/e4m3_decode_ab.py triton bench --workload grpo --model qwen2.5-7b --num-prompts 64 -n 8 \\
        --page-size 16 --quantization fp8 --kv-cache-dtype fp8_e4m3 --out /tmp/triton.json
    python3 benchmarks/e4m3_decode_ab.py flashinfer bench ... --out /tmp/flashinfer.json

The kernels alone: `benchmarks/decode_attention.py --backends fa2 triton
--kv-dtypes auto fp8_e4m3`."""
from __future__ import annotations

import sys

from rollout_engine.cli_args import ScriptParser, run_script
from rollout_engine.suggest import unrecognized


def main(argv: list[str] | None = None) -> int:
    p = ScriptParser("e4m3_decode_ab.py", __doc__)
    p.add_argument("side", choices=["flashinfer", "triton"], help="which kernels decode over an e4m3 cache")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        p.error(unrecognized(p, argv[:1]))
    args = p.parse_args(argv[:1])  # what follows is rollout-engine's, flags included
    from rollout_engine.attention import flashinfer_backend
    from rollout_engine.console import main as console_main

    flashinfer_backend.E4M3_DECODE_TRITON = args.side == "triton"
    sys.argv = ["rollout-engine", *argv[1:]]
    return console_main()


if __name__ == "__main__":
    raise SystemExit(run_script(main))
