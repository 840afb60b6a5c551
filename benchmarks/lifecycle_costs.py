"""What the weight lifecycle's checks cost on the GPU: the read-only
finiteness pass of an all-or-nothing update against the copy itself, and
weights_checksum for the whole model (BENCHMARKS.md, "Weight lifecycle")."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rollout_engine import RolloutEngine
from rollout_engine.script_args import run_script
from rollout_engine.config import QUANTIZATIONS
from rollout_engine.fidelity import weights_checksum


def timed(fn, rounds: int = 5) -> float:
    runs = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: the updates quantize into the engine's fp8 storage")
    p.add_argument("--out")
    args = p.parse_args()
    engine = RolloutEngine(args.model, load_format="dummy", max_total_tokens=16384, cuda_graph=False,
                           quantization=args.quantization)
    tensors = [(n, engine.get_weight(n)) for n in engine.weight_names()]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    loader = engine.core.parts.updater.loader
    engine.update_weights(tensors)  # warm-up (kernels compiled)
    engine.weights_checksum()
    weights_checksum(tensors[:2], engine.dtype)
    report = {
        "model": args.model, "quantization": args.quantization, "device": torch.cuda.get_device_name(), "weights_GiB": round(nbytes / 2**30, 3),
        "tensors": len(tensors),
        "finite_check_ms": round(1e3 * timed(lambda: loader.check_finite(tensors)), 2),
        "update_list_ms": round(1e3 * timed(lambda: engine.update_weights(tensors)), 2),
        "update_stream_ms": round(1e3 * timed(lambda: engine.update_weights(iter(tensors))), 2),
        "engine_checksum_ms": round(1e3 * timed(engine.weights_checksum), 2),
        "trainer_checksum_ms": round(1e3 * timed(lambda: weights_checksum(tensors, engine.dtype,
                                                                          quantization=args.quantization)), 2),
    }
    same = engine.weights_checksum() == weights_checksum(tensors, engine.dtype, quantization=args.quantization)
    report["checksums_equal"] = same
    report["checksum_GB_per_s"] = round(nbytes / report["engine_checksum_ms"] / 1e6, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    engine.shutdown()


if __name__ == "__main__":
    raise SystemExit(run_script(main))
