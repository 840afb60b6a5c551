"""From an EngineConfig to the engine's parts: the model and tokenizer, KV
memory sized to what is free, the attention backend and model runner (with
its CUDA graphs), the scheduler, the memory controller and the weight state.
Built once, on the constructing thread (memory-saver regions are entered
here and nowhere per step)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from rollout_engine.attention.base import AttentionShape, create_backend, resolve_backend_name
from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.cache.prefix_cache import NoPrefixCache, PrefixCache
from rollout_engine.cache.radix import RadixCache
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.config import EngineConfig
from rollout_engine.distributed.comm import TPComm
from rollout_engine.distributed.fast_allreduce import allreduce_mode
from rollout_engine.distributed.tp_group import TPChannel, TPStepRunner
from rollout_engine.kernels._triton import triton_available
from rollout_engine.layers.invariant import make_batch_invariant, prepare_products
from rollout_engine.layers.one_row import compile_one_row_kernels
from rollout_engine.kv_sizing import kv_bytes_per_token, kv_capacity_tokens, kv_dtype_of, routes_layout
from rollout_engine.memory.controller import MemoryController
from rollout_engine.memory.manager import MemoryManager
from rollout_engine.memory.saver import create_saver
from rollout_engine.model_zoo import resolve_model_path
from rollout_engine.models.decoder import DecoderForCausalLM
from rollout_engine.models.config import ModelConfig
from rollout_engine.runner.model_loader import load_model, read_hf_config, resolve_device, resolve_dtype
from rollout_engine.core.live import release_dropped_engines
from rollout_engine.runner.device_lock import DEVICE_WIDE
from rollout_engine.runner.model_runner import ModelRunner
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.config import SchedulerConfig
from rollout_engine.scheduler.scheduler import Scheduler
from rollout_engine.scheduler.stop import StopChecker
from rollout_engine.tokenizer import check_tokenizer_fits, load_tokenizer, tokenizer_eos_ids
from rollout_engine.validation import ROUTING_OFF, Limits
from rollout_engine.weights.loader import WeightLoader
from rollout_engine.weights.receiver import WeightReceiver
from rollout_engine.weights.updater import WeightUpdater
from rollout_engine.weights.validity import WeightValidity

log = logging.getLogger("rollout_engine")


@dataclass
class EngineParts:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model: DecoderForCausalLM
    tokenizer: Any
    memory: MemoryManager
    kv_pool: KVPool
    limits: Limits
    prefix_cache: PrefixCache
    runner: ModelRunner
    scheduler: Scheduler
    controller: MemoryController
    updater: WeightUpdater
    comm: TPComm
    channel: TPChannel | None = None  # rank 0 of a tensor-parallel engine: the other ranks


def check_tp_size(cfg: EngineConfig, embedded: bool = False) -> None:
    """Refuse a tp_size that does not split the model, or (standalone) an
    all-reduce path that is not one (`fast_allreduce.allreduce_mode`), before
    any process starts. Ranks of an embedded engine read their own
    environments: they check the path together, once their group exists
    (`fast_allreduce.allreduce_mode_everywhere`)."""
    k = cfg.tp_size
    if k == 1:
        return
    if not embedded:
        allreduce_mode()
    hf, eos = read_hf_config(resolve_model_path(cfg.model, cfg.load_format))
    mc = ModelConfig.from_hf(hf, eos)
    problem = _tp_problem(mc, k)
    if problem:
        fits = [t for t in range(1, mc.num_heads + 1) if not _tp_problem(mc, t)]
        raise ValueError(f"tp_size {k} {problem}; this model splits into tp_size {', '.join(map(str, fits))}")


def _tp_problem(mc: ModelConfig, k: int) -> str | None:
    if mc.num_heads % k:
        return f"must divide the model's attention heads ({mc.num_heads})"
    if mc.num_kv_heads % k and k % mc.num_kv_heads:
        return f"and the model's KV heads ({mc.num_kv_heads}) must divide one another"
    if mc.intermediate_size % k:
        return f"must divide the model's intermediate size ({mc.intermediate_size})"
    if mc.moe is not None:
        for what, size in (("experts' intermediate size", mc.moe.intermediate_size),
                           ("shared expert's intermediate size", mc.moe.shared_expert_intermediate_size)):
            if size % k:
                return f"must divide the {what} ({size})"
    return None


def engine_cuda_index(cfg: EngineConfig) -> int | None:
    """The GPU an engine's threads select before they touch CUDA (the current
    device is per thread: a new thread starts on GPU 0). For `device="cuda"`,
    the constructing thread's current device."""
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def free_device_memory(device: torch.device) -> int:
    """The GPU's free bytes as the KV cache is sized from them, after this
    process gives back what it holds without use: engines dropped without
    shutdown() and the blocks the caching allocator keeps (a dropped
    engine's KV cache among them, which the driver counts as taken: it left
    the next engine room for no KV tokens). An engine still referenced keeps
    its memory."""
    release_dropped_engines()
    with DEVICE_WIDE:  # returning cached memory would break another engine's capture
        torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def build_parts(cfg: EngineConfig, comm: TPComm | None = None, channel: TPChannel | None = None) -> EngineParts:
    """This rank's parts (`comm`: its place in a tensor-parallel group;
    `channel`: on rank 0, the way to the other ranks)."""
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype, resolve_device(cfg.device))
    if cfg.deterministic and device.type == "cuda" and not triton_available():
        raise ValueError("deterministic=True on a GPU needs Triton (its batch-invariant kernels); "
                         "install triton or use device='cpu'")
    if cfg.quantization == "fp8" and device.type == "cuda" and dtype != torch.bfloat16:
        raise ValueError(f"dtype must be 'bfloat16' (or 'auto') with quantization='fp8' on a GPU: its fp8 products "
                         f"write bf16, got {cfg.dtype!r}")
    path = resolve_model_path(cfg.model, cfg.load_format)
    shape = ModelConfig.from_hf(*read_hf_config(path))
    comm = (comm or TPComm()).with_fast_all_reduce(dtype, device)
    if not cfg.deterministic and shape.moe is None:  # see DecoderModel.fuses_norms
        comm = comm.with_fused_norm(shape.hidden_size, dtype, device)
    free_before = free_device_memory(device) if device.type == "cuda" else 0
    memory = MemoryManager(create_saver(cfg.enable_memory_saver, device))
    if not cfg.deterministic:  # a backend this device or dtype cannot run: refused before the weights load
        resolve_backend_name(cfg.attention_backend, AttentionShape(shape.num_heads, shape.num_kv_heads,
                                                                   shape.head_dim, cfg.page_size, dtype, device))
    if cfg.enable_return_routed_experts:  # refused before the weights load
        if shape.moe is None:
            raise ValueError(f"enable_return_routed_experts=True needs a mixture-of-experts model; "
                             f"{shape.architecture} has no experts")
    tokenizer = load_tokenizer(path, cfg.tokenizer)
    check_tokenizer_fits(tokenizer, shape.vocab_size, cfg.tokenizer)  # refused before the weights load
    start = time.monotonic()
    model = load_model(path, cfg.load_format, comm, device, dtype, cfg.seed,
                       weights_region=memory.region("weights", cfg.weights_cpu_backup), quantization=cfg.quantization)
    memory.register("weights", model.parameters())
    loaded_s = time.monotonic() - start
    if cfg.deterministic:
        make_batch_invariant(model)
    kv_pool, allocator, table, limits = _kv_memory(cfg, model, memory, device, dtype, free_before, comm)
    prefix_cache = RadixCache(allocator) if cfg.enable_prefix_cache else NoPrefixCache(allocator)
    start = time.monotonic()
    runner = _runner(cfg, model, kv_pool, table, memory, device, dtype)
    runner_s = time.monotonic() - start
    mc = model.config
    stop = StopChecker(mc.eos_token_ids or tokenizer_eos_ids(tokenizer), mc.max_position, tokenizer)
    scheduler = Scheduler(SchedulerConfig(cfg.max_running_requests, cfg.max_prefill_tokens,
                                          overlap=cfg.overlap_schedule,
                                          share_prefixes=runner.backend.reads_shared_prefixes),
                          KVManager(allocator, table, prefix_cache),
                          runner if channel is None else TPStepRunner(runner, channel), stop)
    loader = WeightLoader(model)
    validity = WeightValidity(loader.hf_names())
    controller = MemoryController(memory, scheduler, prefix_cache, runner, device, cfg.weights_cpu_backup,
                                  validity)
    updater = WeightUpdater(loader, WeightReceiver(), controller, validity, prefix_cache, device)
    parts = EngineParts(cfg, device, dtype, model, tokenizer, memory, kv_pool, limits, prefix_cache, runner,
                        scheduler, controller, updater, comm, channel)
    _say_built(parts, path, (loaded_s, runner_s))
    return parts


