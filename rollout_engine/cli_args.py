"""Command-line flags shared by the `rollout-engine` subcommands and the HTTP
server: engine flags generated from `EngineConfig`'s fields, sampling flags,
and the checks that run before a model is loaded (the argument types and
the scripts' parser: `script_args`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import typing
from typing import Any, Iterable, Mapping

from rollout_engine.config import (ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS,
                                   EngineConfig)
from rollout_engine.model_zoo import DEFAULT_MODEL, NOT_A_MODEL_FOLDER, ZOO, bad_config_json, is_model_folder
from rollout_engine.models.config import ModelConfig
from rollout_engine.models.presets import PRESETS
from rollout_engine.sampling_params import SamplingParams, is_int
from rollout_engine.script_args import UsageError, flag_of
from rollout_engine.suggest import did_you_mean
from rollout_engine.tokenizer import has_tokenizer_files
from rollout_engine.validation import Limits, check_request

# Help text of every EngineConfig field; tests/test_cli.py checks that none is
# missing, so a new field cannot reach the command line undocumented.
FIELD_HELP: dict[str, str] = {
    "model": "local Hugging Face folder, a zoo model fetched once by name, or (with --load-format dummy) "
             "a preset with random weights",
    "device": "where the model runs: auto (CUDA when available, else the CPU), cpu, cuda or cuda:N",
    "dtype": "dtype of weights and activations; auto is bfloat16 on CUDA and float32 on the CPU",
    "load_format": "auto reads the safetensors weights; dummy builds the model with random weights "
                   "(presets, benchmarks)",
    "tokenizer": "folder with tokenizer files, for a model without them (text prompts and --chat need one)",
    "max_total_tokens": "KV cache capacity in tokens; unset, it is sized from free memory",
    "mem_fraction": "share of the free GPU memory that weights, activations and the KV cache may take "
                    "when the cache is sized from it",
    "max_running_requests": "most requests decoded together in one batch",
    "max_prefill_tokens": "most prompt tokens prefilled in one step; longer prompts are prefilled in chunks",
    "page_size": "tokens per KV cache page (a power of two)",
    "enable_prefix_cache": "reuse the KV of shared prompt prefixes across requests (radix tree)",
    "attention_backend": "attention kernels; auto picks flashinfer on CUDA where it applies, else torch",
    "cuda_graph": "replay decode steps as CUDA graphs (CUDA only)",
    "cuda_graph_max_batch_size": "largest decode batch replayed as a CUDA graph",
    "enable_memory_saver": "put weights and KV cache in torch-memory-saver regions so that the GPU memory "
                           "can be released between rollouts (CUDA, gpu extra)",
    "weights_cpu_backup": "with the memory saver: keep a CPU copy of the weights so that a release keeps them",
    "tp_size": "tensor-parallel degree: GPUs per engine (processes over gloo on the CPU); it must divide the "
               "model's attention heads and intermediate size, and divide or be divided by its KV heads (the "
               "error names the sizes that fit); the all-reduce path: $ROLLOUT_ENGINE_ALLREDUCE (fused, the "
               "default; one-shot or nccl; docs/tensor-parallel.md)",
    "seed": "seed of dummy weights and of the sampling seeds drawn for requests",
    "overlap_schedule": "schedule step N+1 while step N runs on the device",
    "enable_return_routed_experts": "MoE models: record the experts each token went to in every MoE layer, for "
                                    "requests that ask for them (return_routed_experts; routing replay)",
    "quantization": "fp8: the linear layers of the decoder and the MoE experts hold e4m3 weights with one "
                    "scale per weight row, quantized on load and on every update; the linear layers' activations "
                    "are quantized per token, the experts' are not (embeddings, norms, routers and the LM head "
                    "stay in the engine's dtype)",
    "kv_cache_dtype": "dtype of the KV cache; auto: the model's dtype; fp8_e4m3: e4m3 values with scale 1, one "
                      "byte per element (twice bf16's tokens in the same memory, four times fp32's)",
    "deterministic": "batch-invariant mode: a seeded request gives the same tokens and logprobs whatever else "
                     "is batched, chunked or cached (GPU: products through cuBLAS in calls of 256 rows, checked "
                     "at start, Triton kernels where a check fails; CPU: row by row, several times slower)",
}

# Fields whose allowed values config.py lists as a tuple.
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES, "load_format": LOAD_FORMATS, "attention_backend": ATTENTION_BACKENDS,
    "quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES,
}

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "ignore_eos")


def _scalar_type(hint: Any) -> type:
    """`str`, `int`, `float` or `bool` from a field annotation such as `int | None`."""
    types = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    if len(types) != 1 or types[0] not in (str, int, float, bool):
        raise TypeError(f"EngineConfig annotation {hint!r} has no command-line form; extend cli_args")
    return types[0]


def add_engine_args(parser: argparse.ArgumentParser, fields: Iterable[str] | None = None,
                    defaults: Mapping[str, Any] | None = None) -> None:
    """Add `--field-name` for each EngineConfig field (all, or those in `fields`),
    in an "engine" group, with `defaults` overriding the dataclass defaults."""
    wanted = set(fields) if fields is not None else None
    defaults = {"model": DEFAULT_MODEL, **(defaults or {})}
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if wanted is not None and f.name not in wanted:
            continue
        default = defaults.get(f.name, f.default)
        kind = _scalar_type(hints[f.name])
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": _help(f.name)}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(type=kind, choices=FIELD_CHOICES.get(f.name), metavar=None if f.name in FIELD_CHOICES
                      else f.name.split("_")[-1].upper())
        flags = [flag_of(f.name)] + (["--tp"] if f.name == "tp_size" else [])
        group.add_argument(*flags, **kw)


def _help(field: str) -> str:
    text = FIELD_HELP[field]
    if field == "model":
        text += f"; zoo: {', '.join(sorted(ZOO))}; presets: {', '.join(sorted(PRESETS))}"
    return text


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments (`model` included) from the flags that
    `add_engine_args` added."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}


def build_config(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig; a bad value is a UsageError naming its flag."""
    try:
        return EngineConfig(**engine_kwargs(args))
    except ValueError as exc:
        raise _named(exc, [f.name for f in dataclasses.fields(EngineConfig)]) from None


