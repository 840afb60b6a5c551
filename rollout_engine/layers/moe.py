"""The sparse MLP of an MoE model: a router (top-k of a softmax over the
experts) and the experts, all of them on every rank, each rank holding a
slice of every expert's intermediate dimension (so a layer ends in one
all-reduce, like the dense MLP). Qwen2-MoE's shared expert, scaled by
sigmoid(its gate), is added before that reduction.

Expert weights are stored fused, as transformers 5 keeps them in memory:
`experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
`experts.down_proj` [E, H, I]. A checkpoint's per-expert tensors
(`experts.3.gate_proj.weight`, Mixtral's `w1`/`w3`/`w2`) are copied into
their expert's rows (weights/loader.py maps the names). With
quantization="fp8" they are held in e4m3 with one fp32 multiplier per weight
row (`gate_up_proj_scale` [E, 2I, 1], `down_proj_scale` [E, H, 1]; a down
row's taken over the whole row at any tp_size), and the experts' products
take the activations in the engine dtype (kernels/moe.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rollout_engine.distributed.comm import TPComm
from rollout_engine.kernels.gemv import NORM_MAX_K, linear, one_row
from rollout_engine.kernels.moe import fused_moe
from rollout_engine.kernels.moe_route import route
from rollout_engine.kernels.moe_row import moe_row
from rollout_engine.layers.invariant import invariant_linear, per_row
from rollout_engine.layers.linear import (FP8_LINEARS, MergedColumnParallelLinear, RowParallelLinear, divide,
                                          scale_param, weight_param)
from rollout_engine.layers.weight_copy import copy_into, quantize_into
from rollout_engine.models.config import MoeConfig

if TYPE_CHECKING:
    from rollout_engine.forward_batch import ForwardBatch

GATE, UP, DOWN = 0, 1, 2  # the part of a per-expert tensor (shard id (expert, part))


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (the router, the shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    batch_invariant = False  # layers/invariant.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight) if self.batch_invariant else linear(x, self.weight)


class MoeExperts(nn.Module):
    """Every expert's gate/up and down projections, this rank's slice of
    their intermediate dimension."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, comm: TPComm):
        super().__init__()
        self.comm = comm
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.width = divide(intermediate, comm.tp_size)
        self.gate_up_proj = weight_param((num_experts, 2 * self.width, hidden), self._load_gate_up)
        self.down_proj = weight_param((num_experts, hidden, self.width), self._load_down)
        self.gate_up_proj_scale = self.down_proj_scale = None  # fp8: [E, rows, 1] fp32, one a weight row
        if FP8_LINEARS.get():
            self.gate_up_proj_scale = scale_param((num_experts, 2 * self.width))
            self.down_proj_scale = scale_param((num_experts, hidden))

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8: (gate_up_proj's, down_proj's) multipliers, one per weight row; else None."""
        return None if self.down_proj_scale is None else (self.gate_up_proj_scale, self.down_proj_scale)

    def _store(self, param: torch.Tensor, at, src: torch.Tensor, whole_rows: torch.Tensor | None = None) -> None:
        """Write `at(param)` (a view of it: an expert, a part) from `src`; an
        fp8 weight quantizes it into `at` of its scales, each row's scale
        taken over `whole_rows` (the full rows `src` is a column slice of:
        down_proj's at tp_size > 1) or `src`."""
        scale = self.gate_up_proj_scale if param is self.gate_up_proj else self.down_proj_scale
        if scale is None:
            copy_into(at(param.data), src)
        else:
            quantize_into(at(param.data), at(scale.data), src, whole_rows)

    def _check_shape(self, full: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
        if tuple(full.shape) != shape:
            raise ValueError(f"shape mismatch: expected {layout} = {list(shape)}, got {list(full.shape)}")

    def _load_gate_up(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        w, rank, i = self.width, self.comm.tp_rank, self.intermediate
        if shard_id is not None:  # one expert's gate_proj or up_proj [I, H]
            expert, part = shard_id  # the loader checked the index
            self._check_shape(full, (i, self.hidden), "[intermediate, hidden]")
            self._store(param, lambda t: t[expert].narrow(0, part * w, w), full.narrow(0, rank * w, w))
            return
        self._check_shape(full, (self.num_experts, 2 * i, self.hidden), "[experts, 2 * intermediate, hidden]")
        if self.comm.tp_size == 1:
            self._store(param, lambda t: t, full)
            return
        self._store(param, lambda t: t[:, :w], full[:, rank * w: (rank + 1) * w])
        self._store(param, lambda t: t[:, w:], full[:, i + rank * w: i + (rank + 1) * w])

    def _load_down(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        w, rank = self.width, self.comm.tp_rank
        if shard_id is not None:  # one expert's down_proj [H, I]
            expert = shard_id[0]
            self._check_shape(full, (self.hidden, self.intermediate), "[hidden, intermediate]")
            self._store(param, lambda t: t[expert], full.narrow(1, rank * w, w), full)
            return
        self._check_shape(full, (self.num_experts, self.hidden, self.intermediate), "[experts, hidden, intermediate]")
        self._store(param, lambda t: t, full.narrow(2, rank * w, w), full)


class SparseMoeBlock(nn.Module):
    """`moe_index`: this block's place among the model's MoE layers (its
    column of the routing-capture buffer, KVPool.routes)."""

    def __init__(self, hidden: int, moe: MoeConfig, comm: TPComm, moe_index: int = 0):
        super().__init__()
        self.comm = comm
        self.moe_index = moe_index
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = ReplicatedLinear(hidden, moe.num_experts)
        self.gate.weight.weight_loader = self._load_router  # type: ignore[attr-defined]
        self.experts = MoeExperts(moe.num_experts, hidden, moe.intermediate_size, comm)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden, moe.shared_expert_intermediate_size, comm)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1)

    def _load_router(self, param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"the router has one row per expert: expected [num_experts={param.shape[0]}, "
                             f"hidden={param.shape[1]}], got {list(full.shape)}")
        copy_into(param.data, full)

    batch_invariant = False  # layers/invariant.py: a token's expert outputs do not depend on the others

    def forward(self, x: torch.Tensor, fb: "ForwardBatch | None" = None, reduce: bool = True) -> torch.Tensor:
        """With `fb` whose pool captures routing, each token's experts also go
        to its KV slot's row (in the routing launch). `reduce=False`: this
        rank's partial sum (as `DecoderMLP`'s)."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, self._record(fb))
        e = self.experts
        out = fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids, invariant=self.batch_invariant, scales=e.scales)
        if self.shared_expert is not None:  # partial sums too: one reduction for both
            gate = self.shared_expert_gate(x)
            # On the CPU an element-wise function rounds a value differently in a vector lane and in the
            # scalar tail, and a [T, 1] column puts a token in either depending on T: one row at a time.
            gate = per_row(torch.sigmoid, gate) if self.batch_invariant and not gate.is_cuda else torch.sigmoid(gate)
            out = out + gate * self.shared_expert(x)
        return self.comm.all_reduce(out) if reduce else out


    def fuses_one_row(self, h: torch.Tensor, norm: nn.Module) -> bool:
        """Whether `one_row` takes this token (`kernels.moe_row`): one row on
        the GPU, no shared expert, not in batch-invariant mode."""
        return (h.shape[0] == 1 and one_row(h, self.gate.weight) and h.shape[1] <= NORM_MAX_K
                and self.shared_expert is None and not self.batch_invariant and not self.gate.batch_invariant
                and not norm.batch_invariant)

    def one_row(self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                fb: "ForwardBatch | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token after the attention (`fuses_one_row`): norm(h +
        residual), the router, the routing and the experts in three launches,
        then the all-reduce. Returns (this block's output, the new residual
        stream)."""
        out, residual = self.one_row_local(h, residual, norm, fb)
        return self.comm.all_reduce(out), residual

    def one_row_local(self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                      fb: "ForwardBatch | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`one_row` before its all-reduce (this rank's partial sum); with
        `fb` whose pool captures routing, the token's experts also go to its
        KV slot's row."""
        e = self.experts
        return moe_row(h, residual.contiguous(), norm.weight, norm.eps, self.gate.weight, e.gate_up_proj,
                       e.down_proj, self.top_k, self.renormalize, self._record(fb), scales=e.scales)

    def _record(self, fb: "ForwardBatch | None"):
        """Where routing capture puts this block's ids (its column of the
        pool's record, each token's KV slot), or None without capture."""
        routes = fb.kv_pool.routes if fb is not None else None
        return (routes[:, self.moe_index], fb.out_cache_loc) if routes is not None else None


class SharedExpert(nn.Module):
    """A dense SiLU-gated MLP whose down projection is not reduced (the
    block reduces it with the experts' output)."""

    def __init__(self, hidden: int, intermediate: int, comm: TPComm):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, comm)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.product(self.gate_up_proj.gated(x))
