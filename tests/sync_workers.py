"""Process bodies for the multi-process tests (spawned: top level)."""
from __future__ import annotations


def trainer(port: int, folder: str, meta_queue, bucket_bytes: int, world_size: int = 2,
            in_memory: bool = False) -> None:
    """Sends the checkpoint's tensors under their names on disk, or
    (`in_memory`) the model's parameters as transformers holds them (MoE:
    fused expert tensors, where the checkpoint has one per expert)."""
    from rollout_engine.integrations.weight_sender import WeightSender
    from rollout_engine.weights.loader import iter_safetensors

    if in_memory:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tensors = [(name, p.detach()) for name, p in model.named_parameters()]
    else:
        tensors = list(iter_safetensors(folder))
    sender = WeightSender("127.0.0.1", port, world_size=world_size, backend="gloo", bucket_bytes=bucket_bytes)
    meta_queue.put(WeightSender.metadata(tensors))
    sender.send(tensors)
    # A second round, with a bad name on the engine side: the sender must not hang.
    sender.send(tensors[:2])
    sender.close()


def engine(port: int, folder: str, meta_queue, out_queue, prompts, bucket_bytes: int, tp_size: int = 1) -> None:
    from rollout_engine import RolloutEngine, SamplingParams

    eng = RolloutEngine(folder, max_total_tokens=2048, tp_size=tp_size)
    eng.init_weight_sync_group("127.0.0.1", port, rank_offset=1, world_size=1 + tp_size, backend="gloo")
    names, dtypes, shapes = meta_queue.get(timeout=120)
    version = eng.update_weights_from_distributed(names, dtypes, shapes, bucket_bytes=bucket_bytes)
    outs = eng.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    try:
        eng.update_weights_from_distributed(["bogus.weight"] + names[1:2], dtypes[:2], shapes[:2],
                                            bucket_bytes=bucket_bytes)
        error = None
    except ValueError as e:
        error = str(e)
    eng.destroy_weight_sync_group()
    out_queue.put((version, [o.output_token_ids for o in outs], error, eng.weight_version))
    eng.shutdown()


