"""Per-tensor checksums of the engine's weights, computed on the device and
the same at any tp_size (kernels/checksum.py): each rank hashes the block of
the full Hugging Face tensor it holds, at that block's position, and rank 0
adds the ranks' sums. A tensor held in a layout that is no such block is
joined on rank 0 first (slow, but none of the current layers needs it)."""
from __future__ import annotations

from typing import Sequence

import torch

from rollout_engine.kernels.checksum import digest, many_sums, tensor_sums, words_per_row
from rollout_engine.weights.loader import WeightLoader

Sums = dict[str, tuple[int, int]]


def _block(loader: WeightLoader, name: str, tp_rank: int, tp_size: int):
    """(2D block, words per row of the full tensor, first row, first word),
    None when this rank adds nothing (a replica), or "join" when the block is
    not rectangular in whole words."""
    local = loader.view(name)
    dim, replicas, trim = loader.shard_layout(name) if tp_size > 1 else (None, 1, None)
    if dim is None:
        if tp_rank:
            return None
        block, cols, row0, col0 = local.reshape(local.shape[0] if local.dim() >= 2 else 1, -1), None, 0, 0
    elif tp_rank % replicas:
        return None
    else:
        part, parts = tp_rank // replicas, tp_size // replicas
        if local.dim() == 1:
            block, cols, row0, col0 = local[None], local.shape[0] * parts, 0, part * local.shape[0]
            if trim is not None:
                return "join"
        elif dim == 0:
            rows = local.shape[0]
            row0 = part * rows
            full_rows = rows * parts if trim is None else trim
            block = local[: max(0, min(rows, full_rows - row0))].reshape(-1, local[0].numel())
            cols, col0 = None, 0
        elif dim == 1 and local.dim() == 2:
            block, cols, row0, col0 = local, local.shape[1] * parts, 0, part * local.shape[1]
        else:
            return "join"
    cols = block.shape[1] if cols is None else cols
    per_word = 4 // block.element_size()
    if col0 % per_word or (block.shape[1] % per_word and col0 + block.shape[1] != cols):
        return "join"
    return block, words_per_row(cols, block.element_size()), row0, col0 // per_word


def rank_sums(loader: WeightLoader, names: Sequence[str], tp_rank: int = 0, tp_size: int = 1
              ) -> tuple[Sums, list[str]]:
    """This rank's lane sums per name (one host read for all of them), and
    the names whose blocks must be joined on rank 0 instead."""
    blocks, joined = {}, []
    with torch.no_grad():
        for name in names:
            block = _block(loader, name, tp_rank, tp_size)
            if block == "join":
                joined.append(name)
            elif block is not None:
                blocks[name] = block
        if not blocks:
            return {}, joined
        host = many_sums(list(blocks.values())).cpu().tolist()
    return {name: (a, b) for name, (a, b) in zip(blocks, host)}, joined


def combine(per_rank: Sequence[Sums], names: Sequence[str], joined: dict[str, torch.Tensor]) -> dict[str, str]:
    """Digest per name from every rank's sums (and the joined tensors)."""
    out = {}
    for name in names:
        if name in joined:
            out[name] = digest(tuple(tensor_sums(joined[name]).cpu().tolist()))
            continue
        a = sum(r[name][0] for r in per_rank if name in r)
        b = sum(r[name][1] for r in per_rank if name in r)
        out[name] = digest((a, b))
    return out
