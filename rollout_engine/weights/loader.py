"""Hugging Face checkpoint names -> our (fused, sharded) parameters.

One path for a cold load and for a hot swap: every tensor goes through the
parameter's own `weight_loader`, which copies in place. Parameters are never
rebound, so addresses held by CUDA graphs and attention plans stay valid.
"""
from __future__ import annotations

import contextlib
import difflib
import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from rollout_engine.kernels.fp8 import FP8, dequantize_channels
from rollout_engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)
from rollout_engine.layers.moe import DOWN, GATE, UP, MoeExperts
from rollout_engine.layers.weight_copy import FINITE_CHECK, VALIDATE_ONLY, FiniteCheck, copy_into, expect_shape
from rollout_engine.weights.fp8_checkpoint import dequantized

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A checkpoint's per-expert tensor: Qwen/OLMoE names and Mixtral's w1 (gate), w3 (up), w2 (down).
PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)"
                        r"\.weight$")
LOOSE_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>-?\d+)\.")  # a per-expert name, misspelt or not
EXPERT_PARTS = {"gate_proj": GATE, "w1": GATE, "up_proj": UP, "w3": UP, "down_proj": DOWN, "w2": DOWN}
LAYER = re.compile(r"^(?P<prefix>.*\blayers\.(?P<index>\d+))\.")
RENAMED = ((".block_sparse_moe.", ".mlp."),)  # Mixtral checkpoints' MoE block -> transformers 5's in-memory name


class ShardLayout(NamedTuple):
    """How tensor-parallel ranks hold one Hugging Face tensor."""
    dim: int | None  # the dimension it is split along; None when every rank holds all of it
    replicas: int = 1  # consecutive ranks holding the same slice
    trim: int | None = None  # the full size to trim the joined dimension to
    pieces: int = 1  # each rank's slice is this many equal pieces along `dim`, joined piece by piece


