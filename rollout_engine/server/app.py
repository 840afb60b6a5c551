"""The FastAPI application around one engine: authentication, a request
body limit, JSON bodies whatever their declared type, one error shape, and
the routers (native, OpenAI, RL controls, metrics)."""
from __future__ import annotations

import hmac

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_engine.server import controls, errors, metrics, native, openai_api
from rollout_engine.server.config import ServerConfig
from rollout_engine.server.errors import error_response
from rollout_engine.server.state import ServerState

OPEN_PATHS = ("/health",)


class BodyLimit:
    """413 for a body over the limit, by its Content-Length or, when it is
    streamed in chunks, as soon as the bytes read pass it."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = error_response(413, f"the request body is over the server's limit of {self.limit} bytes")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_big(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise errors.ApiError(413, f"the request body is over the server's limit of {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


class JsonBodies:
    """Every route reads a JSON body: one sent as a form (`curl -d`'s
    default type) or with no type is read as JSON too, on the control
    routes as on /generate."""

    FORM = (b"application/x-www-form-urlencoded", b"")

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            given = dict(headers).get(b"content-type", b"")
            if given.split(b";")[0].strip().lower() in self.FORM:
                kept = [(k, v) for k, v in headers if k != b"content-type"]
                scope = {**scope, "headers": kept + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class ApiKey:
    """Every route but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return await error_response(401, "missing or wrong API key (Authorization: Bearer KEY)")(
                    scope, receive, send)
        await self.app(scope, receive, send)


def build_app(engine, cfg: ServerConfig, model_name: str | None = None) -> FastAPI:
    app = FastAPI(title="rollout-engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(engine, cfg, model_name or cfg.served_model_name or engine.config.model)
    errors.install(app)
    for module in (native, openai_api, controls, metrics):
        app.include_router(module.router)
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    if cfg.api_key:
        app.add_middleware(ApiKey, key=cfg.api_key)
    return app
