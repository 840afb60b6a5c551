"""Device-side description of one step, built from a scheduler Batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rollout_engine.cache.kv_pool import KVPool

if TYPE_CHECKING:
    from rollout_engine.attention.base import AttentionBackend
    from rollout_engine.scheduler.batch import Batch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot of each new token
    # Per sequence (CPU): how many new tokens, and the total length after the step.
    extend_lens: np.ndarray
    seq_lens: np.ndarray
    # KV slots of every sequence's whole context (cached prefix + new tokens),
    # concatenated; sequence i owns kv_indices[kv_indptr[i]:kv_indptr[i+1]].
    kv_indices: torch.Tensor
    kv_indptr: np.ndarray
    kv_pool: KVPool
    attn_backend: "AttentionBackend"
    is_decode: bool
    attn_metadata: Any = field(default=None)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @staticmethod
    def from_batch(batch: "Batch", table: np.ndarray, kv_pool: KVPool, backend: "AttentionBackend",
                   device: torch.device) -> "ForwardBatch":
        seq_lens = np.fromiter((s.end for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
        extend_lens = np.fromiter((s.extend_len for s in batch.seqs), dtype=np.int64, count=len(batch.seqs))
        kv_indices = np.concatenate([table[s.req.row, : s.end] for s in batch.seqs])
        kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=kv_indptr[1:])
        # One host->device copy for all index data.
        packed = torch.from_numpy(np.concatenate(
            [batch.input_ids(), batch.positions(), batch.out_cache_loc(), kv_indices]))
        packed = packed.to(device, non_blocking=True)
        t = batch.num_tokens
        fb = ForwardBatch(
            input_ids=packed[:t], positions=packed[t: 2 * t], out_cache_loc=packed[2 * t: 3 * t],
            extend_lens=extend_lens, seq_lens=seq_lens, kv_indices=packed[3 * t:], kv_indptr=kv_indptr,
            kv_pool=kv_pool, attn_backend=backend, is_decode=batch.is_decode,
        )
        backend.init_forward_metadata(fb)
        return fb
