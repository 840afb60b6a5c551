"""Engine configuration: one frozen dataclass built from the constructor's
arguments, validated once, passed explicitly to every part."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping, Sequence

from rollout_engine.sampling_params import SamplingParams, is_int, is_number
from rollout_engine.suggest import did_you_mean, unknown_keyword

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "torch")
QUANTIZATIONS = ("fp8",)  # or None: weights in `dtype`
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # "auto": the KV cache in `dtype`; "fp8_e4m3": e4m3, scale 1


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    tokenizer: str | None = None
    max_total_tokens: int | None = None
    mem_fraction: float = 0.85
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    page_size: int = 1
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"
    cuda_graph: bool = True
    cuda_graph_max_batch_size: int = 256
    enable_memory_saver: bool = False
    weights_cpu_backup: bool = False
    tp_size: int = 1
    seed: int = 0
    overlap_schedule: bool = True  # schedule step N+1 while step N runs
    deterministic: bool = False  # batch-invariant: a request's tokens and logprobs do not depend on its batch
    enable_return_routed_experts: bool = False  # MoE: record each token's experts per layer (routing replay)
    quantization: str | None = None  # "fp8": e4m3 linear-layer weights, one scale per output row (quantization.py)
    kv_cache_dtype: str = "auto"  # "fp8_e4m3": K/V held in e4m3 (half of bf16's bytes), scale 1 (kernels/e4m3.py)

    def __post_init__(self) -> None:
        def bad(field: str, why: str, hint: str = "") -> None:
            raise ValueError(f"{field} {why}, got {getattr(self, field)!r}{hint}")

        if not isinstance(self.model, str) or not self.model:
            bad("model", "must be a folder path or a preset name")
        if not (self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:")):
            bad("device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}", did_you_mean(str(self.dtype).removeprefix("torch."), DTYPES))
        if self.load_format not in LOAD_FORMATS:
            bad("load_format", f"must be one of {LOAD_FORMATS}")
        if self.max_total_tokens is not None and (
            not is_int(self.max_total_tokens) or self.max_total_tokens < 1
        ):
            bad("max_total_tokens", "must be None or an integer >= 1")
        if not (is_number(self.mem_fraction) and 0.0 < self.mem_fraction <= 1.0):
            bad("mem_fraction", "must be a number in (0, 1]")
        for field in ("max_running_requests", "max_prefill_tokens", "page_size",
                      "cuda_graph_max_batch_size", "tp_size"):
            value = getattr(self, field)
            if not is_int(value) or value < 1:
                bad(field, "must be an integer >= 1")
        if self.page_size & (self.page_size - 1):
            bad("page_size", "must be a power of two")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if not is_int(self.seed) or self.seed < 0:
            bad("seed", "must be a non-negative integer")
        for flag in ("deterministic", "enable_return_routed_experts"):
            if not isinstance(getattr(self, flag), bool):
                bad(flag, "must be True or False")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            lower = str(self.quantization).lower()
            hint = f" (did you mean {lower!r}?)" if lower in QUANTIZATIONS else ""
            bad("quantization", f"must be None or one of {QUANTIZATIONS}{hint}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = "; did you mean 'fp8_e4m3'?" if "fp8" in str(self.kv_cache_dtype).lower() else ""
            bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES} (auto: the KV cache in `dtype`{hint})")
        if self.deterministic and self.quantization is not None:
            bad("quantization", "cannot be used with deterministic=True (fp8 products are not batch-invariant)")
        if self.deterministic and self.attention_backend != "auto":
            bad("attention_backend", "must stay 'auto' with deterministic=True (which uses its own "
                                     "batch-invariant attention)")


def check_options(options: Mapping) -> None:
    """Keyword arguments of `RolloutEngine(model, **options)`: an unknown one
    is named as the engine's, with the closest option."""
    known = [f.name for f in fields(EngineConfig) if f.name != "model"]
    check_keywords("RolloutEngine()", options, known, "rollout_engine.config.EngineConfig", "to generate()")


def check_keywords(call: str, given: Mapping, known: Sequence[str], where: str, sampling_goes: str) -> None:
    """A keyword `call` does not take: a sampling parameter is named as one,
    with where it goes (`sampling_goes`); another with the closest known
    keyword, else where they are listed."""
    sampling = {f.name for f in fields(SamplingParams)}
    for name in given:
        if name in known:
            continue
        if name in sampling:
            raise TypeError(f"{call} got an unexpected keyword argument {name!r} (a sampling parameter: pass it "
                            f"in SamplingParams, {sampling_goes})")
        raise unknown_keyword(call, name, known, where)
