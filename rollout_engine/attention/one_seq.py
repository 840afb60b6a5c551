"""Decode steps of one sequence (the end of every rollout, batch-1 decode)
through `kernels.one_seq_attention`, for the GPU backends: one launch, no
plan (the kernel reads the sequence's row and length on the device)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout_engine.attention.base import AttentionShape
from rollout_engine.kernels._triton import triton_available
from rollout_engine.kernels.one_seq_attention import takes_heads

if TYPE_CHECKING:
    from rollout_engine.forward_batch import ForwardBatch
    from rollout_engine.kernels.one_seq_attention import NewEntry
    from rollout_engine.layers.attention import PagedAttention

ONE_SEQ = "one sequence"  # a step's attn_metadata when it takes the kernel
# Sequences of every length take it. On an H200 FlashInfer's own kernels were
# faster from some thousands of tokens on (decode llama-3.1-8b batch 1 at
# 8,000 tokens: 4.27 ms a step against 4.46 with 16 programs a KV head; at
# 1,000: 3.99 against 3.90-3.93); a second batch-1 graph with FlashInfer's
# kernels for long sequences is the way to keep both (BENCHMARKS.md,
# "Attention at batch 1"). A two-row graph is not: its products take the
# small-batch path (12.7% slower at 8,000 tokens).


def one_seq_shape(shape: AttentionShape) -> bool:
    """Whether this attention shape can take the kernel: on a CUDA device
    with Triton, heads that `one_seq_attention.takes_heads`."""
    return (shape.device.type == "cuda" and triton_available()
            and takes_heads(shape.dtype, shape.num_heads, shape.num_kv_heads, shape.head_dim))


# With per-head q/k norms (Qwen3, Qwen3-MoE) the rotation and K/V store cannot go into the qkv product (the norms
# need whole heads); with this on, in a one-sequence step the attention launch does them (`NewEntry`): one launch
# fewer a layer. On an H100, decode batch 1: qwen3-30b-a3b 3.29 ms a step against 3.37 (-2.4%), qwen3-0.6b 0.933
# against 0.980 (-4.8%), alternated (BENCHMARKS.md). Read as each step runs: a batch-1 CUDA graph keeps the way it
# was captured with (set it before building the engine).
ROTATE_IN_ONE_SEQ = True


def rotates_in_one_seq(fb: "ForwardBatch") -> bool:
    """Whether this step's attention launch may rotate q and store the new
    K/V itself (`ROTATE_IN_ONE_SEQ`): a step that takes the kernel, no padding."""
    return ROTATE_IN_ONE_SEQ and fb.attn_metadata is ONE_SEQ and not fb.pad


def takes_one_seq(enabled: bool, fb: "ForwardBatch") -> bool:
    """A decode step of one sequence, on a backend whose shape takes the kernel (`enabled`)."""
    return enabled and fb.is_decode and fb.batch_size == 1


def one_seq(q: torch.Tensor, layer: "PagedAttention", fb: "ForwardBatch",
            new: "NewEntry | None" = None) -> torch.Tensor:
    """The layer's attention for a step that takes the kernel: q [1, heads,
    d] (`new`: not yet rotated, the new K/V not yet stored)."""
    from rollout_engine.kernels.batch_gemm import current_counters
    from rollout_engine.kernels.one_seq_attention import one_seq_attention

    pool = fb.kv_pool
    k_cache, v_cache = pool.k[layer.layer_id], pool.v[layer.layer_id]
    counters = current_counters()  # the runner's, launches in stream order
    if counters is None:  # outside a model runner: zeros of the launch's own
        counters = torch.zeros(k_cache.shape[1], dtype=torch.int32, device=q.device)
    return one_seq_attention(q, k_cache, v_cache, fb.table.tensor, fb.rows_device, fb.positions, layer.scaling,
                             counters, new)