def _say_built(parts: EngineParts, path: str, seconds: tuple[float, float]) -> None:
    """What the engine built, at INFO (rank 0; the other ranks' lines would
    repeat it): the weights, the KV cache, attention and graphs (`seconds`:
    the weights' load, the runner's build)."""
    if not log.isEnabledFor(logging.INFO) or parts.comm.tp_rank != 0:
        return
    cfg, memory, runner, tp = parts.config, parts.memory, parts.runner, parts.comm.tp_size
    each, name = f" (each of {tp} ranks)" if tp > 1 else "", parts.model.config.architecture
    log.info("model %s (%s): %.2f GiB of weights%s%s in %s on %s, loaded in %.1f s", name, path,
             memory.nbytes("weights") / 2**30, each, " (fp8 linear layers)" if cfg.quantization else "",
             str(parts.dtype).removeprefix("torch."), parts.device, seconds[0])
    log.info("KV cache: %d tokens in pages of %d, %.2f GiB%s in %s; prefix cache %s", parts.limits.kv_capacity,
             cfg.page_size, memory.nbytes("kv_cache") / 2**30, each, str(parts.kv_pool.dtype).removeprefix("torch."),
             "on" if cfg.enable_prefix_cache else "off")
    graphs = runner.graphs
    prompt = graphs.prompt if graphs is not None else None
    log.info("attention: %s; %s%s", type(runner.backend).__name__,
             f"CUDA graphs for {len(graphs.buckets)} batch sizes up to {graphs.buckets[-1]} "
             f"({memory.nbytes('cuda_graph') / 2**20:.0f} MiB), ready in {seconds[1]:.1f} s"
             if graphs is not None else "no CUDA graphs",
             f"; prompt steps in graphs cut at attention, {len(prompt.buckets)} token counts up to "
             f"{prompt.max_tokens}" if prompt is not None else "")


