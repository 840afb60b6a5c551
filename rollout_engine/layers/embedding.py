"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous
slice of the (padded) vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout_engine.distributed.comm import TPComm
from rollout_engine.kernels.gemv import logits as logits_product
from rollout_engine.layers.invariant import invariant_linear
from rollout_engine.layers.weight_copy import copy_into


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, comm: TPComm):
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // comm.tp_size)
        self.vocab_start = comm.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: expected {self.vocab_size} vocabulary rows, got {full.shape[0]}")
        rows = full[self.vocab_start: self.vocab_start + self.vocab_per_rank]
        if rows.shape[0] < self.vocab_per_rank:  # the last rank's padding rows stay zero
            param.data[rows.shape[0]:].zero_()
        copy_into(param.data[: rows.shape[0]], rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the full vocabulary. Shares the embedding's parameter when
    the model ties them (one storage, updated once)."""

    def __init__(self, embed: VocabParallelEmbedding, tie: bool, comm: TPComm):
        super().__init__()
        self.comm = comm
        self.vocab_size = embed.vocab_size
        self.tied = tie
        if tie:
            self.weight = embed.weight
        else:
            self.weight = nn.Parameter(torch.empty_like(embed.weight), requires_grad=False)
            self.weight.weight_loader = embed._load  # type: ignore[attr-defined]

    batch_invariant = False  # layers/invariant.py

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab]."""
        if self.batch_invariant:
            local = invariant_linear(hidden, self.weight).float()
        else:
            local = logits_product(hidden, self.weight)
        logits = self.comm.all_gather_last_dim(local)
        return logits[..., : self.vocab_size]
