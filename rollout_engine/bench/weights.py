"""`weights` workload: a full-model update in place, from in-process tensors
(already on the device: the colocated case), from a safetensors folder, and
(`--nccl`, two GPUs) broadcast from a trainer process on GPU 0 to an engine
process on GPU 1 through the weight-sync group. With `--tp k` (k GPUs): an
FSDP2 trainer over k ranks and one TP=k engine in the same processes,
synced with `sync_to_engine` (the colocated RL layout)."""
from __future__ import annotations

import socket
import tempfile
from typing import Any

import torch

from rollout_engine.bench.common import free_device_memory, make_engine, timed

ROUNDS = 3


def bench_weights(args) -> dict[str, Any]:
    if args.nccl:
        return bench_nccl(args)
    if getattr(args, "tp_size", 1) > 1:
        return bench_fsdp_tp(args)
    from safetensors.torch import save_file

    engine = make_engine(args, enable_prefix_cache=False)
    tensors = [(n, engine.get_weight(n).to(engine.device)) for n in engine.weight_names()]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    engine.update_weights(tensors)  # warm-up
    in_process = min(timed(lambda: engine.update_weights(tensors)) for _ in range(ROUNDS))
    # For comparison: what a separate finiteness pass over the update would cost
    # (the update checks inside its copy instead).
    check_pass = min(timed(lambda: bool(torch.stack([torch.isfinite(t).all() for _, t in tensors]).all()))
                     for _ in range(ROUNDS))
    with tempfile.TemporaryDirectory() as folder:
        save_file({n: t.cpu().contiguous() for n, t in tensors}, f"{folder}/model.safetensors")
        del tensors
        from_disk = timed(lambda: engine.update_weights_from_disk(folder))
    free_device_memory(engine)
    del engine
    return {"weight_bytes": nbytes, "in_process_s": round(in_process, 4),
            "in_process_GBps": round(nbytes / in_process / 1e9, 1),
            "separate_finite_pass_s": round(check_pass, 4), "from_disk_s": round(from_disk, 3),
            "from_disk_GBps": round(nbytes / from_disk / 1e9, 2)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(args, port: int, meta_queue, out_queue) -> None:
    from rollout_engine.integrations.weight_sender import WeightSender

    torch.cuda.set_device(0)
    source = make_engine(args, enable_prefix_cache=False, cuda_graph=False, max_total_tokens=4096, device="cuda:0")
    tensors = [(n, source.get_weight(n).to("cuda:0")) for n in source.weight_names()]
    free_device_memory(source)
    del source
    sender = WeightSender("127.0.0.1", port, world_size=2, bucket_bytes=args.bucket_mb << 20, device="cuda:0")
    meta_queue.put(WeightSender.metadata(tensors))
    times = []
    for _ in range(ROUNDS + 1):  # the first round warms up NCCL
        times.append(timed(lambda: sender.send(tensors)))
    sender.close()
    out_queue.put(("trainer", (times, sum(t.numel() * t.element_size() for _, t in tensors))))


def _receiver(args, port: int, meta_queue, out_queue) -> None:
    torch.cuda.set_device(1)
    engine = make_engine(args, enable_prefix_cache=False, max_total_tokens=65536, device="cuda:1")
    engine.init_weight_sync_group("127.0.0.1", port, rank_offset=1, world_size=2)
    names, dtypes, shapes = meta_queue.get(timeout=600)
    times = []
    for _ in range(ROUNDS + 1):
        times.append(timed(lambda: engine.update_weights_from_distributed(
            names, dtypes, shapes, bucket_bytes=args.bucket_mb << 20)))
    engine.destroy_weight_sync_group()
    out_queue.put(("engine", times))


def bench_nccl(args) -> dict[str, Any]:
    import multiprocessing as mp

    if torch.cuda.device_count() < 2:
        raise SystemExit("--nccl needs two GPUs")
    ctx = mp.get_context("spawn")
    port = _free_port()
    meta, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(args, port, meta, out)),
             ctx.Process(target=_receiver, args=(args, port, meta, out))]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    send_times, nbytes = results["trainer"]
    engine_times = results["engine"][1:]
    best = min(engine_times)
    return {"bucket_MiB": args.bucket_mb, "weight_bytes": nbytes, "rounds_s": [round(t, 4) for t in engine_times],
            "trainer_send_s": [round(t, 4) for t in send_times[1:]], "best_s": round(best, 4),
            "GBps": round(nbytes / best / 1e9, 1)}



def _fsdp_tp_rank(args, rank: int, port: int, out_queue) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout_engine.integrations.fsdp import sync_to_engine
    from rollout_engine.models.presets import PRESETS

    k = args.tp_size
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=k,
                            device_id=torch.device("cuda", rank))
    shape = {key: v for key, v in PRESETS[args.model].items() if key != "architectures"}
    config = AutoConfig.for_model(**shape)
    with torch.device("cuda", rank):
        trainer = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for layer in trainer.model.layers:
        fully_shard(layer)
    fully_shard(trainer)
    torch.cuda.empty_cache()
    engine = make_engine(args, enable_prefix_cache=False, max_total_tokens=65536, device=f"cuda:{rank}")
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    times = [timed(lambda: sync_to_engine(trainer, engine)) for _ in range(ROUNDS + 1)]  # the first warms up
    if rank == 0:
        out_queue.put((times, nbytes))
    engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()


def bench_fsdp_tp(args) -> dict[str, Any]:
    import multiprocessing as mp

    k = args.tp_size
    if torch.cuda.device_count() < k or args.load_format != "dummy":
        raise SystemExit(f"--tp {k} for the weights workload needs {k} GPUs and a preset model (dummy weights)")
    ctx = mp.get_context("spawn")
    port, out = _free_port(), ctx.Queue()
    procs = [ctx.Process(target=_fsdp_tp_rank, args=(args, r, port, out)) for r in range(k)]
    for p in procs:
        p.start()
    times, nbytes = out.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
    best = min(times[1:])
    return {"layout": f"FSDP2 over {k} GPUs -> one TP={k} engine, same processes", "weight_bytes": nbytes,
            "rounds_s": [round(t, 4) for t in times[1:]], "best_s": round(best, 4),
            "GBps": round(nbytes / best / 1e9, 1)}
