"""Attention backends behind one small interface, picked by name through a
registry with lazy imports (a backend's dependencies load only when used).

Contract: `init_forward_metadata` is called once per step, before the model
runs (plan once for all layers). The layer has stored the step's new K/V in
the pool at `fb.out_cache_loc` (fused with RoPE on the GPU); `forward` then
attends each sequence's new queries causally over its whole context: the
slots table[rows[i], :seq_lens[i]].
Backends with `needs_device_table` read those from the device copy of the
runner's table (`fb.table.tensor`), the others from its host copy
(`fb.table.host`); each plan's table writes are applied before the step.
"""
from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import torch

if TYPE_CHECKING:
    from rollout_engine.layers.attention import PagedAttention
    from rollout_engine.forward_batch import ForwardBatch

BACKENDS: dict[str, str] = {
    "torch": "rollout_engine.attention.torch_backend:TorchAttentionBackend",
    "flashinfer": "rollout_engine.attention.flashinfer_backend:FlashInferAttentionBackend",
    "triton": "rollout_engine.attention.triton_backend:TritonAttentionBackend",
}


FLASHINFER_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int  # query heads on this rank
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype  # the queries'
    device: torch.device
    kv_dtype: torch.dtype | None = None  # the KV cache's, when not `dtype` (an e4m3 cache)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


class AttentionBackend(ABC):
    needs_device_table = False
    supports_cuda_graph = False
    # Whether decode steps read a prefix that sequences share once (the
    # plans then carry `StepPlan.share_keys`).
    reads_shared_prefixes = False

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        pass

    # ---- captured decode steps (backends with supports_cuda_graph) ------------
    def init_graph_buffers(self, max_bs: int, max_context: int) -> None:
        """Allocate the static buffers that captured decode steps read."""
        raise NotImplementedError

    def graph_metadata(self, bs: int, fb: "ForwardBatch") -> Any:
        """Metadata for capturing a decode step of `bs` sequences (each with
        one token of context); becomes `fb.attn_metadata` in the graph."""
        raise NotImplementedError

    def prepare_replay(self, bs: int, bucket: int, seq_lens: np.ndarray, rows: np.ndarray,
                       fb: "ForwardBatch", shares: tuple | None = None) -> None:
        """Before replaying the graph of `bucket` for a batch of `bs` real
        sequences: write their lengths (padding rows: one token in the
        reserved page 0) into the static buffers. `rows`: their request-table
        rows on the host. `fb` is the captured batch, its static rows already
        filled. `shares`: the plan's (share_keys, share_lens), for backends
        that read a shared prefix once (`StepPlan.share_keys`)."""
        raise NotImplementedError

    @abstractmethod
    def forward(self, q: torch.Tensor, layer: "PagedAttention", fb: "ForwardBatch") -> torch.Tensor:
        """q: [T, heads, d], the step's new K/V already in the pool. Returns
        [T, heads, d]."""


def resolve_backend_name(name: str, shape: AttentionShape) -> str:
    """"auto": flashinfer on CUDA in fp16/bf16 when it is installed and
    supports the head size, else torch."""
    half = shape.dtype in (torch.float16, torch.bfloat16)
    if name != "auto":
        if name != "torch" and shape.device.type != "cuda":
            raise ValueError(f"attention_backend {name!r} needs a CUDA device")
        if name != "torch" and not half:
            raise ValueError(f"attention_backend {name!r} needs dtype bfloat16 or float16, got {shape.dtype}")
        if name == "flashinfer" and shape.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"attention_backend 'flashinfer' supports head_dim {FLASHINFER_HEAD_DIMS}, "
                             f"the model has {shape.head_dim}")
        if name == "triton" and shape.head_dim & (shape.head_dim - 1):
            raise ValueError(f"attention_backend 'triton' needs a power-of-two head_dim, the model has "
                             f"{shape.head_dim}")
        return name
    if (shape.device.type == "cuda" and half and shape.head_dim in FLASHINFER_HEAD_DIMS
            and importlib.util.find_spec("flashinfer") is not None):
        return "flashinfer"
    return "torch"


def create_backend(name: str, shape: AttentionShape) -> AttentionBackend:
    name = resolve_backend_name(name, shape)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend {name!r} is not available here; available: {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(shape=shape)