def fsdp_rank(rank: int, port: int, folder_a: str, folder_b: str, kind: int, out_queue, prompts,
              tp_size: int = 1, on_gpu: bool | None = None) -> None:
    """An FSDP trainer rank with an engine in the same process: one engine per
    rank (tp_size=1), or one engine over both ranks (tp_size=2, embedded).
    FSDP1 (kind 1) always runs on the GPU; FSDP2 (kind 2) where asked."""
    import faulthandler
    import os

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rollout_engine import RolloutEngine, SamplingParams
    from rollout_engine.integrations.fsdp import sync_to_engine

    faulthandler.dump_traceback_later(200, exit=True)  # a hang shows where, before the test's 240 s deadline
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    on_gpu = kind == 1 or bool(on_gpu)  # FSDP1 needs an accelerator: one GPU per rank, NCCL
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=2)
    trainer = AutoModelForCausalLM.from_pretrained(folder_b, dtype=torch.float32)
    if kind == 2:
        from torch.distributed.fsdp import fully_shard

        if on_gpu:
            trainer = trainer.to(f"cuda:{rank}")
        for layer in trainer.model.layers:
            fully_shard(layer)
        fully_shard(trainer)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        trainer = FullyShardedDataParallel(trainer, use_orig_params=True, device_id=rank)
    device = f"cuda:{rank}" if on_gpu else "cpu"
    engine = RolloutEngine(folder_a, max_total_tokens=2048, device=device, dtype="float32", tp_size=tp_size)
    version = sync_to_engine(trainer, engine)
    outs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=16, temperature=0))
    out_queue.put((rank, version, [o.output_token_ids for o in outs]))
    engine.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def embedded_rank(rank: int, world: int, port: int, folder: str, second_folder: str, tp: int, prompts,
                  out_queue, env: list | None = None) -> None:
    """One rank of a torch.distributed job in which every rank constructs a
    tensor-parallel engine and makes the same calls (`env`: each rank's own
    environment variables)."""
    import os
    import time

    import torch.distributed as dist

    from rollout_engine import RolloutEngine, SamplingParams
    from rollout_engine.weights.loader import iter_safetensors

    os.environ.update(env[rank] if env else {})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        try:
            engine = RolloutEngine(folder, device="cpu", max_total_tokens=4096, tp_size=tp)
        except ValueError as e:
            out_queue.put((rank, "ValueError", str(e)))
            return
        params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
        if rank % tp:  # a later caller than rank 0: its result may already be there
            time.sleep(1.0)
        first = [o.output_token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        streamed = {}
        for delta in engine.stream(input_ids=prompts[:2], sampling_params=params):
            streamed.setdefault(delta.request_id, []).extend(delta.output_token_ids)
        version = engine.update_weights(list(iter_safetensors(second_folder)))  # each rank its own full tensors
        second = [o.output_token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        engine.shutdown()
        out_queue.put((rank, first, list(streamed.values()), version, second))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def exit_when_done(target, rank: int, port: int, out_queue) -> None:
    """Runs `target(rank, port, out_queue)` in a spawned worker, then ends
    the process at once (os._exit) once what it put has gone through the
    queue: no C++ teardown at interpreter exit, where gloo's and the
    store's threads could still abort a rank that had answered ("terminate
    called without an active exception"). Exit status 1 if it raised."""
    import os
    import sys
    import traceback

    code = 0
    try:
        target(rank, port, out_queue)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        out_queue.close()
        out_queue.join_thread()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)


def _leave_together(rank: int) -> None:
    """Both ranks of a gloo world tear down, rank 1 first: rank 0 serves the
    store, and a rank 0 that left early aborted rank 1 at its exit
    ("terminate called without an active exception")."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank:
        dist.destroy_process_group()
        store.set("left", "1")
    else:
        store.wait(["left"], timedelta(seconds=60))
        dist.destroy_process_group()


def symm_name_rank(rank: int, port: int, out_queue) -> None:
    """Rank 0 has already used the world's name (as a process that ran an
    engine before does); a second group is new to both ranks."""
    import torch
    import torch.distributed as dist

    from rollout_engine.distributed import fast_allreduce

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    if rank == 0:
        fast_allreduce._SET_UP.add(dist.group.WORLD.group_name)
    world = fast_allreduce.first_use_everywhere(dist.group.WORLD, cpu)
    other = dist.new_group([0, 1], backend="gloo")
    fresh = fast_allreduce.first_use_everywhere(other, cpu)
    again = fast_allreduce.first_use_everywhere(other, cpu)
    _leave_together(rank)
    out_queue.put((rank, world, fresh, again))


def allreduce_mode_rank(rank: int, port: int, out_queue) -> None:
    """Two ranks of a torch.distributed job read ROLLOUT_ENGINE_ALLREDUCE
    from their own environments: nccl and unset with the paths required
    alike (as on GPUs), then alike; fused and a wrong value; fused and
    one-shot on the CPU. Puts (rank, each check's error or None)."""
    import os

    import torch
    import torch.distributed as dist

    from rollout_engine.distributed.fast_allreduce import allreduce_mode_everywhere

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    errors = []
    for env, alike in ((("nccl", ""), True), (("nccl", "nccl"), True), (("fused", "fast"), None),
                       (("fused", "one-shot"), None)):
        os.environ["ROLLOUT_ENGINE_ALLREDUCE"] = env[rank]
        try:
            allreduce_mode_everywhere(dist.group.WORLD, torch.device("cpu"), alike)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    _leave_together(rank)
    out_queue.put((rank, *errors))


def fused_norm_rank(rank: int, port: int, out_queue) -> None:
    """One of two GPU ranks: the fused all-reduce + residual add + RMSNorm
    (eagerly and replayed in a CUDA graph with new inputs; its first use on a
    machine builds FlashInfer's kernels, minutes) against NCCL's
    all-reduce then the norm kernel. Puts (rank, the path's class, the
    largest gap of the normalised rows, whether every new residual was equal)."""
    import os

    import torch
    import torch.distributed as dist

    from rollout_engine.distributed.comm import TPComm
    from rollout_engine.kernels.rmsnorm import rmsnorm

    os.environ["ROLLOUT_ENGINE_ALLREDUCE"] = "fused"  # by name: a fallback would be one-shot, not this kernel
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    try:
        hidden, eps, bf16 = 4096, 1e-5, torch.bfloat16
        comm = TPComm(rank, 2, dist.group.WORLD).with_fused_norm(hidden, bf16, device)

        def inputs(rows: int, seed: int):
            shared = torch.Generator(device="cuda").manual_seed(seed)  # residual and weight: alike on both ranks
            mine = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)  # the partial sums: each its own
            residual = torch.randn(rows, hidden, device=device, dtype=bf16, generator=shared)
            weight = (torch.rand(hidden, device=device, generator=shared) + 0.5).to(bf16)
            return torch.randn(rows, hidden, device=device, dtype=bf16, generator=mine) * 4, residual, weight

        def reference(x, residual, weight):
            total = x.clone()
            dist.all_reduce(total)
            return rmsnorm(total, weight, eps, residual)

        gap, equal = 0.0, True

        def check(got, want):
            nonlocal gap, equal
            gap = max(gap, (got[0].float() - want[0].float()).abs().max().item())
            equal = equal and torch.equal(got[1], want[1])

        for rows in (1, 3, 64, 512):
            x, residual, weight = inputs(rows, rows)
            check(comm.fused(x, residual, weight, eps), reference(x, residual, weight))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = comm.fused(x, residual, weight, eps)
            for seed in (7, 8):  # the graph replayed on new rows: the buffers' turns stay in step
                x2, r2, w2 = inputs(rows, seed)
                x.copy_(x2), residual.copy_(r2), weight.copy_(w2)
                graph.replay()
                check(captured, reference(x2, r2, w2))
        torch.cuda.synchronize()
        out_queue.put((rank, type(comm.fused).__name__, gap, equal))
    finally:
        dist.destroy_process_group()


