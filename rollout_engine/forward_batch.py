"""What the model's layers and the attention backends see of one step: the
step's index tensors on the device, plus the runner's copy of the request
table. Built by the runner from a StepPlan; a low-level module, so layers and
backends depend on it and not on the runner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.host_block import BlockLayout
from rollout_engine.plan import StepPlan

if TYPE_CHECKING:
    from rollout_engine.attention.base import AttentionBackend


class TableMirror:
    """The runner's copy of the request table (row r, column p: KV slot of
    token p of the request in row r), kept up to date by the writes each plan
    carries. Backends that build attention indices on the device read
    `tensor`; the torch backend reads `host`."""

    def __init__(self, max_rows: int, max_context: int, device: torch.device, on_device: bool, on_host: bool):
        self.max_context = max_context
        self.host = np.zeros((max_rows, max_context), dtype=np.int64) if on_host else None
        self.tensor = torch.zeros((max_rows, max_context), dtype=torch.int32, device=device) if on_device else None

    def apply(self, writes: np.ndarray | None) -> None:
        """Apply (row, column, slot) entries; duplicates carry equal values
        (ReqToTokenTable.drain_writes), so one scatter in any order is exact."""
        if writes is None:
            return
        if self.host is not None:
            self.host[writes[0], writes[1]] = writes[2]
        if self.tensor is not None:  # one copy and one scatter into the flat table (indexing would be several)
            n = writes.shape[1]
            flat, slots = BlockLayout((np.int64, np.int32), (n, n)).upload(
                (writes[0] * self.tensor.shape[1] + writes[1], writes[2]), self.tensor.device)
            self.tensor.view(-1).scatter_(0, flat, slots)


# input ids, positions, KV slots (per token), request-table rows (per sequence), as they go to the device
INDEX_DTYPES = (np.int64, np.int64, np.int64, np.int32)

# A step run outside the CUDA graphs (prompt chunks, mixed steps) rounds its token count up to a multiple
# of PAD_TOKENS from PAD_TOKENS tokens on: cuBLAS chooses a kernel for each new row count, 0.1-3 ms of
# host time per product the first time a count is seen (about 20 us after), and the token count of such a
# step is new nearly every step. Padding rows read token 0 at position 0, write their K/V to the reserved
# page 0, are left out of attention, and are dropped before the logits (BENCHMARKS.md, "Padded eager steps").
PAD_TOKENS = 64


def padded_tokens(n: int) -> int:
    """The row count an eager step of `n` tokens runs with."""
    return n if n < PAD_TOKENS else -(-n // PAD_TOKENS) * PAD_TOKENS


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot of each new token
    # Per sequence, on the host: new tokens, total length after the step, table row.
    extend_lens: np.ndarray
    seq_lens: np.ndarray
    rows: np.ndarray
    rows_device: torch.Tensor  # [B] int32
    table: TableMirror
    kv_pool: KVPool
    attn_backend: "AttentionBackend"
    is_decode: bool
    attn_metadata: Any = field(default=None)
    pad: int = 0  # padding rows after the step's tokens (`padded_tokens`): not attended, not read
    share_keys: np.ndarray | None = None  # the plan's (`StepPlan.share_keys`): sequences sharing a prefix
    share_lens: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @staticmethod
    def from_plan(plan: StepPlan, table: TableMirror, kv_pool: KVPool, backend: "AttentionBackend",
                  device: torch.device, pad: int = 0) -> "ForwardBatch":
        """`pad`: padding rows after the plan's tokens (input id 0, position 0,
        KV slot 0: the block's zero fill)."""
        # One host->device copy for all per-token index data (`host_block`).
        t = plan.num_tokens + pad
        layout = BlockLayout(INDEX_DTYPES, (t, t, t, len(plan.rows)))
        input_ids, positions, out_cache_loc, rows_device = layout.upload(
            (plan.input_ids, plan.positions, plan.out_cache_loc, plan.rows), device)
        fb = ForwardBatch(
            input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, extend_lens=plan.extend_lens,
            seq_lens=plan.seq_lens, rows=plan.rows, rows_device=rows_device, table=table, kv_pool=kv_pool,
            attn_backend=backend,
            is_decode=plan.is_decode, pad=pad, share_keys=plan.share_keys, share_lens=plan.share_lens,
        )
        backend.init_forward_metadata(fb)
        return fb
