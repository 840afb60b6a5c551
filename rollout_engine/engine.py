"""RolloutEngine: the public, in-process entry point (README.md, "Use")."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from rollout_engine.attention.base import AttentionShape, create_backend
from rollout_engine.cache.allocator import PageAllocator
from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.cache.prefix_cache import NoPrefixCache
from rollout_engine.cache.radix import RadixCache
from rollout_engine.cache.req_table import ReqToTokenTable
from rollout_engine.config import EngineConfig
from rollout_engine.distributed.comm import TPComm
from rollout_engine.kv_sizing import kv_bytes_per_token, kv_capacity_tokens
from rollout_engine.memory.controller import MemoryController
from rollout_engine.memory.manager import TAGS, MemoryManager
from rollout_engine.memory.saver import create_saver
from rollout_engine.model_zoo import resolve_model_path
from rollout_engine.outputs import RolloutOutput, build_output
from rollout_engine.request import Request
from rollout_engine.request_factory import RequestFactory
from rollout_engine.runner.model_loader import load_model, resolve_device, resolve_dtype
from rollout_engine.runner.model_runner import ModelRunner
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.scheduler.kv_manager import KVManager
from rollout_engine.scheduler.scheduler import Scheduler, SchedulerConfig
from rollout_engine.scheduler.stats import counters
from rollout_engine.scheduler.stop import StopChecker
from rollout_engine.tokenizer import chat_token_ids, load_tokenizer, tokenizer_eos_ids
from rollout_engine.distributed.weight_sync import DEFAULT_BUCKET_BYTES
from rollout_engine.weights.loader import WeightLoader
from rollout_engine.weights.receiver import WeightReceiver
from rollout_engine.weights.updater import WeightUpdater
from rollout_engine.validation import Limits


PAUSE_MODES = ("abort", "keep", "retract")


class RolloutEngine:
    def __init__(self, model: str, **kwargs):
        self.config = cfg = EngineConfig(model=model, **kwargs)
        if cfg.tp_size != 1:
            raise ValueError("tp_size > 1 is not supported yet")
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.memory = MemoryManager(create_saver(cfg.enable_memory_saver, self.device))
        self._load_model(resolve_model_path(model, cfg.load_format))
        allocator, table = self._build_kv_memory(free_before)
        self._build_runtime(allocator, table)
        self._paused = False
        self._lock = threading.Lock()
        self._requests = RequestFactory(self.tokenizer, self.limits, cfg.seed)
        self._closed = False

    def _load_model(self, path: str) -> None:
        cfg = self.config
        self.model = load_model(path, cfg.load_format, TPComm(), self.device, self.dtype, cfg.seed,
                                weights_region=self.memory.region("weights", cfg.weights_cpu_backup))
        self.memory.register("weights", self.model.parameters())
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(path, cfg.tokenizer)

    def _build_kv_memory(self, free_before: int) -> tuple[PageAllocator, ReqToTokenTable]:
        """KV pool (in its memory region), slot allocator, request table and
        prefix cache, sized from max_total_tokens or the free GPU memory."""
        cfg, mc = self.config, self.model_config
        attn = self.model.model.layers[0].self_attn.attn
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        capacity = kv_capacity_tokens(cfg, mc, kv_bytes_per_token(mc, attn.num_kv_heads, self.dtype), self.device,
                                      free_before, weight_bytes, self.dtype.itemsize)
        num_pages = -(-capacity // cfg.page_size)
        allocator = PageAllocator(num_pages, cfg.page_size)
        with self.memory.region("kv_cache"):
            self.kv_pool = KVPool(mc.num_layers, allocator.num_slots, attn.num_kv_heads, mc.head_dim,
                                  self.dtype, self.device)
        self.memory.register("kv_cache", self.kv_pool.k + self.kv_pool.v)
        self.limits = Limits(mc.vocab_size, mc.max_position, num_pages * cfg.page_size)
        table = ReqToTokenTable(cfg.max_running_requests, min(mc.max_position, self.limits.kv_capacity) + 1)
        self.prefix_cache = RadixCache(allocator) if cfg.enable_prefix_cache else NoPrefixCache(allocator)
        return allocator, table

    def _build_runtime(self, allocator: PageAllocator, table: ReqToTokenTable) -> None:
        """Attention backend, model runner (and its CUDA graphs), scheduler,
        memory controller."""
        cfg, mc = self.config, self.model_config
        attn = self.model.model.layers[0].self_attn.attn
        shape = AttentionShape(attn.num_heads, attn.num_kv_heads, mc.head_dim, cfg.page_size, self.dtype, self.device)
        backend = create_backend(cfg.attention_backend, shape)
        self.runner = ModelRunner(self.model, self.kv_pool, backend, (table.max_rows, table.max_context), self.device)
        if cfg.cuda_graph and backend.supports_cuda_graph:
            torch.cuda.empty_cache()  # so that the difference below is the graph pool alone
            before = torch.cuda.memory_reserved(self.device)
            self.runner.capture_cuda_graphs(min(cfg.cuda_graph_max_batch_size, cfg.max_running_requests),
                                           self.memory.saver.graph_capture)
            torch.cuda.empty_cache()
            self.memory.register("cuda_graph", extra_bytes=torch.cuda.memory_reserved(self.device) - before)
        stop = StopChecker(mc.eos_token_ids or tokenizer_eos_ids(self.tokenizer), mc.max_position, self.tokenizer)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_running_requests, cfg.max_prefill_tokens, overlap=cfg.overlap_schedule),
            KVManager(allocator, table, self.prefix_cache), self.runner, stop,
            weight_version=lambda: self._updater.version)
        loader = WeightLoader(self.model)
        self._memory = MemoryController(self.memory, self.scheduler, self.prefix_cache, self.runner, self.device,
                                        cfg.weights_cpu_backup, loader.required())
        self._updater = WeightUpdater(loader, WeightReceiver(), self._memory, self.prefix_cache, self.device)

    # ---- generation ------------------------------------------------------------
    def generate(self, prompts: Sequence[str] | None = None, input_ids: Sequence[Sequence[int]] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 request_ids: Sequence[str] | None = None, progress: bool = False) -> list[RolloutOutput]:
        """Blocking; one output per (prompt, sample), samples of a prompt adjacent."""
        reqs = self._make_requests(prompts, input_ids, sampling_params, request_ids)
        for _ in self._drive(reqs, progress):
            pass
        return [build_output(r, self.scheduler.stop) for r in reqs]

    async def generate_async(self, *args, **kwargs) -> list[RolloutOutput]:
        """Awaitable `generate`; concurrent calls are batched together."""
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def stream(self, prompts: Sequence[str] | None = None, input_ids: Sequence[Sequence[int]] | None = None,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               request_ids: Sequence[str] | None = None) -> Iterator[RolloutOutput]:
        """Yields deltas: each carries the tokens (and logprobs) produced since
        the previous delta of that request; `finish_reason` is None until the
        request's last delta."""
        # Delta texts hold complete characters and never a stop string (nor a
        # tail that may still become one, held back until decided); a
        # request's delta texts and token ids add up to what `generate` returns.
        reqs = self._make_requests(prompts, input_ids, sampling_params, request_ids)
        drive = self._drive(reqs, progress=False)
        try:
            yield from self._deltas(reqs, drive)
        finally:
            drive.close()  # a stream closed early aborts its requests

    def _deltas(self, reqs: list[Request], drive: Iterator[None]) -> Iterator[RolloutOutput]:
        sent = {id(r): 0 for r in reqs}
        closed: set[int] = set()
        for _ in drive:
            with self._lock:  # other callers' threads step these requests too: read a settled state
                deltas = []
                for r in reqs:
                    if id(r) in closed or not (r.num_output_tokens > sent[id(r)] or r.finished):
                        continue
                    deltas.append(build_output(r, self.scheduler.stop, since=sent[id(r)]))
                    sent[id(r)] = r.num_output_tokens
                    if r.finished:
                        closed.add(id(r))
            yield from deltas

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Stop the named (or all) requests that exist now; they finish with
        "abort" and keep what they produced. Unknown ids are ignored, and a
        request submitted later is never affected. Returns how many requests
        were stopped."""
        if request_ids is not None and (isinstance(request_ids, str) or not isinstance(request_ids, (list, tuple))):
            raise ValueError("request_ids must be a list of request id strings, or None for all")
        self._require_open()
        with self._lock:
            return self.scheduler.abort(None if request_ids is None else list(request_ids))

    def num_unfinished_requests(self) -> int:
        """Requests queued or running (samples not forked yet included)."""
        self._require_open()
        with self._lock:
            return len(self.scheduler.live_requests())

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat conversation, ready for `generate(input_ids=...)`."""
        return chat_token_ids(self.tokenizer, messages, add_generation_prompt)

    # ---- RL controls -----------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._updater.version

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry not used by a running request."""
        self._require_open()
        with self._lock:
            self.prefix_cache.flush()

    def cache_stats(self) -> dict[str, float]:
        """Prefix-cache and scheduler counters since the engine started."""
        self._require_open()
        return counters(self.prefix_cache, self.scheduler)

    def metrics(self) -> dict:
        """A snapshot of counters and timings since the engine started:
        requests (running, waiting, finished by reason), tokens, steps, step
        and time-to-first-token times, the prefix cache (`cache_stats()`),
        the weight version and the memory state."""
        self._require_open()
        with self._lock:
            sched = self.scheduler
            return {"running_requests": len(sched.running), "waiting_requests": len(sched.waiting),
                    **sched.stats.snapshot(), "cache": self.cache_stats(), "weight_version": self.weight_version,
                    "kv_capacity_tokens": self.limits.kv_capacity, "memory": self._memory.state()}

    def check_integrity(self) -> None:
        """Assert that every KV page is free, held by one running request, or
        in the prefix cache."""
        self._require_open()
        with self._lock:
            self.scheduler.check_integrity()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       version: int | None = None, flush_cache: bool = True) -> int:
        """Copy new weights in place (HF names; fused and sharded layouts are
        handled here; any dtype or device). Addresses never change, so CUDA
        graphs stay valid. A list or dict is checked whole first: a bad name
        or shape raises ValueError and changes nothing. A generator is
        streamed, one tensor at a time. Values are checked for NaN/inf as
        they are copied: a non-finite value raises ValueError naming the
        first bad tensor. After a failure that copied tensors (a non-finite
        value, a stream that broke off), generating is refused until a
        complete update. Returns the new weight version."""
        self._require_open()
        if isinstance(named_tensors, Mapping):
            named_tensors = list(named_tensors.items())
        with self._lock:
            return self._updater.update(named_tensors, version, flush_cache)

    def update_weights_from_disk(self, path: str, version: int | None = None) -> int:
        """The same from a safetensors folder; names and shapes are checked
        from the file headers before any tensor is read."""
        self._require_open()
        with self._lock:
            return self._updater.update_from_disk(path, version)

    def init_weight_sync_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                               group_name: str = "weight_sync", backend: str = "nccl") -> None:
        """Join a weight-sync group (its own rendezvous; rank 0 is the
        trainer's sender, this engine's rank is rank_offset + its TP rank)."""
        self._require_open()
        self._updater.receiver.init_group(master_address, master_port, rank_offset, world_size, group_name, backend)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                                        shapes: Sequence[Sequence[int]], src_rank: int = 0,
                                        version: int | None = None, group_name: str = "weight_sync",
                                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Receive weights broadcast by the sender in buckets (the same
        `bucket_bytes` on both sides) and copy them in place. A bad name or
        shape raises ValueError after the broadcasts were drained (so the
        sender never hangs), with nothing changed."""
        self._require_open()
        with self._lock:
            return self._updater.update_from_distributed(names, dtypes, shapes, src_rank, version, group_name,
                                                         bucket_bytes)

    def destroy_weight_sync_group(self, group_name: str = "weight_sync") -> None:
        self._require_open()
        self._updater.receiver.destroy(group_name)

    def get_weight(self, name: str) -> torch.Tensor:
        """A copy of the weight `name` (HF name), unfused."""
        self._require_open()
        with self._lock:
            return self._updater.loader.read(name)

    def weight_names(self) -> list[str]:
        """The HF names that together cover every weight of the model."""
        return self._updater.loader.full_names()

    def release_memory(self, tags: Sequence[str] = TAGS) -> dict[str, int]:
        """Unmap the GPU memory of `tags` (addresses are kept); returns the
        bytes the driver saw freed per tag. Needs enable_memory_saver=True;
        refuses while requests run unless generation is paused, and refuses
        the KV cache while paused requests hold it. The prefix cache goes with
        the KV cache. CUDA graphs are unmapped under the preload hook and kept
        in torch hook mode (0 bytes; see memory/controller.py)."""
        self._require_open()
        with self._lock:
            return self._memory.release(tags, self._paused)

    def resume_memory(self, tags: Sequence[str] = TAGS) -> None:
        """Map `tags` again at the same addresses. Weights come back as they
        were with weights_cpu_backup=True; otherwise new weights must be
        loaded before generating. CUDA graphs stay valid."""
        self._require_open()
        with self._lock:
            self._memory.resume(tags)

    def memory_state(self) -> dict[str, str]:
        """tag -> "resident" | "released", for the tags this engine holds
        (no "cuda_graph" without CUDA graphs)."""
        self._require_open()
        return self._memory.state()

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop stepping. "abort": running and waiting requests finish with
        "abort" now; "keep": they stay, holding their KV, until
        continue_generation(); "retract": running requests give up their KV
        (kept in the prefix cache where it can be) and wait, so the KV cache
        can be released meanwhile; they resume from their output so far.
        With "keep" or "retract", tokens after a weight update come from the
        new weights (`output_weight_versions`). New generate calls are
        refused while paused."""
        self._require_open()
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._lock:
            self.scheduler.settle()
            if mode == "abort":
                self.scheduler.abort()
                self.scheduler.finish_aborted()
            elif mode == "retract":
                self.scheduler.retract_all()
            self._paused = True

    def continue_generation(self) -> None:
        self._require_open()
        self._paused = False

    def shutdown(self) -> None:
        """Abort what runs, then drop the model, the KV cache and the CUDA
        graphs; every later call raises RuntimeError. Calling it again does
        nothing."""
        if self._closed:
            return
        with self._lock:
            self.scheduler.abort()
            while self.scheduler.has_work():
                self.scheduler.step()
            self._closed = True
            if self.runner.graphs is not None:
                self.runner.graphs.destroy()
            # Everything that holds device memory goes; what is left is the
            # configuration and counters.
            self.runner = self.scheduler = self.model = self.kv_pool = self._memory = None
            self._updater = self.prefix_cache = None
            self.memory = None
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    # ---- internals -------------------------------------------------------------
    def _make_requests(self, prompts, input_ids, sampling_params, request_ids) -> list[Request]:
        self._require_open()
        if self._paused:
            raise RuntimeError("generation is paused: call continue_generation() first")
        self._memory.check_can_generate()
        token_lists, params = self._requests.validate(prompts, input_ids, sampling_params)
        with self._lock:
            taken = {r.request_id for r in self.scheduler.live_requests()}
            groups = self._requests.create(token_lists, params, request_ids, taken)
            for group in groups:
                if self.prefix_cache.enabled:
                    # The prompt is prefilled once; samples 1..n-1 fork from it.
                    group[0].fork_siblings = group[1:]
                    self.scheduler.add(group[0])
                else:
                    for r in group:
                        self.scheduler.add(r)
        return [r for group in groups for r in group]

    def _drive(self, reqs: list[Request], progress: bool) -> Iterator[None]:
        """Step the scheduler until every request in `reqs` finished; other
        callers' requests ride along in the same batches."""
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), disable=not progress, desc="rollout", unit="req")
        done = 0
        try:
            while done < len(reqs):
                if self._paused:  # another thread paused generation: wait for continue_generation()
                    time.sleep(0.001)
                    yield
                    continue
                with self._lock:
                    if not all(r.finished for r in reqs):
                        self.scheduler.step()
                now = sum(r.finished for r in reqs)
                bar.update(now - done)
                done = now
                yield
        finally:
            bar.close()
            # Left early (a closed stream, Ctrl-C, an error): the caller will
            # not collect these requests, so stop them and return their KV.
            if not self._closed and not all(r.finished for r in reqs):
                with self._lock:
                    self.scheduler.abort_requests(reqs)
                    self.scheduler.finish_aborted()  # no batch runs: the engine may be paused
