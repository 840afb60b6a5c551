"""Rollout routing replay: the trainer's forward sends every token to the
experts the engine chose for it.

    from rollout_engine.integrations.routing_replay import replay
    with replay(hf_moe_model, [out.routed_experts for out in outs]):   # one array per right-padded row
        logits = hf_moe_model(input_ids).logits
        loss.backward()

Left-padded rows (a trainer that pads prompts on the left) pass their
`attention_mask`: row i's array then starts at the row's first real token.

An MoE router is a discontinuous function of its input: the few ulps between
the engine's kernels and the trainer's, or one optimizer step of drift, flip
a token's top-k and swap whole experts. The trainer's logprob of a sampled
token then describes a different network from the one that sampled it, and
the importance ratios of an RL loss blow up on exactly those tokens. Replay
removes the discrete part of the mismatch: inside the context every sparse
MoE layer of a Hugging Face model (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
takes the engine's expert ids for token (i, s) with s < len(routed_experts[i])
(counted from the row's first real token when an `attention_mask` is given).
The gate weights stay the trainer's own: its router logits, softmax over all
experts in fp32, the probabilities of the forced experts, renormalised where
the router renormalises, cast as it casts, so gradients reach the router.
Positions past a row's array (the last token, which never went through the
engine, and right padding) route freely.

Each router's `forward` is wrapped (an instance attribute, removed on exit
even when the body raises) and each MoE block gets a pre-hook that tells the
wrapper the [batch, seq] shape its router sees flattened. Any number of
forwards may run inside the context; with gradient checkpointing, run the
backward inside it too, since recomputation goes through the routers again.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

# Hugging Face architecture -> (modeling module, its sparse MoE block). Every
# block calls its router as `self.gate(hidden [B*S, H])`, which returns
# (router_logits, scores [B*S, k], expert indices [B*S, k]). Dense layers of
# Qwen models (mlp_only_layers, decoder_sparse_step) have no such block, so
# the blocks in module order are exactly the engine's moe_layers.
SUPPORTED = {
    "Qwen3MoeForCausalLM": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "Qwen2MoeForCausalLM": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "MixtralForCausalLM": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "OlmoeForCausalLM": ("transformers.models.olmoe.modeling_olmoe", "OlmoeSparseMoeBlock"),
}
_BLOCKS = set(SUPPORTED.values())
_CLASS_FORWARD = object()  # marks a router whose forward was the class's own


@contextlib.contextmanager
def replay(model: nn.Module, routed_experts: Sequence[np.ndarray],
           attention_mask: torch.Tensor | np.ndarray | None = None) -> Iterator[None]:
    """Route row i of every forward inside the context to `routed_experts[i]`
    ([n_i, moe_layers, top_k] integer expert ids for positions 0..n_i-1, or
    with `attention_mask` [batch, seq] for the n_i positions from the row's
    first real token: left padding). The model may be wrapped (FSDP,
    torch.compile's `_orig_mod`). Raises ValueError, before patching
    anything, for an unsupported model, a bad array or mask, and at forward
    time for a batch of another size or rows shorter than some n_i."""
    blocks = moe_blocks(model)
    router = blocks[0].gate
    rows = _stack(routed_experts, len(blocks), router.top_k, router.num_experts)
    plan = _Plan(rows, *_starts(attention_mask, rows))
    saved: list[tuple[nn.Module, Any]] = []
    hooks = []
    try:
        for layer, block in enumerate(blocks):
            hooks.append(block.register_forward_pre_hook(plan.see_shape, with_kwargs=True))
            saved.append((block.gate, block.gate.__dict__.get("forward", _CLASS_FORWARD)))
            block.gate.forward = _replaying_forward(block.gate, layer, plan)
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for gate, forward in saved:
            if forward is _CLASS_FORWARD:
                del gate.forward
            else:
                gate.forward = forward


@contextlib.contextmanager
def agreement(model: nn.Module, routed_experts: Sequence[np.ndarray], out: list[float],
              attention_mask: torch.Tensor | np.ndarray | None = None) -> Iterator[None]:
    """Measure instead of replay: appends to `out` the share of (token, MoE
    layer) where the model's own top-k, in the forward run inside (over a
    right-padded batch, one row per array, or a left-padded one with its
    `attention_mask`), equals the given experts, over the positions the
    arrays cover. 1.0 means replay would change nothing. The arrays and the
    mask are checked as `replay` checks them (ValueError naming the row,
    before the forward; a batch of another size or rows shorter than an
    array, at forward time)."""
    blocks = moe_blocks(model)
    router = blocks[0].gate
    rows = _stack(routed_experts, len(blocks), router.top_k, router.num_experts)
    plan = _Plan(rows, *_starts(attention_mask, rows))
    seen: list[tuple[int, torch.Tensor]] = []  # (MoE layer, its top-k) per router call

    def record(layer: int):
        def hook(module, args, output) -> None:
            plan.layer(layer, output[2].device)  # the batch's shape against the arrays
            seen.append((layer, output[2].detach()))
        return hook

    hooks = []
    try:
        for layer, block in enumerate(blocks):
            hooks.append(block.register_forward_pre_hook(plan.see_shape, with_kwargs=True))
            hooks.append(block.gate.register_forward_hook(record(layer)))
        yield
    finally:
        for hook in hooks:
            hook.remove()
    same = total = 0
    for layer, picked in seen:
        picked = picked.view(len(rows), -1, picked.shape[-1]).sort(-1).values.cpu()
        for row, (r, start) in enumerate(zip(rows, plan.starts)):
            engine = torch.from_numpy(r[:, layer]).sort(-1).values
            same += int((picked[row, start: start + len(r)] == engine).all(-1).sum())
            total += len(r)
    out.append(same / max(1, total))


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's sparse MoE blocks in order of depth; ValueError naming the
    architecture when it is not one replay supports."""
    # Matched by name along the MRO: FSDP2 subclasses the modules it shards,
    # and nothing needs importing the modeling files the model doesn't use.
    blocks = [m for m in model.modules()
              if any((c.__module__, c.__name__) in _BLOCKS for c in type(m).__mro__)]
    if not blocks:
        raise ValueError(f"routing replay does not support {_architecture(model)}: "
                         f"supported architectures are {', '.join(SUPPORTED)}")
    return blocks


