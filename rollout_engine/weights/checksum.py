"""Per-tensor checksums of the engine's weights, computed on the device and
the same at any tp_size (kernels/checksum.py): each rank hashes the block of
the full Hugging Face tensor it holds, at that block's position, and rank 0
adds the ranks' sums. A tensor held in a layout that is no such block is
joined on rank 0 first (slower): an fp8 weight (its values are computed from
its scales) and, at tp_size > 1, an MoE layer's fused gate/up experts (each
rank's slice is two pieces of the full tensor)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from rollout_engine.kernels.checksum import SumPlan, digest, tensor_sums, words_per_row
from rollout_engine.weights.loader import WeightLoader

Sums = dict[str, tuple[int, int]]


class _Kept(NamedTuple):
    addresses: tuple[int, ...]  # of every parameter when the plan was built
    names: list[str]  # the names the plan hashes, in its order
    plan: SumPlan | None
    joined: list[str]  # names to join on rank 0 instead


def _block(loader: WeightLoader, name: str, tp_rank: int, tp_size: int):
    """(2D block, words per row of the full tensor, first row, first word),
    None when this rank adds nothing (a replica), or "join" when the block is
    not rectangular in whole words."""
    if loader.is_fp8(name):  # its values are computed, not held: no block to keep a plan on
        return "join"
    local = loader.view(name)
    dim, replicas, trim, pieces = loader.shard_layout(name) if tp_size > 1 else (None, 1, None, 1)
    if pieces > 1:
        return "join"
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
        elif dim == local.dim() - 1:  # split along the last dimension: a column block of a 2-D view
            block = local.reshape(-1, local.shape[-1])
            cols, row0, col0 = local.shape[-1] * parts, 0, part * local.shape[-1]
        else:
            return "join"
    cols = block.shape[1] if cols is None else cols
    per_word = 4 // block.element_size()
    if col0 % per_word or (block.shape[1] % per_word and col0 + block.shape[1] != cols):
        return "join"
    return block, words_per_row(cols, block.element_size()), row0, col0 // per_word


class RankChecksums:
    """This rank's lane sums of the engine's weights. The plan for a list of
    names (which block of which parameter, as a device table: kernels/
    checksum.py's `SumPlan`) is built once and kept, since the weights are
    updated in place and never move; it is rebuilt if any parameter's
    address changed. A few recent name lists are kept."""

    KEEP = 4

    def __init__(self, loader: WeightLoader, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.loader, self.tp_rank, self.tp_size = loader, tp_rank, tp_size
        self._plans: dict[tuple[str, ...], _Kept] = {}

    def _addresses(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.loader.params.values())

    def _plan(self, names: tuple[str, ...], addresses: tuple[int, ...]) -> _Kept:
        blocks, joined = {}, []
        for name in names:
            block = _block(self.loader, name, self.tp_rank, self.tp_size)
            if block == "join":
                joined.append(name)
            elif block is not None:
                blocks[name] = block
        return _Kept(addresses, list(blocks), SumPlan(list(blocks.values())) if blocks else None, joined)

    def sums(self, names: Sequence[str]) -> tuple[Sums, list[str]]:
        """Lane sums per name (one host read for all of them), and the names
        whose blocks must be joined on rank 0 instead."""
        key, addresses = tuple(names), self._addresses()
        kept = self._plans.pop(key, None)
        if kept is None or kept.addresses != addresses:
            with torch.no_grad():
                kept = self._plan(key, addresses)
        self._plans[key] = kept
        while len(self._plans) > self.KEEP:
            self._plans.pop(next(iter(self._plans)))
        if kept.plan is None:
            return {}, kept.joined
        with torch.no_grad():
            host = kept.plan.run().cpu().tolist()
        return {name: (a, b) for name, (a, b) in zip(kept.names, host)}, kept.joined


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
