"""SGLang-compatible native routes: /generate (single or batch, SSE
streaming), /health and the info routes. Field names and the output's
`meta_info` follow SGLang's, so RL clients written for it work unchanged."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout_engine.outputs import RolloutOutput, merge_deltas
from rollout_engine.server.errors import ApiError
from rollout_engine.server.params import logprob_count, sglang_params
from rollout_engine.server.sse import sse
from rollout_engine.server.state import ClientGone, read_json, state_of, until_done_or_gone

router = APIRouter()

TOP_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "top_logprobs_num", "stream",
              "logprob_start_len", "return_text_in_logprobs", "return_routed_experts"}
# SGLang fields accepted when absent/empty (features this engine does not have).
EMPTY_OK = {"image_data", "audio_data", "video_data", "lora_path", "lora_id", "custom_logit_processor",
            "return_hidden_states", "modalities", "session_params", "data_parallel_rank", "bootstrap_host",
            "bootstrap_port", "bootstrap_room", "input_embeds"}


def _token_lists(value: Any) -> tuple[list[list[int]], bool]:
    """input_ids: a list of ints, or a list of such lists -> (lists, batched)."""
    if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
        lists, batched = value, True
    else:
        lists, batched = [value], False
    for ids in lists:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in ids):
            raise ApiError(400, "input_ids must be a non-empty list of token ids, or a list of such lists",
                           "input_ids")
    return lists, batched


class GenerateCall:
    """A parsed /generate body."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", "body")
        for key, value in body.items():
            if key not in TOP_FIELDS and not (key in EMPTY_OK and value in (None, [], {}, False)):
                raise ApiError(400, f"{key} is not a supported field", key)
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", "text")
        if text is not None:
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(isinstance(t, str) and t for t in texts):
                raise ApiError(400, "text must be a non-empty string or a non-empty list of them", "text")
            self.prompts, self.input_ids, count = texts, None, len(texts)
        else:
            self.input_ids, batched = _token_lists(ids)
            self.prompts, count = None, len(self.input_ids)
        self.batched = batched
        self.return_logprob = body.get("return_logprob", False)
        if not isinstance(self.return_logprob, bool):
            raise ApiError(400, "return_logprob must be a bool", "return_logprob")
        top = logprob_count(body.get("top_logprobs_num", 0), "top_logprobs_num")
        self.logprob_text = body.get("return_text_in_logprobs", False) is True
        # SGLang's prompt scoring: with return_logprob, the prompt's logprobs from this position on
        # (input_token_logprobs); -1 (the default): none.
        self.logprob_start = body.get("logprob_start_len")
        self.logprob_start = -1 if self.logprob_start is None else self.logprob_start
        if not isinstance(self.logprob_start, int) or isinstance(self.logprob_start, bool) or self.logprob_start < -1:
            raise ApiError(400, f"logprob_start_len must be an integer >= -1 (-1: no prompt logprobs; one value for "
                                f"every prompt), got {self.logprob_start!r}", "logprob_start_len")
        prompt_logprobs = self.return_logprob and self.logprob_start >= 0
        self.routed = body.get("return_routed_experts", False)
        if not isinstance(self.routed, bool):
            raise ApiError(400, "return_routed_experts must be a bool", "return_routed_experts")
        self.stream = body.get("stream", False)
        if not isinstance(self.stream, bool):
            raise ApiError(400, "stream must be a bool", "stream")
        raw = body.get("sampling_params")
        if isinstance(raw, list):
            if len(raw) != count:
                raise ApiError(400, f"sampling_params has {len(raw)} entries for {count} prompts", "sampling_params")
            self.params = [sglang_params(p, self.return_logprob, top, f"sampling_params[{i}]", self.routed)
                           for i, p in enumerate(raw)]
        else:
            self.params = [sglang_params(raw, self.return_logprob, top, routed=self.routed)] * count
        if prompt_logprobs:
            self.params = [dataclasses.replace(p, prompt_logprobs=True) for p in self.params]
        rid = body.get("rid")
        self.request_ids = None
        if rid is not None:
            rids = rid if isinstance(rid, list) else [rid]
            if len(rids) != count or not all(isinstance(r, str) and r for r in rids):
                raise ApiError(400, "rid must be a string (or one per prompt)", "rid")
            self.request_ids = rids
        self.samples = sum(p.n for p in self.params)

    def kwargs(self) -> dict:
        return dict(prompts=self.prompts, input_ids=self.input_ids, sampling_params=self.params,
                    request_ids=self.request_ids)


def _finish(reason: str | None, out: RolloutOutput) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(out.output_token_ids)}
    return {"type": reason}


