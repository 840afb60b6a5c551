"""Build a model on its device and fill its weights: from a Hugging Face
folder, or random ("dummy") weights of a preset's or folder's shapes."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, ContextManager

import torch

from rollout_engine.distributed.comm import TPComm
from rollout_engine.layers.weight_copy import quantize_into
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.decoder import DecoderForCausalLM
from rollout_engine.models.presets import PRESETS, preset_config
from rollout_engine.quantization import fp8_linears
from rollout_engine.weights.loader import WeightLoader

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


# Sizes a config must state: where one is left out transformers takes its
# class's default (Llama's vocabulary of 32,000, 32 layers), which fits
# another model, and the weights are refused for shapes that look wrong.
STATED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _check_sizes_given(hf: Any, path: str) -> None:
    with open(path) as f:
        raw = json.load(f)
    fields = {**raw, **raw.get("text_config", {})} if isinstance(raw.get("text_config"), dict) else raw
    aliases = getattr(hf, "attribute_map", {}) or {}
    missing = [k for k in STATED_SIZES if k not in fields and not any(a in fields for a, c in aliases.items() if c == k)]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)} (transformers would take its defaults, another model's "
                         "sizes)")


def read_hf_config(model: str) -> tuple[Any, tuple[int, ...]]:
    """The HF config of a folder (or a preset) and the EOS ids its generation
    config declares."""
    if not os.path.isdir(model):
        return preset_config(model), ()
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model)
    except (OSError, ImportError):  # unreadable (transformers names the file), or a package the model type needs
        raise
    except Exception as e:  # noqa: BLE001 - transformers' checks, huggingface_hub's validation of the fields
        said = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{os.path.join(model, 'config.json')}: transformers refuses this config ({said})") from None
    _check_sizes_given(hf, os.path.join(model, "config.json"))
    eos: tuple[int, ...] = ()
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            value = json.load(f).get("eos_token_id")
        eos = (value,) if isinstance(value, int) else tuple(value or ())
    return hf, eos


def build_model(cfg: ModelConfig, comm: TPComm, device: torch.device, dtype: torch.dtype,
                quantization: str | None = None) -> DecoderForCausalLM:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), fp8_linears() if quantization == "fp8" else contextlib.nullcontext():
            model = DecoderForCausalLM(cfg, comm)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def init_dummy_weights(model: torch.nn.Module, seed: int, dtype: torch.dtype, std: float = 0.02) -> None:
    """Random weights of the right shapes; norms stay at one. An fp8 weight
    holds the quantized draw of the `dtype` weight an engine without
    quantization gets (the same seed per parameter)."""
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for leaf, p in module.named_parameters(recurse=False):
                if leaf.endswith("_scale"):  # an fp8 weight's, written with it
                    continue
                gen = torch.Generator(device=p.device).manual_seed(seed)
                scale = getattr(module, f"{leaf}_scale", None)
                if "norm" in f"{prefix}.{leaf}":
                    p.fill_(1.0)
                elif scale is not None:
                    drawn = torch.empty(p.shape, dtype=dtype, device=p.device).normal_(0.0, std, generator=gen)
                    quantize_into(p.data, scale.data, drawn)
                else:
                    p.normal_(0.0, std, generator=gen)


def move_buffers_out(model: torch.nn.Module) -> None:
    """Give non-weight buffers (RoPE tables) fresh storage outside the
    weights region, so a weights release leaves them intact. Done once,
    before anything holds their addresses."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.clone()


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take: free GPU memory, or the host's
    MemAvailable (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(model: str, cfg: ModelConfig, comm: TPComm, device: torch.device, dtype: torch.dtype,
               quantization: str | None = None) -> None:
    """Refuse, with the sizes, a model whose weights cannot fit (instead of
    being killed by the kernel's OOM killer half-way through)."""
    shapes = build_model(cfg, comm, torch.device("meta"), dtype, quantization)
    need = sum(p.numel() * p.element_size() for p in shapes.parameters())
    have = available_bytes(device)
    if have is not None and need > have:
        where = "free GPU memory" if device.type == "cuda" else "available host memory"
        held = f"{dtype}" + (f" with {quantization} linear layers" if quantization else "")
        raise ValueError(f"model {model!r} needs {need / 2**30:.1f} GiB for its weights in {held}, "
                         f"but only {have / 2**30:.1f} GiB of {where} is left")


def load_model(model: str, load_format: str, comm: TPComm, device: torch.device, dtype: torch.dtype,
               seed: int, weights_region: ContextManager | None = None,
               quantization: str | None = None) -> DecoderForCausalLM:
    """Parameters are allocated inside `weights_region`; loading happens
    outside it (its temporaries must not land in the region)."""
    hf, eos = read_hf_config(model)
    cfg = ModelConfig.from_hf(hf, eos)
    check_fits(model, cfg, comm, device, dtype, quantization)
    with weights_region or contextlib.nullcontext():
        net = build_model(cfg, comm, device, dtype, quantization)
    move_buffers_out(net)
    if load_format == "dummy":
        init_dummy_weights(net, seed, dtype)
        return net
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is not a folder; presets ({sorted(PRESETS)}) need load_format='dummy'")
    loader = WeightLoader(net)
    missing = sorted({t.param_name for t in loader.required() - loader.load_folder(model)})
    if missing:
        raise ValueError(f"checkpoint {model} lacks weights for {missing[:5]}")
    return net
