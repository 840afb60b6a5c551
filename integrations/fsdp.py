"""Weight sync from FSDP trainers (FSDP2 `fully_shard` and FSDP1), into a
colocated engine or through a WeightSender."""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from rollout_engine.distributed.fsdp_gather import iter_full_parameters

# Wrapper modules add these to parameter names; HF checkpoint names lack them.
WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def hf_name(trainer_name: str) -> str:
    for part in WRAPPER_PARTS:
        trainer_name = trainer_name.replace(part, "")
    return trainer_name


def iter_hf_tensors(model: nn.Module, name_map: Callable[[str], str | None] = hf_name
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor), gathered one parameter at a time; a name_map
    returning None skips that parameter. Collective: run it on every rank."""
    for name, tensor in iter_full_parameters(model):
        mapped = name_map(name)
        if mapped is not None:
            yield mapped, tensor


def sync_to_engine(model: nn.Module, engine, version: int | None = None,
                   name_map: Callable[[str], str | None] = hf_name) -> int:
    """Every rank updates its colocated engine, streaming (no second full
    copy of the model). Returns the engine's new weight version."""
    return engine.update_weights(iter_hf_tensors(model, name_map), version=version)


def sync_through_sender(model: nn.Module, sender, is_sender_rank: bool,
                        name_map: Callable[[str], str | None] = hf_name):
    """Gather on every trainer rank; the sender rank broadcasts bucket by
    bucket to the engine. Returns (names, dtypes, shapes), which the engine
    needs for update_weights_from_distributed, on the sender rank (None
    elsewhere). The engine must be told them before the broadcasts start:
    use `metadata(model)` for that."""
    stream = iter_hf_tensors(model, name_map)
    if not is_sender_rank:
        for _ in stream:
            pass
        return None
    return sender.send_stream(stream, metadata(model, name_map))


def metadata(model: nn.Module, name_map: Callable[[str], str | None] = hf_name):
    """(names, dtypes, shapes) of the full parameters, without gathering
    (DTensor shapes are global). FSDP1 flattens parameters: use FSDP2, or
    gather once with iter_hf_tensors."""
    names, dtypes, shapes = [], [], []
    for name, param in model.named_parameters():
        mapped = name_map(name)
        if mapped is not None:
            names.append(mapped)
            dtypes.append(param.dtype)
            shapes.append(tuple(param.shape))
    return names, dtypes, shapes