def _architecture(model: nn.Module) -> str:
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m.config, "model_type"):
            return type(m).__name__
    return type(model).__name__


def _stack(routed_experts: Sequence[np.ndarray], num_layers: int, top_k: int, num_experts: int
           ) -> list[np.ndarray]:
    """Each row checked and as int64; ValueError naming the row otherwise."""
    shape = getattr(routed_experts, "shape", None)
    if shape is not None and len(shape) in (2, 3) and getattr(routed_experts, "dtype", None) != object:
        # one row's array, not rows (a 4-d stack of equal rows, or a 1-d array of row objects, is rows)
        raise ValueError(f"routed_experts: expected one array per row of the batch, got one array of shape "
                         f"{tuple(shape)}; pass [array] for a batch of one row")
    rows = []
    for i, row in enumerate(routed_experts):
        if row is None:
            raise ValueError(f"routed_experts[{i}] is None: generate with return_routed_experts=True")
        row = np.asarray(row)
        if row.ndim != 3 or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"routed_experts[{i}]: expected integer expert ids [tokens, moe_layers, top_k], "
                             f"got shape {row.shape} of {row.dtype}")
        if row.shape[1] != num_layers:
            raise ValueError(f"routed_experts[{i}]: moe_layers is {row.shape[1]}, the model has "
                             f"{num_layers} sparse MoE layers")
        if row.shape[2] != top_k:
            raise ValueError(f"routed_experts[{i}]: top_k is {row.shape[2]}, the model's num_experts_per_tok "
                             f"is {top_k}")
        row = row.astype(np.int64)
        bad = np.argwhere((row < 0) | (row >= num_experts))
        if len(bad):
            pos, layer, j = bad[0]
            raise ValueError(f"routed_experts[{i}]: expert id {row[pos, layer, j]} at position {pos}, "
                             f"moe layer {layer} is out of range [0, {num_experts})")
        ordered = np.sort(row, axis=-1)
        twice = np.argwhere((ordered[..., 1:] == ordered[..., :-1]).any(-1))
        if len(twice):
            pos, layer = twice[0]
            raise ValueError(f"routed_experts[{i}]: position {pos}, moe layer {layer} names an expert twice: "
                             f"{row[pos, layer].tolist()}")
        rows.append(row)
    if not rows:
        raise ValueError("routed_experts is empty: one array per row of the batch")
    return rows