def _named(exc: ValueError, fields: Iterable[str]) -> UsageError:
    """Config and sampling errors start with the field name ("page_size must be
    ..."), a request's after its index ("request 0: sampling_params.max_new_tokens
    ..."); say it as the flag, the way argparse does."""
    match = re.match(r"(?:request \d+: )?(?:sampling_params\.)?(\w+)(?:=\w+)? (.*)", str(exc), re.S)
    if match and match.group(1) in fields:
        rest = re.sub(r"^[(](\S+)[)] ", r"\1 ", match.group(2))  # "(8190) plus the prompt ...": the value itself
        rest = re.sub(r"[(]raise (\w+)[)]", lambda m: f"(raise {flag_of(m[1])})", rest)  # an engine field's remedy
        rest = re.sub(r"\b(\w+)=True\b", lambda m: flag_of(m[1]) if m[1] in fields else m[0], rest)  # another flag
        if rest.startswith("must be None or "):  # None is the flag left out
            rest = "must be " + rest[len("must be None or "):] + " (or leave the flag out)"
        return UsageError(f"argument {flag_of(match.group(1))}: {rest}")
    return UsageError(str(exc))


def said_as_flags(exc: ValueError) -> UsageError:
    """The engine's refusal of a request (`validation.check_request`) or of
    its own settings at build (`enable_return_routed_experts=True needs ...`)
    as the command line says it: the field as the flag that sets it."""
    return _named(exc, [*SAMPLING_FIELDS, *(f.name for f in dataclasses.fields(EngineConfig))])


