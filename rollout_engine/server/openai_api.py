"""OpenAI-compatible routes: /v1/models, /v1/completions,
/v1/chat/completions (streaming with `data: [DONE]`, `usage`, logprobs in
OpenAI's shape). Besides OpenAI's fields, the sampling extensions RL
frameworks send to SGLang and vLLM (`ignore_eos`, `top_k`, `min_p`,
`stop_token_ids`) are honoured. A field the server would not honour
(an unknown name or a typo, `logit_bias`, `tools`, a JSON response format)
is a 400 naming it, never silently dropped."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from rollout_engine.outputs import RolloutOutput
from rollout_engine.server.errors import ApiError
from rollout_engine.server.params import logprob_count, make_params, openai_kwargs
from rollout_engine.server.sse import sse
from rollout_engine.server.state import ClientGone, read_json, state_of, until_done_or_gone

router = APIRouter(prefix="/v1")

Number = Union[StrictInt, float]


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    n: StrictInt = 1
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    # SGLang / vLLM extensions
    ignore_eos: StrictBool = False
    top_k: StrictInt | None = None
    min_p: Number | None = None
    stop_token_ids: list[StrictInt] | None = None
    # accepted only where they change nothing
    user: str | None = None
    metadata: dict | None = None
    store: StrictBool | None = None
    logit_bias: dict | None = None
    best_of: StrictInt | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    service_tier: str | None = None


def _check_unsupported(body: _Common) -> None:
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if body.best_of not in (None, body.n):
        raise ApiError(400, "best_of is not supported (only equal to n)", "best_of")
    if body.response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format is not supported (only {'type': 'text'})", "response_format")
    if body.tools or body.tool_choice not in (None, "none"):
        raise ApiError(400, "tools are not supported", "tools")


class CompletionBody(_Common):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: not used by a chat template here
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


def _check_model(st, name: str) -> None:
    if name not in (st.model_name, st.engine.config.model):
        also = f" (or {st.engine.config.model!r})" if st.engine.config.model != st.model_name else ""
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {st.model_name!r}{also}", "model")


def _usage(outs: list[RolloutOutput], prompts: list[int]) -> dict:
    prompt = sum(prompts)
    completion = sum(len(o.output_token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompt_inputs(prompt) -> tuple[list[str] | None, list[list[int]] | None]:
    if isinstance(prompt, str) and prompt:
        return [prompt], None
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, str) and p for p in prompt):
        return list(prompt), None
    if all(isinstance(p, int) for p in prompt):
        return None, [list(prompt)]
    if all(isinstance(p, list) and p for p in prompt):
        return None, [list(p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, or a list of such lists",
                   "prompt")


async def _run(request: Request, st, work):
    try:
        return await until_done_or_gone(request, work)
    except ClientGone:
        return None


# ---- completions ----------------------------------------------------------------------
def _completion_logprobs(out: RolloutOutput, tok) -> dict | None:
    if out.output_logprobs is None:
        return None
    tokens = [tok(t) for t in out.output_token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None
    if out.top_logprobs is not None:
        top = [{tok(t): lp for t, lp in row} for row in out.top_logprobs]
    return {"tokens": tokens, "token_logprobs": out.output_logprobs, "top_logprobs": top, "text_offset": offsets}


async def _body(request: Request, model: type[BaseModel]):
    """The JSON body as `model`, whatever the Content-Type (curl's -d sends
    form encoding); a bad field is a 400 naming it."""
    from pydantic import ValidationError

    try:
        return model.model_validate(await read_json(request))
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{field}: {first['msg']}", field) from None


async def _request(request: Request, model: type[_Common]):
    """The parsed body, checked against the served model and the fields
    this server does not honour; and the server state."""
    body = await _body(request, model)
    st = state_of(request)
    _check_model(st, body.model)
    _check_unsupported(body)
    return body, st


@router.post("/completions")
async def completions(request: Request):
    body, st = await _request(request, CompletionBody)
    if body.echo:
        raise ApiError(400, "echo is not supported", "echo")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    top = logprob_count(body.logprobs, "logprobs", 5)
    kw = openai_kwargs(body, body.max_tokens, 16)
    params = make_params(**kw, top_logprobs=top)
    prompts, ids = _prompt_inputs(body.prompt)
    count = len(prompts or ids)
    want_logprobs = body.logprobs is not None
    tok = _token_text(st.engine.tokenizer)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    call = dict(prompts=prompts, input_ids=ids, sampling_params=params)
    if body.stream:
        st.admission.check(count * body.n)
        return StreamingResponse(_stream_completions(st, call, count * body.n, rid, created, body, tok, want_logprobs),
                                 media_type="text/event-stream")
    with st.admission.admit(count * body.n):
        outs = await _run(request, st, st.engine.generate_async(**call))
    if outs is None:
        return JSONResponse({}, status_code=499)
    choices = [{"index": i, "text": o.text or "", "finish_reason": o.finish_reason,
                "logprobs": _completion_logprobs(o, tok) if want_logprobs else None} for i, o in enumerate(outs)]
    prompt_lens = [len(o.prompt_token_ids) for o in outs[:: body.n]]
    return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
            "choices": choices, "usage": _usage(outs, prompt_lens), "weight_version": st.engine.weight_version}


def _stream_completions(st, call, samples, rid, created, body, tok, want_logprobs):
    index: dict[str, int] = {}
    outs: dict[str, list[RolloutOutput]] = {}

    def render(d: RolloutOutput) -> dict:
        i = index.setdefault(d.request_id, len(index))
        outs.setdefault(d.request_id, []).append(d)
        choice = {"index": i, "text": d.text or "", "finish_reason": d.finish_reason,
                  "logprobs": _completion_logprobs(d, tok) if want_logprobs else None}
        return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                "choices": [choice]}

    def tail() -> dict | None:
        if not (body.stream_options or {}).get("include_usage"):
            return None
        return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                "choices": [], "usage": _stream_usage(outs, body.n)}

    return sse(st.admission, samples, st.engine.stream_async(**call), render, tail)


def _stream_usage(outs: dict[str, list[RolloutOutput]], n: int) -> dict:
    finals = [ds[-1] for ds in outs.values()]
    completion = sum(len(d.output_token_ids) for ds in outs.values() for d in ds)
    prompt = sum(len(f.prompt_token_ids) for f in finals[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(tokenizer):
    def tok(t: int) -> str:
        return tokenizer.decode([t]) if tokenizer is not None else str(t)
    return tok


# ---- chat -----------------------------------------------------------------------------
def _content(message: ChatMessage, index: int) -> str:
    if message.content is None and message.role != "assistant":  # as OpenAI: only an assistant's may be left out
        raise ApiError(400, f"messages[{index}]: a {message.role} message needs its content", "messages.content")
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, "only text content parts are supported", "messages.content")
        parts.append(part["text"])
    return "".join(parts)


def _chat_logprobs(out: RolloutOutput, tok) -> dict | None:
    if out.output_logprobs is None:
        return None
    content = []
    for k, (t, lp) in enumerate(zip(out.output_token_ids, out.output_logprobs)):
        text = tok(t)
        tops = []
        if out.top_logprobs is not None:
            tops = [{"token": tok(i), "logprob": v, "bytes": list(tok(i).encode())} for i, v in out.top_logprobs[k]]
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": tops})
    return {"content": content}


@router.post("/chat/completions")
async def chat(request: Request):
    body, st = await _request(request, ChatBody)
    if st.engine.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so no chat template", "messages")
    top = logprob_count(body.top_logprobs, "top_logprobs") if body.logprobs else 0
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = make_params(**openai_kwargs(body, limit, 256), top_logprobs=top)
    messages = [{"role": m.role, "content": _content(m, i)} for i, m in enumerate(body.messages)]
    try:
        ids = st.engine.apply_chat_template(messages)
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages
        raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
    tok = _token_text(st.engine.tokenizer)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    call = dict(input_ids=[ids], sampling_params=params)
    if body.stream:
        st.admission.check(body.n)
        return StreamingResponse(_stream_chat(st, call, rid, created, body, tok), media_type="text/event-stream")
    with st.admission.admit(body.n):
        outs = await _run(request, st, st.engine.generate_async(**call))
    if outs is None:
        return JSONResponse({}, status_code=499)
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text or ""},
                "logprobs": _chat_logprobs(o, tok) if body.logprobs else None, "finish_reason": o.finish_reason}
               for i, o in enumerate(outs)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": st.model_name,
            "choices": choices, "usage": _usage(outs, [len(ids)]), "weight_version": st.engine.weight_version}


def _stream_chat(st, call, rid, created, body: ChatBody, tok):
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name}
    index: dict[str, int] = {}
    outs: dict[str, list[RolloutOutput]] = {}

    def render(d: RolloutOutput) -> dict:
        first = d.request_id not in index
        i = index.setdefault(d.request_id, len(index))
        outs.setdefault(d.request_id, []).append(d)
        delta: dict[str, Any] = {"content": d.text or ""}
        if first:
            delta["role"] = "assistant"
        choice = {"index": i, "delta": delta, "finish_reason": d.finish_reason,
                  "logprobs": _chat_logprobs(d, tok) if body.logprobs else None}
        return {**head, "choices": [choice]}

    def tail() -> dict | None:
        if not (body.stream_options or {}).get("include_usage"):
            return None
        return {**head, "choices": [], "usage": _stream_usage(outs, body.n)}

    return sse(st.admission, body.n, st.engine.stream_async(**call), render, tail)


@router.get("/models")
async def models(request: Request):
    st = state_of(request)
    card = {"id": st.model_name, "object": "model", "created": 0, "owned_by": "rollout-engine",
            "max_model_len": st.engine.model_config.max_position}
    return {"object": "list", "data": [card]}
