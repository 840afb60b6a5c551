"""What `RolloutEngine.generate` returns (public API)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from rollout_engine.request import Request
    from rollout_engine.scheduler.stop import StopChecker


@dataclass
class RolloutOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float] | None  # one per output token
    top_logprobs: list[list[tuple[int, float]]] | None
    prompt_logprobs: list[float | None] | None  # first entry None (no context)
    finish_reason: str  # "stop" | "length" | "abort"
    text: str | None  # decoded output, when a tokenizer is loaded
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    weight_version: int  # version of the weights when the request finished
    # Per output token, the weight version that produced it (differs from
    # weight_version only across an update made while the request ran).
    output_weight_versions: list[int] = field(default_factory=list)
    # return_routed_experts: [prompt_len + output_len - 1, moe_layers, top_k] expert ids (prompt_len rows with
    # max_new_tokens=0; uint8 up to 256 experts, else int16), the routing of every token that went through
    # the model, read from the KV slot it lives in (cache hits and retractions included); an aborted
    # request's covers the tokens computed by then. Streams: on the last delta only. Otherwise None.
    routed_experts: "np.ndarray | None" = None


def routes_ready(r: "Request") -> bool:
    """A finished request's routing (if asked for) is on the host."""
    return r.routes is None or r.routes.ready()


def build_output(r: "Request", stop: "StopChecker", since: int = 0) -> RolloutOutput:
    """The output of request `r` from its output token `since` on (0: all of
    it, as `generate` returns; later: a stream delta)."""
    p = r.params
    end = r.num_output_tokens  # sampled tokens; placeholders scheduled ahead excluded
    # Text from the request's incremental detokenizer: complete characters
    # only, cut right before the first stop string (the token ids and
    # logprobs keep every sampled token). since=0: all the text so far;
    # since>0: the text released since this request's previous output.
    # None without a tokenizer.
    text = None
    detok = stop.detokenizer(r)
    if detok is not None:
        text = detok.read(from_start=since == 0)
        if r.finished:
            stop.release(r)
    return RolloutOutput(
        request_id=r.request_id, prompt_token_ids=list(r.prompt_ids),
        output_token_ids=r.output_ids[since:end],
        output_logprobs=r.output_logprobs[since:end] if p.logprobs else None,
        top_logprobs=r.top_logprobs[since:end] if p.top_logprobs else None,
        prompt_logprobs=list(r.prompt_logprobs) if r.prompt_logprobs is not None else None,
        finish_reason=r.finish_reason, text=text, num_cached_tokens=r.num_cached_tokens,
        weight_version=r.weight_version, output_weight_versions=r.output_weight_versions[since:end],
        routed_experts=r.routes.result() if r.routes is not None and r.finished else None)


def merge_deltas(deltas: list[RolloutOutput]) -> RolloutOutput:
    """One request's stream deltas, in order, as the output `generate` gives."""
    last = deltas[-1]

    def joined(field: str):
        parts = [getattr(d, field) for d in deltas]
        return None if parts[0] is None else [x for p in parts for x in p]

    texts = [d.text for d in deltas]
    return RolloutOutput(
        request_id=last.request_id, prompt_token_ids=last.prompt_token_ids,
        output_token_ids=joined("output_token_ids"), output_logprobs=joined("output_logprobs"),
        top_logprobs=joined("top_logprobs"), prompt_logprobs=last.prompt_logprobs,
        finish_reason=last.finish_reason, text=None if texts[0] is None else "".join(texts),
        num_cached_tokens=last.num_cached_tokens, weight_version=last.weight_version,
        output_weight_versions=joined("output_weight_versions"), routed_experts=last.routed_experts)
