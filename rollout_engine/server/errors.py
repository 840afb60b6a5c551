"""Error answers in one JSON shape (OpenAI's), for every route:
{"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error",
         409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error",
         503: "server_overloaded"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


# The member of a union type pydantic tried, which it appends to the field's
# location ("weight_version.int" for an int | str field given 1.5).
_UNION_MEMBER = re.compile(r"(int|str|float|bool|none|bytes|(list|dict|tuple|set|function-\w+|json-or-python)\[.*\])$")


# The engine's refusals start with the argument they refuse ("input_ids contains ...", "request 0:
# sampling_params.top_p must ..."); the routes' own names for those arguments (None: not a route's field).
_LEADING_FIELD = re.compile(r"(?:request \d+: )?(input_ids|request_ids|sampling_params\.[a-z_]+)\b")
_NATIVE_NAMES = {"input_ids": "input_ids", "request_ids": "rid"}
_OPENAI_NAMES = {"input_ids": "prompt"}  # the sampling fields sit at the top of an OpenAI body


def named_field(message: str, path: str) -> str | None:
    """The request field an engine ValueError's message starts with, as
    the route at `path` names it, or None."""
    m = _LEADING_FIELD.match(message)
    if m is None:
        return None
    name, openai = m.group(1), path.startswith("/v1/")
    if name.startswith("sampling_params."):
        return name.removeprefix("sampling_params.") if openai else name
    return (_OPENAI_NAMES if openai else _NATIVE_NAMES).get(name)


def _field(loc) -> str:
    parts = [str(p) for p in loc if p != "body"]
    while len(parts) > 1 and _UNION_MEMBER.fullmatch(parts[-1]):
        parts.pop()
    return ".".join(parts) or "body"


def install(app) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = _field(first.get("loc", ()))
        return error_response(400, f"{field}: {first.get('msg', 'invalid')}", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError):  # the engine's validation: names the field
        return error_response(400, str(exc), named_field(str(exc), request.url.path))

    @app.exception_handler(RuntimeError)
    async def _conflict(_: Request, exc: RuntimeError):  # paused, released, shut down: the state refuses it
        return error_response(409, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):  # a bug: say what, keep serving
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