def check_tp_args(config: EngineConfig) -> None:
    """A tp_size that does not split the model, as a UsageError naming the flag
    (reads the model's config only, before any process starts)."""
    from rollout_engine.core.build import check_tp_size
    from rollout_engine.distributed.fast_allreduce import allreduce_mode

    if config.tp_size > 1:
        try:
            allreduce_mode()
        except ValueError as e:  # the environment's, not a flag's
            raise UsageError(str(e)) from None
    try:
        check_tp_size(config)
    except ValueError as e:
        raise UsageError(f"argument --tp-size: {e}") from None


def check_prompt_args(config: EngineConfig, prompts: list[str] | None, ids: list[list[int]] | None,
                      params: SamplingParams) -> None:
    """What the engine would refuse in the prompts, said before it loads:
    an empty text prompt, a prompt and its new tokens past
    --max-total-tokens or the model's context (a text prompt counted as one
    token at least), and for token-id prompts a token id outside the model's
    vocabulary (the context and vocabulary read from the model's config, not
    its weights)."""
    for i, prompt in enumerate(prompts or []):
        if not prompt:
            raise UsageError(f"argument prompts: prompt {i} is empty")
    capacity = config.max_total_tokens
    longest = max(map(len, ids)) if ids else 1  # a text prompt's length is known once tokenized
    if capacity is not None and longest + params.max_new_tokens > capacity:
        prompt = f"a {longest}-token prompt" if ids else "any prompt"
        raise UsageError(f"argument --max-total-tokens: a KV cache of {capacity} token{'s' * (capacity != 1)} "
                         f"cannot hold {prompt} "
                         f"and --max-new-tokens {params.max_new_tokens}")
    from rollout_engine.model_zoo import resolve_model_path
    from rollout_engine.runner.model_loader import read_hf_config

    mc = ModelConfig.from_hf(*read_hf_config(resolve_model_path(config.model, config.load_format)))
    if not ids:
        if 1 + params.max_new_tokens > mc.max_position:
            raise UsageError(f"argument --max-new-tokens: {params.max_new_tokens} new tokens after a prompt of one "
                             f"token at least exceed the context of {config.model} ({mc.max_position} tokens)")
        return
    # The KV cache's capacity was checked above (unset, it is not known before the engine sizes it).
    limits = Limits(mc.vocab_size, mc.max_position, kv_capacity=capacity or mc.max_position,
                    window=mc.context_is_window)
    for i, row in enumerate(ids):
        outside = [t for t in row if t >= mc.vocab_size]
        if outside:
            raise UsageError(f"argument --input-ids: prompt {i} has token id {outside[0]}, outside the "
                             f"vocabulary of {config.model} [0, {mc.vocab_size})")
        try:
            check_request(i, row, params, limits, has_tokenizer(config))
        except ValueError as exc:
            raise _named(exc, SAMPLING_FIELDS) from None