def pairs(named_tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) items, a ValueError naming the first that is not one."""
    for i, item in enumerate(named_tensors):
        if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"update item {i} must be a (name, tensor) pair, got {type(item).__name__}"
                             f"{'' if not isinstance(item, (tuple, list)) else f' of length {len(item)}'}")
        yield item[0], item[1]


def default_loader(param: torch.Tensor, full: torch.Tensor, shard_id=None) -> None:
    """For replicated parameters (norms): the full tensor, copied in place."""
    copy_into(param.data, full)


@dataclass(frozen=True)
class Target:
    param_name: str
    shard_id: object  # None for an unfused parameter


class WeightLoader:
    def __init__(self, model: nn.Module):
        self.model = model
        # an fp8 weight X's scales (`X_scale`) are written with it, under its name
        self.params = {n: p for n, p in model.named_parameters() if not n.endswith("_scale")}
        self.stacked = getattr(model, "stacked_params", ())
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.dtype = next(p.dtype for p in self.params.values() if p.dtype != FP8)  # the engine dtype

    def resolve(self, hf_name: str) -> Target | None:
        """Where an HF tensor goes; None for names we deliberately ignore.
        Raises ValueError for a name the model does not have."""
        if hf_name.endswith(IGNORED_SUFFIXES):
            return None
        if self.tied_head(hf_name):
            return None  # the embedding is the head
        given = hf_name  # errors name the tensor as the caller sent it
        for old, new in RENAMED:
            hf_name = hf_name.replace(old, new)
        expert = PER_EXPERT.match(hf_name)
        if expert:
            part = EXPERT_PARTS[expert["part"]]
            name = f"{expert['experts']}.{'down_proj' if part == DOWN else 'gate_up_proj'}"
            if name not in self.params:
                raise ValueError(self.unknown(given, hf_name))
            index = int(expert["expert"])
            if index >= self.model.get_submodule(expert["experts"]).num_experts:
                raise ValueError(self.unknown(given, hf_name))  # it names the index out of range
            return Target(name, (index, part))
        for hf_part, our_part, shard_id in self.stacked:
            token = f".{hf_part}."
            if token in hf_name:
                name = hf_name.replace(token, f".{our_part}.")
                if name in self.params:
                    return Target(name, shard_id)
        if hf_name in self.params:
            return Target(hf_name, None)
        raise ValueError(self.unknown(given, hf_name))

    def unknown(self, given: str, hf_name: str) -> str:
        """The refusal of a name the model does not have, with what is
        nearest: a layer index past the model's layers, an expert tensor at
        a layer whose MLP is dense, or the closest real name."""
        message = f"unknown weight name {given!r}"
        layer = LAYER.match(hf_name)
        layers = int(getattr(self.model.config, "num_layers", 0) or 0)
        if layer and layers and int(layer["index"]) >= layers:
            return f"{message}: layer index {layer['index']} is out of range (num_hidden_layers={layers})"
        if layer and ".mlp.experts." in hf_name and not any(n.startswith(f"{layer['prefix']}.mlp.experts.")
                                                             for n in self.params):
            return f"{message}: layer {layer['index']} has a dense MLP (no experts)"
        expert = LOOSE_EXPERT.match(hf_name)
        if expert and f"{expert['experts']}.gate_up_proj" in self.params:
            count = self.model.get_submodule(expert["experts"]).num_experts
            if not 0 <= int(expert["expert"]) < count:
                return f"{given}: expert index {expert['expert']} is out of range (num_experts={count})"
            names = [f"{expert['experts']}.{expert['expert']}.{part}.weight" for part in EXPERT_PARTS]
        else:
            names = self.full_names()
        close = difflib.get_close_matches(hf_name, names, n=1, cutoff=0.85)
        return f"{message}; did you mean {close[0]!r}?" if close else message

    def units(self, target: Target) -> list[Target]:
        """The (parameter, shard) units `target` writes: an expert tensor in
        the fused layout writes every expert's part; anything else itself."""
        owner = self.model.get_submodule(target.param_name.rsplit(".", 1)[0])
        if not isinstance(owner, MoeExperts) or target.shard_id is not None:
            return [target]
        parts = (DOWN,) if target.param_name.endswith(".down_proj") else (GATE, UP)
        return [Target(target.param_name, (e, p)) for e in range(owner.num_experts) for p in parts]

    def full_names(self) -> list[str]:
        """The HF names that together cover every parameter (experts under
        their fused names, as transformers 5 keeps them in memory)."""
        names = []
        reverse = {our: [] for _, our, _ in self.stacked}
        for hf_part, our_part, _ in self.stacked:
            reverse[our_part].append(hf_part)
        for name in self.params:
            parts = [p for p in reverse if f".{p}." in name]
            if parts:
                names += [name.replace(f".{parts[0]}.", f".{h}.") for h in reverse[parts[0]]]
            else:
                names.append(name)
        return names

    def required(self) -> set[Target]:
        """Every (parameter, shard) a complete set of weights writes."""
        return set(self.hf_names())

    def hf_names(self) -> dict[Target, str]:
        """Every (parameter, shard) -> the Hugging Face name it is written under."""
        out = {}
        for name in self.full_names():
            target = self.resolve(name)
            if target is not None:
                for unit in self.units(target):
                    out.setdefault(unit, name)
        return out

    def tied_head(self, hf_name: str) -> bool:
        """Whether `hf_name` is a tied model's lm_head.weight: the embedding
        is the head, so an update writes it nowhere, but checks it as the
        embedding's (shape, dtype, values), not dropping it unseen."""
        return self.tied and hf_name == "lm_head.weight"

    def _load_one(self, hf_name: str, tensor: torch.Tensor) -> Target | None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{hf_name}: expected a torch.Tensor, got {type(tensor).__name__}")
        head = self.tied_head(hf_name)
        target = None if head else self.resolve(hf_name)
        if target is None and not head:
            return None
        if not tensor.is_floating_point():  # an index or mask tensor sent by mistake would be cast in silently
            raise ValueError(f"{hf_name}: expected a floating-point tensor, got {tensor.dtype}")
        if head:  # nothing copied; its values checked while an update streams (check_finite before a whole one)
            embed = self.model.get_submodule(self.resolve("model.embed_tokens.weight").param_name.rsplit(".", 1)[0])
            try:
                expect_shape(tensor, (embed.vocab_size, embed.weight.shape[1]))
            except ValueError as e:
                raise ValueError(f"{hf_name}: {e} (the model ties it to the embedding)") from None
            check = FINITE_CHECK.get()
            if check is not None and tensor.device.type != "meta":
                check.flag_if_not_finite(tensor, self.dtype)
            return None
        param = self.params[target.param_name]
        if tensor.device.type != "meta":
            tensor = tensor.to(param.device, non_blocking=True)
        try:
            getattr(param, "weight_loader", default_loader)(param, tensor, target.shard_id)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"{hf_name}: {e}") from None
        return target

    def validate(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check names and shapes of a whole update, copying nothing. Tensors
        may be on the meta device (shapes only)."""
        token = VALIDATE_ONLY.set(True)
        try:
            with torch.no_grad():
                for hf_name, tensor in dequantized(pairs(named_tensors)):
                    self._load_one(hf_name, tensor)
        finally:
            VALIDATE_ONLY.reset(token)

    def check_finite(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raise NonFiniteWeights naming the first tensor holding NaN or inf
        (in the parameter's dtype), reading the sources where they are and
        copying nothing: one read-only pass, one host read per device. A
        tensor on the meta device (no values) is a ValueError here."""
        check = FiniteCheck()
        with torch.no_grad():
            for hf_name, tensor in dequantized(pairs(named_tensors)):
                head = self.tied_head(hf_name)  # written nowhere, checked as the embedding
                target = None if head else self.resolve(hf_name)
                if target is None and not head:
                    continue
                if tensor.device.type == "meta":  # before any copy, not part-way through them
                    raise ValueError(f"{hf_name}: a tensor on the meta device holds no values to copy")
                dtype = self.dtype if head else self.params[target.param_name].dtype
                check.check(hf_name, tensor, torch.float32 if dtype == FP8 else dtype)  # fp8: the scales' input
        check.raise_if_bad()

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], written: set[Target] | None = None
             ) -> set[Target]:
        """Copy each tensor into its parameter as it arrives (a generator is
        consumed one tensor at a time), checking finiteness in the same pass.
        Each (parameter, shard) is added to `written` once copied, so a caller
        knows what an update that stops part-way changed. Returns them;
        raises NonFiniteWeights (after copying) if any value was NaN or inf."""
        written = set() if written is None else written
        check = FiniteCheck()
        token = FINITE_CHECK.set(check)
        try:
            with torch.no_grad():
                for hf_name, tensor in dequantized(pairs(named_tensors)):
                    check.start(hf_name)
                    target = self._load_one(hf_name, tensor)
                    if target is not None:
                        written.update(self.units(target))
        finally:
            FINITE_CHECK.reset(token)
        check.raise_if_bad(refused=False)
        return written

    def shard_layout(self, hf_name: str) -> ShardLayout:
        """How tensor-parallel ranks hold `hf_name` (ShardLayout)."""
        if self.tied_head(hf_name):
            hf_name = "model.embed_tokens.weight"
        target = self.resolve(hf_name)
        if target is None:
            raise ValueError(f"{hf_name!r} is not a weight the engine keeps")
        owner = self.model.get_submodule(target.param_name.rsplit(".", 1)[0])
        leaf = target.param_name.rsplit(".", 1)[1]
        if isinstance(owner, QKVParallelLinear):
            return ShardLayout(0, owner.kv_replicas if target.shard_id in ("k", "v") else 1)
        if isinstance(owner, ColumnParallelLinear):
            return ShardLayout(0)
        if isinstance(owner, RowParallelLinear):
            return ShardLayout(1 if leaf == "weight" else None)
        if isinstance(owner, MoeExperts):  # the intermediate dimension is split
            down = leaf == "down_proj"
            if target.shard_id is not None:  # one expert's [I, H] gate or up, or its [H, I] down
                return ShardLayout(1 if down else 0)
            return ShardLayout(2) if down else ShardLayout(1, pieces=2)  # [E, 2I, H]: gate rows, then up rows
        if hasattr(owner, "replicas"):  # a norm over a split vector
            return ShardLayout(0, owner.replicas)
        if hasattr(owner, "vocab_size"):
            return ShardLayout(0, 1, owner.vocab_size)
        return ShardLayout(None)

    def read(self, hf_name: str) -> torch.Tensor:
        """A copy of the tensor `hf_name` as this rank holds it (the full
        tensor at tp_size=1): the fused parameter's slice for that name."""
        return self.view(hf_name).clone()

    def is_fp8(self, hf_name: str) -> bool:
        """Whether `hf_name` is held in e4m3 (quantization="fp8"): its
        `view` is then its values read back through the scales, a new tensor."""
        if self.tied_head(hf_name):
            return False
        target = self.resolve(hf_name)
        return target is not None and self.params[target.param_name].dtype == FP8

    def view(self, hf_name: str) -> torch.Tensor:
        """`read` without the copy: a view into the parameter (for an fp8
        weight, its values in the engine dtype: `is_fp8`)."""
        if self.tied_head(hf_name):
            hf_name = "model.embed_tokens.weight"
        target = self.resolve(hf_name)
        if target is None:
            raise ValueError(f"{hf_name!r} is not a weight the engine keeps")
        param = self.params[target.param_name].detach()
        owner = self.model.get_submodule(target.param_name.rsplit(".", 1)[0])
        if isinstance(owner, MoeExperts):
            at = lambda t: t  # noqa: E731
            if target.shard_id is not None:
                expert, part = target.shard_id
                at = (lambda t: t[expert]) if part == DOWN else (lambda t: t[expert].narrow(0, part * owner.width,
                                                                                            owner.width))
            if param.dtype == FP8:
                scale_inv = getattr(owner, f"{target.param_name.rsplit('.', 1)[1]}_scale").detach()
                return dequantize_channels(at(param), at(scale_inv)).to(self.dtype)
            return at(param)
        offset, size = 0, param.shape[0]  # a fused parameter by its own name (no shard): all of it
        if target.shard_id is not None:
            if isinstance(owner, QKVParallelLinear):
                offset = {"q": 0, "k": owner.q_size, "v": owner.q_size + owner.kv_size}[target.shard_id]
                size = owner.q_size if target.shard_id == "q" else owner.kv_size
            elif isinstance(owner, MergedColumnParallelLinear):
                offset, size = sum(owner.out_sizes[: target.shard_id]), owner.out_sizes[target.shard_id]
        param = param.narrow(0, offset, size)
        if param.dtype == FP8:
            scale_inv = owner.weight_scale.detach().narrow(0, offset, size)
            return dequantize_channels(param, scale_inv).to(self.dtype)
        if param.shape[0] != getattr(owner, "vocab_size", param.shape[0]):
            param = param[: owner.vocab_size]  # vocabulary padding rows
        return param

    def load_folder(self, folder: str) -> set[str]:
        return self.load(iter_safetensors(folder))


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}  # the dtype the shapes-only pass must know


@contextlib.contextmanager
def _open_shard(path: str) -> Iterator[Any]:
    """A safetensors shard, open; a damaged one (truncated, not safetensors)
    is an OSError naming it, whether its header or a tensor is unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise OSError(f"{path}: not a readable safetensors file ({e}); download or convert the model "
                      "again") from None


def safetensors_shapes(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, meta tensor of the stored shape) from the file headers alone
    (e4m3 tensors in their dtype, as an FP8 checkpoint's weights)."""
    for path in safetensors_files(folder):
        with _open_shard(path) as f:
            for name in f.keys():
                part = f.get_slice(name)
                yield name, torch.empty(part.get_shape(), dtype=SAFETENSORS_DTYPES.get(part.get_dtype(), torch.float32),
                                        device="meta")


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs, one shard open at a time."""
    for path in safetensors_files(folder):
        with _open_shard(path) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
