"""Full tensors out of FSDP-sharded trainer models, one parameter at a time.
Every rank must consume the whole iterator: each step is a collective."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def fsdp_kind(model: nn.Module) -> int:
    """2 for fully_shard (DTensor parameters), 1 for FullyShardedDataParallel, 0 for neither."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return 1
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return 2
    return 0


def iter_full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(trainer name, full tensor). FSDP2 gathers each parameter on its own
    (one full tensor alive at a time); FSDP1 unshards the model once."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    kind = fsdp_kind(model)
    ctx = (FullyShardedDataParallel.summon_full_params(model, writeback=False) if kind == 1
           else contextlib.nullcontext())
    with ctx, torch.no_grad():
        for name, param in model.named_parameters():
            yield name, (param.full_tensor() if isinstance(param, DTensor) else param.detach())
