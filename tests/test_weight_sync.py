"""A trainer process broadcasts new weights to an engine process over a
weight-sync group (gloo on the CPU)."""
from __future__ import annotations

import multiprocessing as mp
import socket

from models import make_hf_model, save_model
from rollout_engine import RolloutEngine, SamplingParams
from rollout_engine.distributed.weight_sync import TensorSpec, plan_buckets

PROMPTS = [[1, 2, 3], list(range(60, 90))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_buckets_pack_in_order_and_split_large_tensors():
    import torch

    specs = [TensorSpec("a", torch.float32, (100,)), TensorSpec("b", torch.bfloat16, (1000,)),
             TensorSpec("c", torch.float32, (10,)), TensorSpec("d", torch.float32, (5000,))]
    buckets = plan_buckets(specs, bucket_bytes=2600)
    assert [[s.name for s, _ in b.entries] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert all(off % 256 == 0 for b in buckets for _, off in b.entries)


def test_trainer_process_broadcasts_to_engine_process(llama, tmp_path):
    _, folder_a = llama
    folder_b = save_model(make_hf_model("llama", seed=11), tmp_path / "b")
    ctx = mp.get_context("spawn")
    meta, out = ctx.Queue(), ctx.Queue()
    port, bucket_bytes = _free_port(), 64 * 1024  # small buckets: several broadcasts
    import sync_workers

    procs = [ctx.Process(target=sync_workers.trainer, args=(port, folder_b, meta, bucket_bytes)),
             ctx.Process(target=sync_workers.engine, args=(port, folder_a, meta, out, PROMPTS, bucket_bytes))]
    for p in procs:
        p.start()
    version, tokens, error, final_version = out.get(timeout=240)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    fresh = RolloutEngine(folder_b, max_total_tokens=2048).generate(
        input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    assert version == 1 and tokens == [o.output_token_ids for o in fresh]
    assert "unknown weight name 'bogus.weight'" in error and final_version == 1