def _starts(attention_mask: torch.Tensor | np.ndarray | None, rows: list[np.ndarray]
            ) -> tuple[list[int], int | None]:
    """Where each row's array starts in the batch (0 without a mask, else the
    row's first real token) and the mask's width (None without one);
    ValueError naming the row for a mask of another batch size, one whose
    real tokens are not in one run (packed rows), or fewer real tokens than
    the row's array covers."""
    if attention_mask is None:
        return [0] * len(rows), None
    mask = np.asarray(attention_mask.detach().cpu() if isinstance(attention_mask, torch.Tensor) else attention_mask)
    if mask.ndim != 2 or mask.shape[0] != len(rows):
        raise ValueError(f"attention_mask: expected [batch, seq] with one row per array ({len(rows)}), "
                         f"got shape {mask.shape}")
    if mask.dtype.kind not in "biuf" or not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask: expected 1 for real tokens and 0 for padding, got "
                         f"{np.unique(mask)[:5].tolist() if mask.dtype.kind in 'biuf' else mask.dtype}")
    starts = []
    for i, (real, row) in enumerate(zip(mask != 0, rows)):
        where = np.flatnonzero(real)
        start = int(where[0]) if len(where) else 0
        if len(where) and where[-1] - start + 1 != len(where):
            raise ValueError(f"attention_mask[{i}]: its real tokens are not one run (packed rows are not supported)")
        if len(row) > len(where):
            raise ValueError(f"routed_experts[{i}] covers {len(row)} positions, attention_mask[{i}] has "
                             f"{len(where)} real tokens")
        starts.append(start)
    return starts, mask.shape[1]


class _Plan:
    """The forced experts of the whole batch, [rows, max n_i, moe_layers, k]
    (zeros past each n_i, never used), where each row's start in the batch
    (`starts`: left padding), and the shape of the block input the next
    router call flattens."""

    def __init__(self, rows: list[np.ndarray], starts: list[int], mask_width: int | None = None):
        self.lengths = [len(r) for r in rows]
        self.starts = starts
        self.mask_width = mask_width
        padded = np.zeros((len(rows), max(self.lengths), *rows[0].shape[1:]), np.int64)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row
        self.experts = torch.from_numpy(padded)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.shape: tuple[int, int] | None = None  # set by each block's pre-hook, just before its router runs

    def see_shape(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.shape = tuple(hidden.shape[:2])

    def layer(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(replayed [B*S] bool, expert ids [B*S, k]) for one MoE layer of the
        current forward."""
        batch, seq_len = self.shape
        if batch != len(self.lengths):
            raise ValueError(f"the batch has {batch} rows but routed_experts has {len(self.lengths)} arrays")
        if self.mask_width is not None and self.mask_width != seq_len:
            raise ValueError(f"attention_mask has {self.mask_width} columns but the input has {seq_len}: "
                             f"the mask of this batch")
        too_long = [i for i, n in enumerate(self.lengths) if self.starts[i] + n > seq_len]
        if too_long:
            i = too_long[0]
            raise ValueError(f"routed_experts[{i}] covers {self.lengths[i]} positions, the input has only "
                             f"{seq_len - self.starts[i]}" + (" from its first real token" if self.starts[i] else ""))
        if device not in self._on_device:
            self._on_device[device] = (self.experts.to(device), torch.tensor(self.lengths, device=device),
                                       torch.tensor(self.starts, device=device))
        experts, lengths, starts = self._on_device[device]
        experts = experts[:, :, layer]  # [batch, max n_i, k]
        index = torch.arange(seq_len, device=device)[None, :] - starts[:, None]  # into each row's array
        replayed = (index >= 0) & (index < lengths[:, None])
        index = index.clamp(0, experts.shape[1] - 1)[..., None].expand(-1, -1, experts.shape[2])
        experts = experts.gather(1, index)
        return replayed.reshape(-1), experts.reshape(batch * seq_len, -1)


def _replaying_forward(router: nn.Module, layer: int, plan: _Plan) -> Callable:
    original = router.forward
    # Mixtral's router has no flag: its softmax over the top-k logits is the
    # renormalised top-k of the full softmax. Qwen and OLMoe follow norm_topk_prob.
    renormalise = getattr(router, "norm_topk_prob", True)

    def forward(*args, **kwargs):
        logits, scores, indices = original(*args, **kwargs)
        replayed, experts = plan.layer(layer, logits.device)
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
        if renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # The router's own cast: Qwen and OLMoe return scores in the logits'
        # dtype, Mixtral leaves them in fp32.
        weights = weights.to(scores.dtype)
        replayed = replayed[:, None]
        return logits, torch.where(replayed, weights, scores), torch.where(replayed, experts, indices)

    return forward
