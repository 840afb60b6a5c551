"""RL control routes (SGLang's names). Each is applied by the engine's step
loop between two steps; the engine's own checks answer bad input (400) and
refusals in the current state (409, with the reason)."""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr

from rollout_engine.distributed.weight_sync import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S
from rollout_engine.server.errors import ApiError
from rollout_engine.weights.updater import MAX_VERSION
from rollout_engine.server.state import state_of

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DiskBody(_Body):
    model_path: StrictStr
    weight_version: StrictInt | StrictStr | None = None
    load_format: StrictStr | None = None
    flush_cache: bool = True  # always: the cached KV belongs to the old weights
    abort_all_requests: bool = False


class GroupBody(_Body):
    master_address: StrictStr
    master_port: StrictInt
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: StrictStr = "weight_sync"
    backend: StrictStr = "nccl"


class DistributedBody(_Body):
    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = "weight_sync"
    weight_version: StrictInt | StrictStr | None = None
    bucket_bytes: StrictInt = DEFAULT_BUCKET_BYTES  # as the sender packs them
    timeout_s: StrictFloat | StrictInt | None = DEFAULT_TIMEOUT_S  # a sender that stops fails the call by then
    flush_cache: bool = True  # always: the cached KV belongs to the old weights
    abort_all_requests: bool = False


class DestroyBody(_Body):
    group_name: StrictStr = "weight_sync"


class TagsBody(_Body):
    tags: list[StrictStr] | None = None


class PauseBody(_Body):
    mode: StrictStr = "abort"


class AbortBody(_Body):
    rid: StrictStr | list[StrictStr] | None = None
    abort_all: bool = False


def _version(value) -> int | None:
    """SGLang sends weight_version as a string; the engine counts integers."""
    if value is None:
        return None
    ok = (value.isascii() and value.isdigit()) if isinstance(value, str) else isinstance(value, int) and value >= 0
    if not ok or int(value) > MAX_VERSION:
        raise ApiError(400, f"weight_version must be an integer in [0, {MAX_VERSION}], got {value!r}", "weight_version")
    return int(value)


def _tags(body: TagsBody) -> tuple:
    return () if body.tags is None else (body.tags,)


async def _tagged(control, body: TagsBody) -> Any:
    """A memory control on the request's tags; an unknown tag is the request's `tags`."""
    try:
        return await _in_thread(control, *_tags(body))
    except ValueError as e:
        raise ApiError(400, str(e), "tags") from None


async def _in_thread(fn, *args) -> Any:
    """Controls wait for the loop to apply them: keep the event loop serving."""
    return await asyncio.to_thread(fn, *args)


def _ok(message: str = "", **extra) -> dict:
    return {"success": True, "message": message, **extra}


@router.post("/update_weights_from_disk")
async def update_from_disk(body: DiskBody, request: Request):
    engine = state_of(request).engine
    if body.load_format not in (None, "auto", "safetensors"):
        raise ApiError(400, f"load_format {body.load_format!r} is not supported (safetensors)", "load_format")
    if body.abort_all_requests:
        await _in_thread(engine.abort)
    try:
        version = await _in_thread(engine.update_weights_from_disk, body.model_path, _version(body.weight_version))
    except (ValueError, OSError) as e:  # the folder, or what it holds (no shards, a damaged one): model_path
        raise ApiError(400, str(e), "model_path") from None
    return _ok("weights updated from disk", weight_version=version)


@router.post("/init_weights_update_group")
async def init_group(body: GroupBody, request: Request):
    engine = state_of(request).engine
    await _in_thread(engine.init_weight_sync_group, body.master_address, body.master_port, body.rank_offset,
                     body.world_size, body.group_name, body.backend)
    return _ok("weight-sync group joined")


@router.post("/update_weights_from_distributed")
async def update_from_distributed(body: DistributedBody, request: Request):
    import torch

    engine = state_of(request).engine
    dtypes = []
    for i, name in enumerate(body.dtypes):
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ApiError(400, f"dtypes[{i}] {name!r} is not a torch dtype", f"dtypes[{i}]")
        dtypes.append(dtype)
    if body.abort_all_requests:
        await _in_thread(engine.abort)
    version = await _in_thread(lambda: engine.update_weights_from_distributed(
        body.names, dtypes, body.shapes, group_name=body.group_name, version=_version(body.weight_version),
        bucket_bytes=body.bucket_bytes, timeout_s=body.timeout_s))
    return _ok("weights updated", weight_version=version)


@router.post("/destroy_weights_update_group")
async def destroy_group(body: DestroyBody, request: Request):
    await _in_thread(state_of(request).engine.destroy_weight_sync_group, body.group_name)
    return _ok("weight-sync group left")


@router.post("/release_memory_occupation")
async def release(body: TagsBody, request: Request):
    engine = state_of(request).engine
    if not engine.metrics()["paused"] and engine.num_unfinished_requests():
        raise ApiError(409, "requests are running: pause generation (pause_generation) or wait before releasing")
    freed = await _tagged(engine.release_memory, body)
    return _ok("memory released", freed_bytes=freed)


@router.post("/resume_memory_occupation")
async def resume(body: TagsBody, request: Request):
    await _tagged(state_of(request).engine.resume_memory, body)
    return _ok("memory resumed")


@router.post("/pause_generation")
async def pause(body: PauseBody, request: Request):
    await _in_thread(state_of(request).engine.pause_generation, body.mode)
    return _ok(f"generation paused ({body.mode})")


@router.post("/continue_generation")
async def resume_generation(request: Request):
    await _in_thread(state_of(request).engine.continue_generation)
    return _ok("generation continues")


@router.post("/flush_cache")
async def flush(request: Request):
    await _in_thread(state_of(request).engine.flush_cache)
    return _ok("prefix cache flushed")


@router.post("/abort_request")
async def abort(body: AbortBody, request: Request):
    engine = state_of(request).engine
    if body.abort_all or body.rid is None:
        count = await _in_thread(engine.abort)
    else:
        rids = [body.rid] if isinstance(body.rid, str) else body.rid
        count = await _in_thread(engine.abort, rids)
    return _ok(f"{count} requests aborted", aborted=count)
