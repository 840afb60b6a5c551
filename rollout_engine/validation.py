"""Checks on `generate` arguments, all done before any work starts. Every
error is a ValueError naming the request and the field."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rollout_engine.config import check_keywords
from rollout_engine.sampling_params import SamplingParams, is_int
from rollout_engine.suggest import keywords_checked


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int  # the model's context length
    kv_capacity: int  # tokens the KV cache holds: one request must fit alone
    routing_off: str | None = None  # why return_routed_experts cannot be served (None: it can)
    window: bool = False  # the context is the config's sliding_window (smaller than its max_position_embeddings)


ROUTING_OFF = "needs an engine built with enable_return_routed_experts=True (MoE models only)"


def past_vocabulary(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The first few of `ids` outside [0, vocab_size): ids a tokenizer larger
    than the model's vocabulary gave."""
    return [t for t in ids if not 0 <= t < vocab_size][:5]


def _fail(index: int, field: str, why: str) -> None:
    raise ValueError(f"request {index}: {field} {why}")


def resolve_prompts(prompts: Sequence[str] | None, input_ids: Sequence[Sequence[int]] | None,
                    tokenizer: Any, limits: Limits) -> list[list[int]]:
    if isinstance(input_ids, SamplingParams) or (isinstance(input_ids, (list, tuple)) and input_ids
                                                 and isinstance(input_ids[0], SamplingParams)):
        raise ValueError("input_ids: got SamplingParams (the second positional argument is input_ids; pass the "
                         "parameters as sampling_params=...)")
    if (prompts is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompts and input_ids")
    if prompts is not None:
        if isinstance(prompts, str):
            shown = repr(prompts if len(prompts) <= 20 else prompts[:17] + "...")
            raise ValueError(f"prompts must be a list of strings, got one string: pass [{shown}]")
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of strings, got {type(prompts).__name__}")
        if tokenizer is None and prompts:  # no prompts: no outputs, as for input_ids=[]
            raise ValueError("prompts (text) need a tokenizer; pass input_ids or tokenizer=...")
        out = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                _fail(i, "prompts", f"must be a string, got {type(p).__name__}")
            if not p:
                _fail(i, "prompts", "holds an empty string")
            ids = tokenizer.encode(p)
            past = past_vocabulary(ids, limits.vocab_size)  # a tokenizer with tokens past the model's
            if past:
                _fail(i, "prompts", f"encodes to token ids past the model's vocabulary [0, {limits.vocab_size}): "
                                    f"{past} (the tokenizer has tokens the model does not)")
            out.append(ids)
        return out
    if not _is_sequence(input_ids):
        raise ValueError("input_ids must be a list of lists of token ids")
    if _is_flat(input_ids):
        raise ValueError("input_ids must be a list of prompts, each a list of token ids; got one flat list of "
                         "ids (for one prompt pass [ids])")
    return [_token_ids(i, ids, limits.vocab_size) for i, ids in enumerate(input_ids)]


def _is_sequence(x: Any) -> bool:
    """A list or tuple, or a 1-d/2-d array (numpy, torch) of integers."""
    return isinstance(x, (list, tuple)) or (hasattr(x, "tolist") and getattr(x, "ndim", 0) >= 1)


def _is_flat(x: Any) -> bool:
    """One prompt's ids where a list of prompts belongs: a 1-d array, or a
    non-empty list of ints (arrays are not converted to find out)."""
    if hasattr(x, "ndim"):
        return x.ndim == 1 and len(x) > 0
    return bool(x) and all(is_int(t) for t in x)


def _token_ids(i: int, ids: Any, vocab_size: int) -> list[int]:
    out = token_list(ids, f"request {i}: input_ids", vocab_size)
    if not out:
        _fail(i, "input_ids", "is empty")
    return out


def token_list(ids: Any, name: str, vocab_size: int | None = None) -> list[int]:
    """One sequence's ids as plain ints (possibly none), each in
    [0, vocab_size) when that is given. Integer scalars of numpy or torch are
    accepted; anything else is named for what it is, in an error that starts
    with `name`."""
    if not _is_sequence(ids):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    out = []
    for t in (ids.tolist() if hasattr(ids, "tolist") else ids):
        if hasattr(t, "item") and getattr(t, "ndim", 1) == 0 and hasattr(t, "dtype"):
            t = t.item()  # a numpy or torch scalar
        if isinstance(t, bool) or not isinstance(t, int):
            what = "a nested list" if isinstance(t, (list, tuple)) else f"{t!r} ({type(t).__name__})"
            raise ValueError(f"{name} must hold integer token ids, got {what}")
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise ValueError(f"{name} contains {t}, outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def resolve_params(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                   num: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num
    if not isinstance(sampling_params, (list, tuple)):
        hint = " (build one from a dict with SamplingParams(**d))" if isinstance(sampling_params, Mapping) else ""
        raise ValueError(f"sampling_params must be a SamplingParams or a list of {num} SamplingParams (one per "
                         f"prompt), got {type(sampling_params).__name__}{hint}")
    if len(sampling_params) != num:
        raise ValueError(f"sampling_params must be a SamplingParams or a list of {num} SamplingParams (one per "
                         f"prompt), got a list of {len(sampling_params)}")
    for i, p in enumerate(sampling_params):
        if not isinstance(p, SamplingParams):
            _fail(i, "sampling_params", f"must be a SamplingParams, got {type(p).__name__}")
    return list(sampling_params)


def check_request(i: int, prompt: list[int], params: SamplingParams, limits: Limits, has_tokenizer: bool) -> None:
    total = len(prompt) + params.max_new_tokens
    if total > limits.max_context:
        _fail(i, "sampling_params.max_new_tokens",
              f"({params.max_new_tokens}) plus the prompt ({len(prompt)} token{'s' * (len(prompt) != 1)}) exceeds the model's "
              f"context of {limits.max_context} tokens"
              f"{' (its sliding_window: the engine keeps no tokens past the window)' if limits.window else ''}")
    if total > limits.kv_capacity:
        _fail(i, "sampling_params.max_new_tokens",
              f"({params.max_new_tokens}) plus the prompt ({len(prompt)} token{'s' * (len(prompt) != 1)}) exceeds the KV cache "
              f"capacity of {limits.kv_capacity} tokens (raise max_total_tokens)")
    if params.stop and not has_tokenizer:
        _fail(i, "sampling_params.stop", "needs a tokenizer")
    for t in params.stop_token_ids or ():
        if t >= limits.vocab_size:
            _fail(i, "sampling_params.stop_token_ids", f"contains {t}, outside the vocabulary")
    if params.return_routed_experts and limits.routing_off is not None:
        _fail(i, "sampling_params.return_routed_experts", limits.routing_off)
    if params.top_logprobs > limits.vocab_size:
        _fail(i, "sampling_params.top_logprobs", f"({params.top_logprobs}) exceeds the vocabulary size")


def resolve_request_ids(request_ids: Sequence[str] | None, num: int, taken: set[str]) -> list[str] | None:
    if request_ids is None:
        return None
    if not isinstance(request_ids, (list, tuple)) or len(request_ids) != num:
        raise ValueError(f"request_ids must be a list of {num} string{'s' if num != 1 else ''}, one per prompt")
    seen: set[str] = set()
    for i, rid in enumerate(request_ids):
        if not isinstance(rid, str) or not rid:
            _fail(i, "request_ids", "must be a non-empty string")
        if rid in seen or rid in taken:
            _fail(i, "request_ids", f"{rid!r} is already in use")
        seen.add(rid)
    return list(request_ids)


def check_timeout(timeout_s):
    """`timeout_s` itself, if it is None or a positive number of seconds."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    return timeout_s


def weight_name_list(names) -> list[str] | None:
    """`names` as a list of strings (None: all weights); ValueError otherwise."""
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise ValueError("names must be a list of weight names (strings), or None for all")
    names = list(names)  # (a generator is read once, here)
    if not all(isinstance(n, str) for n in names):
        raise ValueError("names must be a list of weight names (strings), or None for all")
    return names


def warn_flush_cache(flush_cache: bool) -> None:
    if not flush_cache:
        import warnings

        warnings.warn("update_weights(flush_cache=False) no longer keeps the prefix cache: KV computed with other "
                      "weights is never served", DeprecationWarning, stacklevel=3)


def update_items(named_tensors):
    """A dict (any Mapping) as a list of its items; a list, tuple or iterator
    of (name, tensor) pairs as it is (each item is checked as it is read)."""
    from collections.abc import Mapping

    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    if isinstance(named_tensors, (str, bytes)) or not hasattr(named_tensors, "__iter__"):
        raise ValueError(f"named_tensors must be a dict or (name, tensor) pairs, got {type(named_tensors).__name__}")
    return named_tensors


def keywords_named(*methods: str):
    """Class decorator: these methods (generate and its kin) fail on a
    keyword they do not take by naming it (a sampling parameter such as
    temperature=: where it goes instead), not with Python's bare TypeError."""
    def checked(method, call: str):
        known = [name for name in inspect.signature(method).parameters if name != "self"]

        def check(kwargs):
            if kwargs.keys() - known:
                check_keywords(call, kwargs, known, "docs/python-api.md", "as sampling_params=SamplingParams(...)")
        return keywords_checked(method, check)

    def apply(cls):
        for name in methods:
            setattr(cls, name, checked(getattr(cls, name), f"{cls.__name__}.{name}()"))
        return cls
    return apply
