"""Decode steps of one sequence (the end of every rollout, batch-1 decode)
through `kernels.one_seq_attention`, for the GPU backends: one launch, no
plan (the kernel reads the sequence's row and length on the device)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from rollout_engine.attention.base import AttentionShape
from rollout_engine.kernels._triton import triton_available

if TYPE_CHECKING:
    from rollout_engine.forward_batch import ForwardBatch
    from rollout_engine.layers.attention import PagedAttention

ONE_SEQ = "one sequence"  # a step's attn_metadata when it takes the kernel
# The longest sequence the FlashInfer backend gives the kernel: FlashInfer's
# kernels were faster at 8,000 and 16,000 tokens on an H200 (BENCHMARKS.md,
# "Attention at batch 1"); a longer sequence alone replays the two-row graph.
# The Triton backend has no limit: its batch kernel runs one program per KV head.
MAX_CONTEXT = 2048


def one_seq_shape(shape: AttentionShape) -> bool:
    """Whether this attention shape can take the kernel (`one_seq_attention.supported`)."""
    d = shape.head_dim
    return (shape.device.type == "cuda" and triton_available() and shape.dtype in (torch.bfloat16, torch.float16)
            and 16 <= d <= 256 and d & (d - 1) == 0 and shape.num_heads % shape.num_kv_heads == 0)


def takes_one_seq(enabled: bool, fb: "ForwardBatch", max_context: int | None = None) -> bool:
    """A decode step of one sequence (of at most `max_context` tokens), on a
    backend whose shape takes the kernel (`enabled`). A graph's captured
    batch has one token a sequence."""
    return (enabled and fb.is_decode and fb.batch_size == 1
            and (max_context is None or int(fb.seq_lens[0]) <= max_context))


def graph_rows(enabled: bool, bs: int, seq_lens: np.ndarray, max_context: int | None) -> int:
    """`AttentionBackend.graph_rows`: a sequence alone and longer than
    `max_context` replays the two-row graph, whose attention is the batch kernels'."""
    return 2 if enabled and bs == 1 and max_context is not None and int(seq_lens[0]) > max_context else bs


def one_seq(q: torch.Tensor, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
    """The layer's attention for a step that takes the kernel: q [1, heads, d]."""
    from rollout_engine.kernels.batch_gemm import current_counters
    from rollout_engine.kernels.one_seq_attention import one_seq_attention

    pool = fb.kv_pool
    k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
    counters = current_counters()  # the runner's, launches in stream order
    if counters is None:  # outside a model runner: zeros of the launch's own
        counters = torch.zeros(k_cache.shape[1], dtype=torch.int32, device=q.device)
    return one_seq_attention(q, k_cache, v_cache, fb.table.tensor, fb.rows_device, fb.positions, layer.scaling,
                             counters)
