"""`rollout-engine serve`: every engine option and every server option as a
flag, generated from EngineConfig and ServerConfig. FastAPI and uvicorn are
imported only when the command runs."""
from __future__ import annotations

import argparse
import dataclasses
import typing

from rollout_engine.cli_args import add_engine_args, build_config, check_engine_args, engine_kwargs
from rollout_engine.script_args import UsageError, missing_extra
from rollout_engine.server import NEEDS
from rollout_engine.server.config import API_KEY_ENV, ServerConfig

SERVER_HELP = {
    "host": "address to listen on; 127.0.0.1 keeps the server local, 0.0.0.0 opens it to the network",
    "port": "TCP port (0: a free one, named in the serving line)",
    "api_key": f"require 'Authorization: Bearer KEY' on every route but /health (or set ${API_KEY_ENV})",
    "max_body_bytes": "largest request body accepted; larger ones get 413",
    "max_queued_requests": "most samples admitted at once; past it, 503 with Retry-After",
    "served_model_name": "the model id the OpenAI routes report; requests may name it or --model (default: --model)",
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    hints = typing.get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind[0], default=f.default,
                           help=SERVER_HELP[f.name])


def _check_address(host: str, port: int) -> int:
    """Before the model loads: the address must be one this machine can
    listen on and the port free. Returns the port (port 0: a free one, chosen
    now, so that the banner can say which)."""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            return s.getsockname()[1]
    except socket.gaierror as e:
        raise UsageError(f"argument --host: {host!r} is not an address here ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"argument --host: {host} is not an address of this machine") from None
        raise UsageError(f"argument --port: cannot listen on {host}:{port} ({e.strerror})") from None


def cmd_serve(args: argparse.Namespace) -> int:
    config = build_config(args)
    check_engine_args(config)
    missing = missing_extra(NEEDS, "server")
    if missing:
        raise UsageError(f"serve needs {missing}")
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    if options["api_key"] is not None and not options["api_key"].strip():
        raise UsageError("argument --api-key: empty; leave the flag out to serve without a key")
    if options["served_model_name"] is not None and not options["served_model_name"].strip():
        raise UsageError("argument --served-model-name: empty; leave the flag out to serve under the model's name")
    options["api_key"] = options["api_key"] or ServerConfig.env_api_key()
    try:
        ServerConfig(**options)
    except ValueError as e:
        raise UsageError(f"argument --{str(e).split()[0].replace('_', '-')}: {str(e).split(' ', 1)[1]}") from None
    options["port"] = _check_address(options["host"], options["port"])
    from rollout_engine import RolloutEngine
    from rollout_engine.server import serve

    kwargs = engine_kwargs(args)
    engine = RolloutEngine(kwargs.pop("model"), **kwargs)
    host, port = options.pop("host"), options.pop("port")
    if args.log_level:  # else serve()'s default
        options["log_level"] = args.log_level
    name = options["served_model_name"]
    served = f" as {name}" if name and name != config.model else ""
    serve(engine, host, port, ready=lambda url: print(f"rollout-engine: serving {config.model}{served} on {url}",
                                                      flush=True), **options)
    return 0
