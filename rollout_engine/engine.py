"""RolloutEngine: the public, in-process entry point (API: docs/python-api.md).

A facade: it validates arguments, submits to the engine's step loop
(core/engine_core.py) and waits. Building the parts, the loop, the RL
controls and request creation live in core/."""
from __future__ import annotations

import gc
import weakref
from typing import AsyncIterator, Iterable, Iterator, Mapping, Sequence

import torch

from rollout_engine.config import EngineConfig, check_options
from rollout_engine.core import calls
from rollout_engine.core.controls import PAUSE_MODES
from rollout_engine.core.engine_core import start_core
from rollout_engine.distributed.weight_sync import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S
from rollout_engine.memory.manager import TAGS
from rollout_engine.outputs import RolloutOutput
from rollout_engine.runner.device_lock import DEVICE_WIDE
from rollout_engine.sampling_params import SamplingParams
from rollout_engine.tokenizer import chat_token_ids
from rollout_engine.validation import check_timeout, keywords_named, update_items, warn_flush_cache, weight_name_list

Prompts = Sequence[str] | None
InputIds = Sequence[Sequence[int]] | None
Params = SamplingParams | Sequence[SamplingParams] | None


@keywords_named("generate", "generate_async", "stream", "stream_async")  # temperature=: "a sampling parameter"
class RolloutEngine:
    def __init__(self, model: str, **kwargs):
        check_options(kwargs)
        self.config = cfg = EngineConfig(model=model, **kwargs)
        self.core = start_core(cfg)  # its loop thread builds the parts
        parts = self.core.parts
        self.device, self.dtype, self.tokenizer = parts.device, parts.dtype, parts.tokenizer
        self.model_config, self.limits = parts.model.config, parts.limits
        self._controls = self.core.controls
        # an engine dropped without shutdown() stops its loop (else it would keep the model alive)
        self._finalizer = weakref.finalize(self, self.core.stop, 0)
        self._updater = parts.updater
        self._closed = False

    # ---- generation --------------------------------------------------------------
    def generate(self, prompts: Prompts = None, input_ids: InputIds = None, sampling_params: Params = None,
                 request_ids: Sequence[str] | None = None, progress: bool = False) -> list[RolloutOutput]:
        """Blocking; one output per (prompt, sample), samples of a prompt adjacent."""
        return calls.generate(self.core, (*self._inputs(prompts, input_ids, sampling_params), request_ids), progress)

    async def generate_async(self, prompts: Prompts = None, input_ids: InputIds = None,
                             sampling_params: Params = None, request_ids: Sequence[str] | None = None,
                             progress: bool = False) -> list[RolloutOutput]:
        """Awaitable `generate`; cancelling the awaiting task aborts its requests."""
        inputs = self._inputs(prompts, input_ids, sampling_params)
        return await calls.generate_async(self.core, (*inputs, request_ids), progress)

    def stream(self, prompts: Prompts = None, input_ids: InputIds = None, sampling_params: Params = None,
               request_ids: Sequence[str] | None = None) -> Iterator[RolloutOutput]:
        """Deltas as tokens are produced: each carries a request's tokens (and
        logprobs, and text of complete characters, never a stop string) since
        its previous delta; `finish_reason` is None until its last one.
        Closing the iterator early aborts its requests."""
        return calls.stream(self.core, (*self._inputs(prompts, input_ids, sampling_params), request_ids))

    def stream_async(self, prompts: Prompts = None, input_ids: InputIds = None, sampling_params: Params = None,
                     request_ids: Sequence[str] | None = None) -> AsyncIterator[RolloutOutput]:
        """`stream` for `async for`; closing it (aclose, cancellation) aborts its requests."""
        return calls.stream_async(self.core, (*self._inputs(prompts, input_ids, sampling_params), request_ids))

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Stop the named (or all) requests that exist now; they finish with
        "abort" and keep what they produced. Returns how many were stopped."""
        if request_ids is not None and (isinstance(request_ids, str) or not isinstance(request_ids, (list, tuple))):
            raise ValueError("request_ids must be a list of request id strings, or None for all")
        return self._call("abort", None if request_ids is None else list(request_ids))

    def num_unfinished_requests(self) -> int:
        """Requests queued or running (samples not forked yet included)."""
        return self._call("num_unfinished")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return chat_token_ids(self.tokenizer, messages, add_generation_prompt)

    # ---- RL controls (applied by the step loop between two steps) ----------------
    @property
    def weight_version(self) -> int:
        return self._updater.version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                       version: int | None = None, flush_cache: bool = True) -> int:
        """Copy new weights in place (HF names); returns the new version. A list or dict: all or nothing;
        a generator is streamed (docs/rl-loop.md, "New weights from the trainer")."""
        warn_flush_cache(flush_cache)
        named_tensors = update_items(named_tensors)
        return self._call("update_weights", named_tensors, version)

    def update_weights_from_disk(self, path: str, version: int | None = None) -> int:
        return self._call("update_from_disk", path, version)

    def init_weight_sync_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                               group_name: str = "weight_sync", backend: str = "nccl") -> None:
        return self._call("init_weight_sync_group", master_address, master_port, rank_offset, world_size,
                          group_name, backend)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                                        shapes: Sequence[Sequence[int]], src_rank: int = 0,
                                        version: int | None = None, group_name: str = "weight_sync",
                                        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                                        timeout_s: float | None = DEFAULT_TIMEOUT_S) -> int:
        """Receive broadcast buckets; a sender that stops fails the call within `timeout_s`."""
        return self._call("update_from_distributed", names, dtypes, shapes, src_rank, version,
                          group_name, bucket_bytes, check_timeout(timeout_s))

    def destroy_weight_sync_group(self, group_name: str = "weight_sync") -> None:
        return self._call("destroy_weight_sync_group", group_name)

    def get_weight(self, name: str) -> torch.Tensor:
        """A copy of the weight `name` (HF name), unfused."""
        return self._call("get_weight", name)

    def weights_checksum(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """HF name -> digest of the full tensor as held (= fidelity.weights_checksum(..., quantization))."""
        return self._call("weights_checksum", weight_name_list(names))

    def weight_names(self) -> list[str]:
        """The HF names that together cover every weight of the model."""
        return self._updater.loader.full_names()

    def release_memory(self, tags: Sequence[str] = TAGS) -> dict[str, int]:
        """Unmap `tags` (addresses kept); bytes freed per tag. Needs
        enable_memory_saver=True and nothing running (pause first)."""
        return self._call("release_memory", tags)

    def resume_memory(self, tags: Sequence[str] = TAGS) -> None:
        return self._call("resume_memory", tags)

    def memory_state(self) -> dict[str, str]:
        return self._call("memory_state")

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry not used by a running request."""
        return self._call("flush_cache")

    def pause_generation(self, mode: str = "abort") -> None:
        """"abort": requests finish now with "abort"; "keep": they wait with
        their KV; "retract": they give their KV back (kept in the prefix cache
        where it can be) and wait. Later tokens come from the weights current
        then (`output_weight_versions`)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        return self._call("pause", mode)

    def continue_generation(self) -> None:
        return self._call("resume_generation")

    # ---- observation -------------------------------------------------------------
    def cache_stats(self) -> dict[str, float]:
        return self._call("cache_stats")

    def metrics(self) -> dict:
        """Counters and timings since the engine started (docs/python-api.md, "Observing an engine")."""
        return self._call("metrics")

    def check_integrity(self) -> None:
        """Assert that every KV page is free, held by one running request, or cached."""
        return self._call("check_integrity")

    def shutdown(self) -> None:
        """Abort what runs, stop the loop, free the model, KV cache and CUDA
        graphs; later calls raise RuntimeError. Idempotent."""
        if self._closed:
            return
        self._finalizer.detach()
        self.core.stop()
        self._closed = True
        parts = self.core.parts
        with DEVICE_WIDE:  # freeing memory would break another engine's capture (runner/device_lock.py)
            if parts.runner.graphs is not None:
                parts.runner.graphs.destroy()
            self.core = self._controls = self._updater = None
            del parts
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # ---- internals ---------------------------------------------------------------
    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def _call(self, control: str, *args):
        """Run a control (core/controls.py) on the step loop."""
        self._require_open()
        return self.core.call(getattr(self._controls, control), *args)

    def _inputs(self, prompts, input_ids, sampling_params) -> tuple[list[list[int]], list[SamplingParams]]:
        self._require_open()
        return self.core.factory.validate(prompts, input_ids, sampling_params)