def meta_info(out: RolloutOutput, call: GenerateCall, tokenizer, started: float, count: int | None = None) -> dict:
    n_out = count if count is not None else len(out.output_token_ids)
    meta = {"id": out.request_id, "finish_reason": _finish(out.finish_reason, out),
            "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": n_out,
            "cached_tokens": out.num_cached_tokens, "weight_version": out.weight_version,
            "e2e_latency": round(time.perf_counter() - started, 6)}
    if call.return_logprob:
        def tok(t: int):
            return tokenizer.decode([t]) if call.logprob_text and tokenizer is not None else None

        meta["output_token_logprobs"] = [[lp, t, tok(t)] for lp, t in
                                         zip(out.output_logprobs or [], out.output_token_ids)]
        if out.top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, t, tok(t)] for t, lp in row] for row in out.top_logprobs]
        if call.logprob_start >= 0 and out.prompt_logprobs is not None:  # the first prompt token's is None
            start = call.logprob_start
            meta["input_token_logprobs"] = [[lp, t, tok(t)] for lp, t in
                                            zip(out.prompt_logprobs[start:], out.prompt_token_ids[start:])]
    if out.routed_experts is not None:  # SGLang's encoding: base64 of the int32 array, rows of layers x top_k
        meta["routed_experts"] = base64.b64encode(out.routed_experts.astype("<i4").tobytes()).decode("ascii")
    return meta


def sglang_output(out: RolloutOutput, call: GenerateCall, tokenizer, started: float) -> dict:
    return {"text": out.text if out.text is not None else "", "output_ids": out.output_token_ids,
            "meta_info": meta_info(out, call, tokenizer, started)}


@router.post("/generate")
async def generate(request: Request):
    st = state_of(request)
    call = GenerateCall(await read_json(request))
    if call.routed and st.engine.limits.routing_off is not None:
        raise ApiError(400, "return_routed_experts needs a server started with --enable-return-routed-experts "
                            "(mixture-of-experts models only)", "return_routed_experts")
    started = time.perf_counter()
    if call.stream:
        st.admission.check(call.samples)
        return StreamingResponse(_sse(st, call, started), media_type="text/event-stream")
    with st.admission.admit(call.samples):
        try:
            outs = await until_done_or_gone(request, st.engine.generate_async(**call.kwargs()))
        except ClientGone:
            return JSONResponse({}, status_code=499)
    body = [sglang_output(o, call, st.engine.tokenizer, started) for o in outs]
    return JSONResponse(body if call.batched or len(body) > 1 else body[0])


def _sse(st, call: GenerateCall, started: float):
    """Cumulative outputs per request (SGLang's streaming shape), with `index`."""
    seen: dict[str, list[RolloutOutput]] = {}
    order: dict[str, int] = {}

    def render(delta: RolloutOutput) -> dict:
        deltas = seen.setdefault(delta.request_id, [])
        deltas.append(delta)
        out = sglang_output(merge_deltas(deltas), call, st.engine.tokenizer, started)
        out["index"] = order.setdefault(delta.request_id, len(order))
        return out

    return sse(st.admission, call.samples, st.engine.stream_async(**call.kwargs()), render)


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    """200 while the server runs; `invalid_weights` counts weights an update
    left half-written (generation is refused until they are rewritten)."""
    invalid = (await asyncio.to_thread(state_of(request).engine.metrics))["invalid_weights"]
    return {"status": "ok" if not invalid else "weights_invalid", "invalid_weights": invalid}


@router.get("/get_model_info")
async def model_info(request: Request):
    st = state_of(request)
    mc = st.engine.model_config
    return {"model_path": st.engine.config.model, "tokenizer_path": st.engine.config.tokenizer or
            st.engine.config.model, "is_generation": True, "served_model_name": st.model_name,
            "max_context_length": min(mc.max_position, st.engine.limits.kv_capacity),
            "weight_version": st.engine.weight_version}


@router.get("/weights_checksum")
async def weights_checksum(request: Request):
    """?names=a&names=b (default: every weight) -> {"weight_version",
    "checksums": {name: 16 hex digits}}, as fidelity.weights_checksum computes
    them on the trainer's tensors."""
    engine = state_of(request).engine
    names = request.query_params.getlist("names") or None
    try:
        sums = await asyncio.to_thread(engine.weights_checksum, names)
    except ValueError as e:
        raise ApiError(400, str(e), "names") from None
    except RuntimeError as e:
        raise ApiError(409, str(e), None) from None
    return {"weight_version": engine.weight_version, "checksums": sums}


@router.get("/get_weight_version")
async def weight_version(request: Request):
    return {"weight_version": state_of(request).engine.weight_version}


@router.get("/get_server_info")
async def server_info(request: Request):
    st = state_of(request)
    engine = dataclasses.asdict(st.engine.config)
    # what runs, where the config said "auto"
    engine.update(device=str(st.engine.device), dtype=str(st.engine.dtype).removeprefix("torch."),
                  cuda_graph=st.engine.config.cuda_graph and st.engine.device.type == "cuda")
    return {"engine": engine,
            "server": {k: v for k, v in dataclasses.asdict(st.cfg).items() if k != "api_key"},
            "kv_capacity_tokens": st.engine.limits.kv_capacity, "weight_version": st.engine.weight_version,
            "admitted_samples": st.admission.admitted}
