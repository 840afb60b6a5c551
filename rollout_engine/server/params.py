"""Request fields -> SamplingParams, for SGLang's and OpenAI's field names.
A bad or unsupported value raises ApiError(400) naming the field."""
from __future__ import annotations

from typing import Any

from rollout_engine.sampling_params import SamplingParams
from rollout_engine.server.errors import ApiError
from rollout_engine.suggest import did_you_mean

# SGLang sampling fields taken as they are.
SGLANG_DIRECT = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop_token_ids", "ignore_eos")
# SGLang fields accepted only at the value that changes nothing here.
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
           "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
           "custom_params": None}
# SGLang fields about text formatting that the engine's detokenizer decides itself.
IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval")


def _stop(value: Any, field: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ApiError(400, f"{field} must be a string or a list of strings", field)
    return [s for s in value if s] or None


def make_params(prefix: str = "", **kw) -> SamplingParams:
    """SamplingParams; a bad value is a 400 naming the field (as `prefix.field`)."""
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        message = str(e).removeprefix("sampling_params.")
        name = message.split(" ", 1)[0]
        if prefix:
            message, name = f"{prefix}.{message}", f"{prefix}.{name}"
        if name.endswith("max_new_tokens") and not prefix:
            message, name = message.replace("max_new_tokens", "max_tokens", 1), "max_tokens"
        raise ApiError(400, message, name) from None


def sglang_params(raw: Any, return_logprob: bool, top_logprobs_num: int, field: str = "sampling_params",
                  routed: bool = False) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ApiError(400, f"{field} must be an object", field)
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{field}.{key}"
        if key in SGLANG_DIRECT:
            kw[key] = value
        elif key in ("sampling_seed", "seed"):
            kw["seed"] = value
        elif key == "stop":
            kw["stop"] = _stop(value, name)
        elif key in NEUTRAL:
            if value not in (NEUTRAL[key], None):
                raise ApiError(400, f"{name} is not supported (only {NEUTRAL[key]!r})", name)
        elif key not in IGNORED:
            known = [*SGLANG_DIRECT, "sampling_seed", "seed", "stop", *NEUTRAL, *IGNORED]
            raise ApiError(400, f"{name} is not a known sampling parameter{did_you_mean(key, known)}", name)
    kw["top_logprobs"] = top_logprobs_num if return_logprob else 0
    if routed:
        kw["return_routed_experts"] = True
    return make_params(field, **kw)


def openai_kwargs(body, max_tokens: int | None, default_max_tokens: int) -> dict[str, Any]:
    """SamplingParams keywords from an OpenAI completions/chat body (already type-checked)."""
    kw: dict[str, Any] = dict(max_new_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                              n=body.n, seed=body.seed, stop=_stop(body.stop, "stop"), ignore_eos=body.ignore_eos,
                              stop_token_ids=body.stop_token_ids)
    if body.top_k is not None:
        kw["top_k"] = body.top_k
    if body.min_p is not None:
        kw["min_p"] = body.min_p
    if body.temperature is not None:
        kw["temperature"] = body.temperature
    if body.top_p is not None:
        kw["top_p"] = body.top_p
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    return kw


def logprob_count(value: Any, field: str, limit: int = 20) -> int:
    if value is None or value is False:
        return 0
    if value is True:
        return 0
    if not isinstance(value, int) or value < 0 or value > limit:
        raise ApiError(400, f"{field} must be an integer in [0, {limit}]", field)
    return value