def _kv_memory(cfg: EngineConfig, model: DecoderForCausalLM, memory: MemoryManager, device: torch.device,
               dtype: torch.dtype, free_before: int, comm: TPComm) -> tuple[KVPool, PageAllocator, ReqToTokenTable,
                                                                            Limits]:
    """KV pool (in its memory region), slot allocator and request table,
    sized from max_total_tokens or the free GPU memory (the smallest over
    the tensor-parallel ranks: their pools hold the same slots)."""
    mc = model.config
    attn = model.model.layers[0].self_attn.attn
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    routes = routes_layout(cfg, mc)
    kv_dtype = kv_dtype_of(cfg.kv_cache_dtype, dtype)
    per_token = kv_bytes_per_token(mc, attn.num_kv_heads, kv_dtype, routes)
    capacity = comm.agree_min(kv_capacity_tokens(cfg, mc, per_token, device, free_before, weight_bytes,
                                                 dtype.itemsize), device)
    num_pages = -(-capacity // cfg.page_size)
    allocator = PageAllocator(num_pages, cfg.page_size)
    with memory.region("kv_cache"):
        kv_pool = KVPool(mc.num_layers, allocator.num_slots, attn.num_kv_heads, mc.head_dim, kv_dtype, device,
                         routes)
    memory.register("kv_cache", kv_pool.tensors)
    routing_off = None if routes is not None else ROUTING_OFF
    limits = Limits(mc.vocab_size, mc.max_position, num_pages * cfg.page_size, routing_off,
                    window=mc.context_is_window)
    table = ReqToTokenTable(cfg.max_running_requests, min(mc.max_position, limits.kv_capacity) + 1)
    return kv_pool, allocator, table, limits


def _runner(cfg: EngineConfig, model: DecoderForCausalLM, kv_pool: KVPool, table: ReqToTokenTable,
            memory: MemoryManager, device: torch.device, dtype: torch.dtype) -> ModelRunner:
    """Attention backend and model runner, with its CUDA graphs captured."""
    mc = model.config
    attn = model.model.layers[0].self_attn.attn
    shape = AttentionShape(attn.num_heads, attn.num_kv_heads, mc.head_dim, cfg.page_size, dtype, device,
                           kv_pool.dtype)
    runner = ModelRunner(model, kv_pool, _backend(cfg, shape), (table.max_rows, table.max_context), device,
                         batch_invariant=cfg.deterministic)
    backend = runner.backend
    if cfg.deterministic and device.type == "cuda":
        with DEVICE_WIDE:  # its check replays a CUDA graph
            prepare_products(model)
    compile_one_row_kernels(model)
    if cfg.cuda_graph and backend.supports_cuda_graph:
        with DEVICE_WIDE:  # another engine's thread (on this GPU) waits: see runner/device_lock.py
            torch.cuda.empty_cache()  # so that the difference below is the graph pool alone
            before = torch.cuda.memory_reserved(device)
            # A step's tokens: at most max_prefill_tokens of prompts beside one per running request.
            runner.capture_cuda_graphs(min(cfg.cuda_graph_max_batch_size, cfg.max_running_requests),
                                       memory.saver.graph_capture, cfg.max_prefill_tokens + cfg.max_running_requests)
            torch.cuda.empty_cache()
            graph_bytes = torch.cuda.memory_reserved(device) - before
        memory.register("cuda_graph", extra_bytes=graph_bytes)
    return runner


def replica_runner(parts: EngineParts) -> ModelRunner:
    """Another runner on the engine's model (same weights) with a KV pool and
    request table of its own, without CUDA graphs: given the engine's plans
    in order, it computes the same tokens."""
    cfg, model = parts.config, parts.model
    mc, attn = model.config, model.model.layers[0].self_attn.attn
    kv_pool = KVPool(mc.num_layers, parts.kv_pool.num_slots, attn.num_kv_heads, mc.head_dim, parts.kv_pool.dtype,
                     parts.device)
    shape = AttentionShape(attn.num_heads, attn.num_kv_heads, mc.head_dim, cfg.page_size, parts.dtype, parts.device,
                           kv_pool.dtype)
    return ModelRunner(model, kv_pool, _backend(cfg, shape), parts.runner.table_shape, parts.device,
                       batch_invariant=cfg.deterministic)


def _backend(cfg: EngineConfig, shape: AttentionShape):
    if cfg.deterministic:
        from rollout_engine.attention.invariant_backend import (BatchInvariantAttentionBackend,
                                                                BatchInvariantTritonBackend)

        if shape.device.type == "cuda":
            return BatchInvariantTritonBackend(shape)
        return BatchInvariantAttentionBackend()
    return create_backend(cfg.attention_backend, shape)
