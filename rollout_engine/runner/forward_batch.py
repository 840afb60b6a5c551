"""Device-side description of one step, built from a scheduler Batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rollout_engine.cache.kv_pool import KVPool
from rollout_engine.cache.req_table import ReqToTokenTable

if TYPE_CHECKING:
    from rollout_engine.attention.base import AttentionBackend
    from rollout_engine.scheduler.batch import Batch


class DeviceTable:
    """A device mirror of the request table, updated by one scatter a step."""

    def __init__(self, table: ReqToTokenTable, device: torch.device):
        self.host = table
        self.tensor = torch.from_numpy(table.table.astype(np.int32)).to(device)
        table.track_writes()

    def sync(self) -> None:
        writes = self.host.drain_writes()
        if writes is not None:
            w = torch.from_numpy(writes).to(self.tensor.device, non_blocking=True)
            self.tensor[w[0], w[1]] = w[2].to(torch.int32)


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
    table: ReqToTokenTable
    device_table: DeviceTable | None
    kv_pool: KVPool
    attn_backend: "AttentionBackend"
    is_decode: bool
    attn_metadata: Any = field(default=None)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @staticmethod
    def from_batch(batch: "Batch", table: ReqToTokenTable, device_table: DeviceTable | None, kv_pool: KVPool,
                   backend: "AttentionBackend", device: torch.device) -> "ForwardBatch":
        n = len(batch.seqs)
        seq_lens = np.fromiter((s.end for s in batch.seqs), dtype=np.int64, count=n)
        extend_lens = np.fromiter((s.extend_len for s in batch.seqs), dtype=np.int64, count=n)
        rows = np.fromiter((s.req.row for s in batch.seqs), dtype=np.int64, count=n)
        # One host->device copy for all per-token index data.
        packed = torch.from_numpy(np.concatenate([batch.input_ids(), batch.positions(), batch.out_cache_loc(), rows]))
        packed = packed.to(device, non_blocking=True)
        t = batch.num_tokens
        fb = ForwardBatch(
            input_ids=packed[:t], positions=packed[t: 2 * t], out_cache_loc=packed[2 * t: 3 * t],
            extend_lens=extend_lens, seq_lens=seq_lens, rows=rows, rows_device=packed[3 * t:].to(torch.int32),
            table=table, device_table=device_table, kv_pool=kv_pool, attn_backend=backend,
            is_decode=batch.is_decode,
        )
        backend.init_forward_metadata(fb)
        return fb