def check_engine_args(config: EngineConfig) -> None:
    """Checks that need no model: the model and tokenizer exist, CUDA is there
    when asked for. Fails fast instead of after a download or a load."""
    model, dummy = config.model, config.load_format == "dummy"
    if not os.path.isdir(model):
        if dummy and model not in PRESETS:
            hint = ("; it is a zoo model, with real weights: add --load-format auto" if model in ZOO
                    else did_you_mean(model, [*PRESETS, *ZOO])
                    or f"; with --load-format auto, a zoo model ({', '.join(sorted(ZOO))})")
            raise UsageError(f"argument --model: {model!r} is neither a folder nor a preset "
                             f"({', '.join(sorted(PRESETS))}){hint}")
        if not dummy and model not in ZOO:
            hint = ("; it is a preset, with random weights and no tokenizer: add --load-format dummy (and for text "
                    "prompts --tokenizer FOLDER, or give --input-ids)" if model in PRESETS
                    else did_you_mean(model, [*ZOO, *PRESETS]))
            raise UsageError(f"argument --model: {model!r} is neither a folder nor a zoo model "
                             f"({', '.join(sorted(ZOO))}){hint}")
    elif not is_model_folder(model):
        raise UsageError(f"argument --model: {model!r} {NOT_A_MODEL_FOLDER}")
    elif bad := bad_config_json(model):
        raise UsageError(f"argument --model: {model!r} {bad}")
    if config.tokenizer is not None and not has_tokenizer_files(config.tokenizer):
        raise UsageError(f"argument --tokenizer: {config.tokenizer!r} is not a folder with tokenizer files")
    import torch

    cuda = torch.cuda.is_available()
    if config.device.startswith("cuda") and not cuda:
        raise UsageError(f"argument --device: {config.device!r} was asked for, but torch sees no CUDA GPU")
    if config.enable_memory_saver and (config.device == "cpu" or not cuda):
        raise UsageError("argument --enable-memory-saver: the memory saver needs a CUDA device")
    if config.attention_backend not in ("auto", "torch") and (config.device == "cpu" or not cuda):
        raise UsageError(f"argument --attention-backend: {config.attention_backend!r} needs a CUDA device "
                         f"({'--device cpu was asked for' if cuda else 'torch sees no CUDA GPU'}); "
                         f"'torch' runs anywhere")


def has_tokenizer(config: EngineConfig) -> bool:
    """Whether the engine built from `config` will load a tokenizer (as
    `load_tokenizer` decides, given `check_engine_args` passed)."""
    if config.tokenizer is not None:
        return True
    if os.path.isdir(config.model):
        return has_tokenizer_files(config.model)
    return config.load_format != "dummy"  # a zoo model's folder comes with its tokenizer


# ---- sampling -------------------------------------------------------------------

def add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int = 64, n: int = 1) -> None:
    own = SamplingParams()
    group = parser.add_argument_group(
        "sampling", f"defaults for reading samples at a terminal; SamplingParams' own (temperature {own.temperature}, "
                    f"top-p {own.top_p}, {own.max_new_tokens} new tokens) sample the model's distribution, as RL "
                    "rollouts want")
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                       help="tokens generated per sample at most (0: the prompt alone, no tokens)")
    group.add_argument("--temperature", type=float, default=0.7, metavar="T", help="0 samples greedily")
    group.add_argument("--top-p", type=float, default=0.9, metavar="P",
                       help="keep the most likely tokens whose probabilities sum to P")
    group.add_argument("--top-k", type=int, default=-1, metavar="K",
                       help="keep the K most likely tokens; -1 or 0 keeps all")
    group.add_argument("--min-p", type=float, default=0.0, metavar="P",
                       help="drop tokens less likely than P times the most likely one")
    group.add_argument("-n", type=int, default=n, metavar="N", help="samples per prompt")
    group.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")


def build_sampling(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags; a bad value is a UsageError naming its flag."""
    try:
        return SamplingParams(**{f: getattr(args, f) for f in SAMPLING_FIELDS})
    except ValueError as exc:
        raise _named(exc, SAMPLING_FIELDS) from None


# ---- argparse types ---------------------------------------------------------------

INPUT_IDS_HELP = ("token ids of one prompt, comma-separated (--input-ids 1,2,3; repeat the flag for more "
                  "prompts), or a JSON list of lists for several ('[[1,2,3],[4,5]]'); instead of text prompts")


def input_ids(text: str) -> list[list[int]]:
    """argparse type of --input-ids: the prompts (lists of token ids) in `text`."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
        prompts = value if value and all(isinstance(p, list) for p in value) else [value]
    else:
        try:
            prompts = [[int(t) for t in text.split(",")]]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    for p in prompts:
        if not p or not all(is_int(t) and t >= 0 for t in p):
            raise argparse.ArgumentTypeError(f"{text!r}: each prompt must be a non-empty list of token ids >= 0")
    return prompts