def grpo_fsdp_rank(rank: int, port: int, folder: str, examples: str, out_queue) -> None:
    """One torchrun-like rank of examples/grpo_train.py --fsdp."""
    import importlib.util
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    spec = importlib.util.spec_from_file_location("grpo_train", os.path.join(examples, "grpo_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--model", folder, "--task", "token", "--fsdp", "--steps", "2", "--prompts", "2",
                          "-n", "4", "--max-new-tokens", "8", "--lr", "1e-2", "--device", "cpu"])
    out_queue.put((rank, result["weight_version"], result["probe"], [r["reward_mean"] for r in result["rows"]]))


def dying_trainer(port: int, folder: str, meta_queue, bucket_bytes: int, buckets_before_death: int) -> None:
    """Sends the first buckets of an update, then is killed (SIGKILL: no
    goodbye on any socket), as a trainer that crashes mid-broadcast."""
    import os
    import signal

    from rollout_engine.distributed.weight_sync import pack, plan_buckets, specs_of
    from rollout_engine.integrations.weight_sender import WeightSender
    from rollout_engine.weights.loader import iter_safetensors

    tensors = list(iter_safetensors(folder))
    sender = WeightSender("127.0.0.1", port, world_size=2, backend="gloo", bucket_bytes=bucket_bytes)
    names, dtypes, shapes = WeightSender.metadata(tensors)
    meta_queue.put((names, dtypes, shapes))
    by_name = dict(tensors)
    for bucket in plan_buckets(specs_of(names, dtypes, shapes), bucket_bytes)[:buckets_before_death]:
        sender.group.broadcast(pack(bucket, [by_name[s.name] for s, _ in bucket.entries], sender.device), src=0)
    os.kill(os.getpid(), signal.SIGKILL)
