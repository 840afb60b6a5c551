"""Linear layers that know their tensor-parallel shard.

Every parameter carries a `weight_loader(param, full_weight, shard_id)` that
takes the full (unsharded) Hugging Face tensor, slices this rank's part and
copies it in place. Cold load and hot swap use the same loaders, so a
parameter's storage is allocated once and never rebound.
"""
from __future__ import annotations

import contextvars
from typing import Sequence

import torch
from torch import nn

from rollout_engine.distributed.comm import TPComm
from rollout_engine.kernels.fp8 import FP8
from rollout_engine.kernels import fp8_row
from rollout_engine.kernels._triton import use_kernel
from rollout_engine.kernels.activation import silu_and_mul, silu_and_mul_ref
from rollout_engine.kernels.gemv import RopeStore, gated_linear, linear, norm_gemv, one_row, pairs_fit, row_product
from rollout_engine.layers.fp8_linear import fp8_linear
from rollout_engine.layers.invariant import invariant_linear
from rollout_engine.layers.weight_copy import copy_into, expect_shape, quantize_into


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _param(shape: tuple[int, ...], loader, dtype: torch.dtype | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


# Set while a model is built with quantization="fp8" (quantization.py:
# fp8_linears): the parallel linear layers (and the MoE experts,
# layers/moe.py) allocate e4m3 weights and their scales from the start, so
# the engine-dtype weights never exist.
FP8_LINEARS: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8_linears", default=False)


def weight_param(shape: tuple[int, ...], loader) -> nn.Parameter:
    """A weight in the engine dtype, or in e4m3 while `FP8_LINEARS` is set
    (its multipliers are `scale_param`s beside it, filled by the first load)."""
    return _param(shape, loader, FP8 if FP8_LINEARS.get() else None)


def scale_param(rows: tuple[int, ...]) -> nn.Parameter:
    """An e4m3 weight's multipliers, one a row [*rows, 1], fp32."""
    return nn.Parameter(torch.ones(*rows, 1, dtype=torch.float32), requires_grad=False)


class _Linear(nn.Module):
    """What the parallel linear layers share: the product with this rank's
    weight, in the engine dtype or fp8 (`FP8_LINEARS`), and the rows of a
    parameter written from a source."""

    batch_invariant = False  # layers/invariant.py

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight_scale", None)  # fp8: one multiplier per output row [out, 1], fp32

    def _weight(self, shape: tuple[int, int]) -> nn.Parameter:
        """The weight parameter, in the engine dtype, or in e4m3 with its
        scales (filled by the first load)."""
        if FP8_LINEARS.get():
            self.weight_scale = scale_param(shape[:1])
        return weight_param(shape, self._load)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) with this rank's W, no reduction."""
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        if self.batch_invariant:
            return invariant_linear(x, self.weight, bias)
        return linear(x, self.weight, bias)

    # One row (batch-1 decode): the RMSNorm before the product, and the rotary embedding and K/V store or
    # SiLU * mul after it, inside the product's one launch (kernels.gemv; fp8: kernels.fp8_row).

    def fuses_one_row(self, x: torch.Tensor) -> bool:
        """Whether x takes `norm_product` (one row on the GPU)."""
        if self.weight_scale is not None:
            return fp8_row.fp8_one_row(x, self.weight)
        return one_row(x, self.weight)

    def rows_pair(self, segment: int) -> bool:
        """Whether `norm_product` can finish segments of `segment` rows in
        pairs (`kernels.gemv.pairs_fit`): `rope` for heads, `gated` for the
        whole gate_up weight."""
        fits = fp8_row.pairs_fit if self.weight_scale is not None else pairs_fit
        return fits(*self.weight.shape, segment)

    def norm_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module | None,
                     bias: torch.Tensor | None = None, rope: RopeStore | None = None,
                     gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x + residual) W^T (+ bias) for one row in one launch, with
        `rope` or `gated` finishing the rows (`kernels.gemv.norm_gemv`).
        Returns (product, new residual stream). With `norm` None, x is
        normalised already (`TPComm.all_reduce_norm`) and `residual` is None."""
        if self.weight_scale is not None:
            return fp8_row.fp8_row(x, self.weight, self.weight_scale, bias, residual=residual, gated=gated, rope=rope,
                                   norm=None if norm is None else (norm.weight, norm.eps))
        if norm is None:
            return row_product(x, self.weight, bias, rope=rope, gated=gated), x
        return norm_gemv(x, residual, norm.weight, norm.eps, self.weight, bias, rope=rope, gated=gated)

    def _store(self, param: torch.Tensor, offset: int, size: int, src: torch.Tensor,
               whole_rows: torch.Tensor | None = None) -> None:
        """Write rows [offset, offset + size) of `param` from `src`; an fp8
        weight quantizes them, each row's scale taken over `whole_rows` (the
        full rows `src` is a column slice of) or `src`."""
        rows = param.data.narrow(0, offset, size)
        if param is self.weight and self.weight_scale is not None:
            quantize_into(rows, self.weight_scale.data.narrow(0, offset, size), src, whole_rows)
        else:
            copy_into(rows, src)


class ColumnParallelLinear(_Linear):
    """y = x W^T with W split by output rows: each rank holds out/tp rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: TPComm):
        super().__init__()
        self.comm = comm
        self.out_per_rank = divide(out_features, comm.tp_size)
        self.weight = self._weight((self.out_per_rank, in_features))
        self.bias = _param((self.out_per_rank,), self._load) if bias else None

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        rows = self.out_per_rank
        expect_shape(full, (rows * self.comm.tp_size, *param.shape[1:]))
        self._store(param, 0, rows, full.narrow(0, self.comm.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one
    matmul (gate+up). `shard_id` is the index of the piece in `out_sizes`."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool, comm: TPComm):
        self.out_sizes = [divide(s, comm.tp_size) for s in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, comm)

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of this projection's product (a gate_up pair): in
        the product's launch where it takes the small-batch kernel
        (`kernels.gemv.gated_linear`), else the product, then the activation."""
        if self.weight_scale is None and not self.batch_invariant and self.bias is None:
            act = gated_linear(x, self.weight)
            if act is not None:
                return act
        gate_up = self.product(x, self.bias)
        return silu_and_mul(gate_up) if use_kernel(gate_up) else silu_and_mul_ref(gate_up)

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("a fused projection needs the shard it is loading")
        size = self.out_sizes[shard_id]
        expect_shape(full, (size * self.comm.tp_size, *param.shape[1:]))
        self._store(param, sum(self.out_sizes[:shard_id]), size, full.narrow(0, self.comm.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. Query heads are split over ranks; KV heads
    too, or replicated when there are fewer KV heads than ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, comm: TPComm):
        tp = comm.tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp)
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp)
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp, num_kv_heads)
        # This rank's widths of q and of k (and v) in the fused output.
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden, (self.q_size + 2 * self.kv_size) * tp, bias, comm)

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        rank = self.comm.tp_rank
        if shard_id == "q":
            offset, size, src_index, slices = 0, self.q_size, rank, self.comm.tp_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, src_index = self.kv_size, rank // self.kv_replicas
            slices = self.comm.tp_size // self.kv_replicas
        else:
            raise ValueError(f"qkv shard must be 'q', 'k' or 'v', got {shard_id!r}")
        expect_shape(full, (size * slices, *param.shape[1:]))
        self._store(param, offset, size, full.narrow(0, src_index * size, size))


class RowParallelLinear(_Linear):
    """y = x W^T with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: TPComm):
        super().__init__()
        self.comm = comm
        self.in_per_rank = divide(in_features, comm.tp_size)
        self.weight = self._weight((out_features, self.in_per_rank))
        # The bias is added once, after the reduction.
        self.bias = _param((out_features,), self._load_bias) if bias else None

    def _load(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        cols = self.in_per_rank
        expect_shape(full, (param.shape[0], cols * self.comm.tp_size))
        # fp8: each row's scale over the whole row, so every rank's slice quantizes as at tp_size 1
        self._store(param, 0, param.shape[0], full.narrow(1, self.comm.tp_rank * cols, cols), whole_rows=full)

    def _load_bias(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        copy_into(param.data, full)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`reduce=False`: this rank's partial sum, left to the norm after it
        (`TPComm.all_reduce_norm`; no bias then)."""
        if not reduce:
            assert self.bias is None, "a bias is added after the reduction"
            return self.product(x)
        y = self.comm.all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias
