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


def _gather(procs, queue, count: int, timeout_s: float = 240.0):
    """Results from the workers; fails fast if one dies instead of answering."""
    import queue as queue_module
    import time

    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < count:
        try:
            results.append(queue.get(timeout=1.0))
        except queue_module.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"worker exited with {[p.exitcode for p in dead]}"
            assert time.monotonic() < deadline, "workers timed out"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def test_buckets_pack_in_order_and_split_large_tensors():
    import torch

    specs = [TensorSpec("a", torch.float32, (100,)), TensorSpec("b", torch.bfloat16, (1000,)),
             TensorSpec("c", torch.float32, (10,)), TensorSpec("d", torch.float32, (5000,))]
    buckets = plan_buckets(specs, bucket_bytes=2600)
    assert [[s.name for s, _ in b.entries] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert all(off % 256 == 0 for b in buckets for _, off in b.entries)


def check_trainer_broadcast(folder_a: str, folder_b: str, tp_size: int = 1, in_memory: bool = False) -> None:
    """A trainer process sends folder_b's weights to an engine process (on
    folder_a, tp_size ranks) over a gloo weight-sync group; the engine then
    generates what a fresh engine on folder_b does, and a bad name raises
    there without hanging the sender."""
    import sync_workers

    ctx = mp.get_context("spawn")
    meta, out = ctx.Queue(), ctx.Queue()
    port, bucket_bytes = _free_port(), 64 * 1024  # small buckets: several broadcasts
    procs = [ctx.Process(target=sync_workers.trainer, args=(port, folder_b, meta, bucket_bytes, 1 + tp_size,
                                                            in_memory)),
             ctx.Process(target=sync_workers.engine,
                         args=(port, folder_a, meta, out, PROMPTS, bucket_bytes, tp_size))]
    for p in procs:
        p.start()
    [(version, tokens, error, final_version)] = _gather(procs, out, 1)
    fresh = RolloutEngine(folder_b, max_total_tokens=2048).generate(
        input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    assert version == 1 and tokens == [o.output_token_ids for o in fresh]
    assert "unknown weight name 'bogus.weight'" in error and final_version == 1


def test_trainer_process_broadcasts_to_engine_process(llama, tmp_path):
    _, folder_a = llama
    check_trainer_broadcast(folder_a, save_model(make_hf_model("llama", seed=11), tmp_path / "b"))


import pytest  # noqa: E402


@pytest.mark.slow  # two processes per naming; run by .ci/run after the fast tests
@pytest.mark.parametrize("in_memory", [False, True], ids=["per-expert", "fused"])
def test_moe_weights_broadcast_under_either_naming(moe_models, tmp_path, in_memory):
    """An MoE trainer's weights over the sync group: the checkpoint's
    per-expert tensors, or the fused tensors transformers holds in memory."""
    _, folder_a = moe_models["qwen3_moe"]
    check_trainer_broadcast(folder_a, save_model(make_hf_model("qwen3_moe", seed=12), tmp_path / "b"),
                            in_memory=in_memory)


@pytest.mark.slow  # two trainer ranks
def test_fsdp_ranks_update_their_colocated_moe_engines(moe_models, tmp_path):
    """FSDP2 over an MoE trainer (fused expert parameters, sharded): each
    rank's engine ends with the trainer's weights."""
    import sync_workers

    _, folder_a = moe_models["qwen2_moe"]
    folder_b = save_model(make_hf_model("qwen2_moe", seed=13), tmp_path / "b")
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=sync_workers.fsdp_rank, args=(r, port, folder_a, folder_b, 2, out, PROMPTS))
             for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(_gather(procs, out, 2))
    fresh = RolloutEngine(folder_b, max_total_tokens=2048, device="cpu").generate(
        input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    for rank, version, tokens in results:
        assert version == 1 and tokens == [o.output_token_ids for o in fresh]


@pytest.mark.parametrize("kind", [pytest.param(2, marks=pytest.mark.slow), pytest.param(1, marks=[pytest.mark.gpu, pytest.mark.multigpu])])
def test_fsdp_ranks_update_their_colocated_engines(llama, tmp_path, kind):
    """FSDP2 runs on CPU ranks; FSDP1 needs an accelerator (one GPU per rank)."""
    import torch

    if kind == 1 and torch.cuda.device_count() < 2:
        pytest.skip("FSDP1 needs two GPUs")
    _, folder_a = llama
    folder_b = save_model(make_hf_model("llama", seed=13), tmp_path / "b")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    import sync_workers

    procs = [ctx.Process(target=sync_workers.fsdp_rank, args=(r, port, folder_a, folder_b, kind, out, PROMPTS))
             for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(_gather(procs, out, 2))
    where = dict(device="cuda", dtype="float32") if kind == 1 else dict(device="cpu")  # as the ranks' engines
    fresh = RolloutEngine(folder_b, max_total_tokens=2048, **where).generate(
        input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    for rank, version, tokens in results:
        assert version == 1 and tokens == [o.output_token_ids for o in fresh]


def test_a_sender_killed_mid_broadcast_fails_the_call_in_time(llama, tmp_path):
    """The trainer dies after the first buckets: the engine's call fails
    within its timeout naming what it wrote, refuses to generate, and a new
    group plus a full update restores it."""
    import time

    import pytest

    import sync_workers
    from rollout_engine.weights.updater import IncompleteUpdate

    _, folder_a = llama
    folder_b = save_model(make_hf_model("llama", seed=17), tmp_path / "b")
    engine = RolloutEngine(folder_a, max_total_tokens=2048)
    ctx = mp.get_context("spawn")
    meta, bucket_bytes = ctx.Queue(), 16 * 1024
    port = _free_port()
    dying = ctx.Process(target=sync_workers.dying_trainer, args=(port, folder_b, meta, bucket_bytes, 2))
    dying.start()
    try:
        engine.init_weight_sync_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
        names, dtypes, shapes = meta.get(timeout=120)
        start = time.monotonic()
        with pytest.raises(IncompleteUpdate) as info:
            engine.update_weights_from_distributed(names, dtypes, shapes, bucket_bytes=bucket_bytes, timeout_s=20)
        assert time.monotonic() - start < 40
        assert "weight-sync group 'weight_sync'" in str(info.value) and len(info.value.written) > 0
        assert engine.weight_version == 0 and engine.metrics()["invalid_weights"] == len(info.value.written)
        with pytest.raises(RuntimeError, match="are not usable"):
            engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=4))
        with pytest.raises(RuntimeError, match="is broken"):
            engine.update_weights_from_distributed(names, dtypes, shapes, bucket_bytes=bucket_bytes, timeout_s=5)
        engine.destroy_weight_sync_group()
    finally:
        dying.join(timeout=30)
        if dying.is_alive():
            dying.kill()
    # A new trainer, a new group, a full update: the engine is whole again.
    out, port = ctx.Queue(), _free_port()
    trainer = ctx.Process(target=sync_workers.trainer, args=(port, folder_b, meta, bucket_bytes, 2))
    trainer.start()
    try:
        engine.init_weight_sync_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
        names, dtypes, shapes = meta.get(timeout=120)
        assert engine.update_weights_from_distributed(names, dtypes, shapes, bucket_bytes=bucket_bytes,
                                                      timeout_s=60) == 1
        # the trainer's second round (two tensors) completes its script
        engine.update_weights_from_distributed(names[:2], dtypes[:2], shapes[:2], bucket_bytes=bucket_bytes,
                                               timeout_s=60)
        engine.destroy_weight_sync_group()
    finally:
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    params = SamplingParams(max_new_tokens=16, temperature=0)
    assert [o.output_token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=params)] == \
        [o.output_token_ids for o in RolloutEngine(folder_b, max_total_tokens=2048).generate(
            input_ids=PROMPTS, sampling_params=params)]
    engine.shutdown()
