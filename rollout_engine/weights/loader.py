"""Hugging Face checkpoint names -> our (fused, sharded) parameters.

One path for a cold load and for a hot swap: every tensor goes through the
parameter's own `weight_loader`, which copies in place. Parameters are never
rebound, so addresses held by CUDA graphs and attention plans stay valid.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from rollout_engine.layers.linear import copy_into

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
        self.params = dict(model.named_parameters())
        self.stacked = getattr(model, "stacked_params", ())
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def resolve(self, hf_name: str) -> Target | None:
        """Where an HF tensor goes; None for names we deliberately ignore.
        Raises ValueError for a name the model does not have."""
        if hf_name.endswith(IGNORED_SUFFIXES):
            return None
        if self.tied and hf_name == "lm_head.weight":
            return None  # the embedding is the head
        for hf_part, our_part, shard_id in self.stacked:
            token = f".{hf_part}."
            if token in hf_name:
                name = hf_name.replace(token, f".{our_part}.")
                if name in self.params:
                    return Target(name, shard_id)
        if hf_name in self.params:
            return Target(hf_name, None)
        raise ValueError(f"unknown weight name {hf_name!r}")

    def full_names(self) -> list[str]:
        """The HF names that together cover every parameter."""
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

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each tensor into its parameter as it arrives (a generator is
        consumed one tensor at a time). Returns the parameters touched."""
        touched: set[str] = set()
        with torch.no_grad():
            for hf_name, tensor in named_tensors:
                target = self.resolve(hf_name)
                if target is None:
                    continue
                param = self.params[target.param_name]
                tensor = tensor.to(param.device, non_blocking=True)
                try:
                    loader = getattr(param, "weight_loader", default_loader)
                    loader(param, tensor, target.shard_id)
                except ValueError as e:
                    raise ValueError(f"{hf_name}: {e}") from None
                touched.add(target.param_name)
        return touched

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


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs, one shard open at a time."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
