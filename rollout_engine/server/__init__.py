"""The HTTP server: `serve(engine_or_kwargs, host, port)` or
`rollout-engine serve`. Needs the `server` extra (FastAPI, uvicorn,
prometheus-client), imported only here."""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Mapping

from rollout_engine.interrupts import ctrl_c_ignored

NEEDS = ("fastapi", "uvicorn", "prometheus_client")  # the `server` extra's modules the server imports

# A stop that waits this long for the step in flight says so (and what a further Ctrl-C does).
SLOW_STOP_S = 1.0
STOPPING = "rollout-engine server: stopping once the step in flight ends (a long prompt's on a CPU can take seconds)"

# Idle keep-alive connections stay open this long (uvicorn's default is 5 s).
# Clients with connection pools (RL frameworks, routers) reuse a connection
# after pauses; a server that closed it just before gets the request on a
# dead socket, which the client sees as a read error.
KEEP_ALIVE_S = 75


def serve(engine_or_kwargs: Any, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          ready: Callable[[str], None] | None = None, log_level: str = "warning", **server_options) -> None:
    """Serve one engine until SIGINT/SIGTERM: then stop accepting, abort
    what runs (those requests answer with finish_reason "abort"), shut the
    engine down (GPU memory freed, TP workers gone) and return.

    `engine_or_kwargs`: a RolloutEngine, or the keyword arguments of one
    (`model` included), built here. `ready`: called with the server's URL
    once its port accepts connections. `log_level`: uvicorn's ("info": a
    line per request). `server_options`: ServerConfig fields."""
    import uvicorn

    from rollout_engine.server.app import build_app
    from rollout_engine.server.config import ServerConfig

    cfg = ServerConfig(host=host, port=port, api_key=api_key or ServerConfig.env_api_key(), **server_options)
    if isinstance(engine_or_kwargs, Mapping):
        from rollout_engine import RolloutEngine

        kwargs = dict(engine_or_kwargs)
        engine = RolloutEngine(kwargs.pop("model"), **kwargs)
    else:
        engine = engine_or_kwargs
    app = build_app(engine, cfg)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and ready is not None:
                ready(f"http://{cfg.host}:{self.bound_port()}")

        def bound_port(self) -> int:
            """The port asked for, or the one the system picked for port 0."""
            for server in getattr(self, "servers", ()):
                for sock in server.sockets:
                    return sock.getsockname()[1]
            return cfg.port

        stopping = False

        def handle_exit(self, sig, frame) -> None:
            if self.stopping:  # a further signal while the abort waits for the step in flight
                print(STOPPING, file=sys.stderr, flush=True)
                return
            if not self.should_exit:
                self.stopping = True
                # The abort is applied between two steps: after the one in flight, which a long prompt on a
                # CPU can make seconds long. Say so if it takes a while.
                note = threading.Timer(SLOW_STOP_S, lambda: print(STOPPING, file=sys.stderr, flush=True))
                note.daemon = True
                note.start()
                try:
                    engine.abort()  # in-flight requests end now, with "abort", and get their answers
                except RuntimeError:
                    pass
                finally:
                    note.cancel()
                    self.stopping = False  # a later signal goes to uvicorn: its second one forces the exit
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal once it has shut down (the process
            # would die of it); this server shuts the engine down and exits 0.
            captured = getattr(self, "_captured_signals", None)
            if captured is not None:
                captured.clear()

    # lifespan off: the app has no startup or shutdown handlers, and a second
    # Ctrl-C (uvicorn's forced exit) logged the cancelled lifespan task's traceback
    server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, log_config=_logging(),
                                   timeout_graceful_shutdown=3, limit_concurrency=None,
                                   timeout_keep_alive=KEEP_ALIVE_S, lifespan="off"))
    try:
        server.run()
    finally:
        with ctrl_c_ignored():  # a further Ctrl-C while it stops would interrupt the shutdown at a random line
            engine.shutdown()


def _logging() -> dict:
    """uvicorn's logging, every line on stderr (its request lines went to
    stdout) and in the engine's form: time, level, logger, message."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    from rollout_engine.logs import DATEFMT, FORMAT

    cfg = copy.deepcopy(LOGGING_CONFIG)
    for handler in cfg["handlers"].values():
        handler["stream"] = "ext://sys.stderr"
    cfg["formatters"]["default"]["fmt"] = FORMAT
    cfg["formatters"]["access"]["fmt"] = FORMAT.replace("%(message)s",
                                                        '%(client_addr)s - "%(request_line)s" %(status_code)s')
    for formatter in cfg["formatters"].values():
        formatter["datefmt"] = DATEFMT
        formatter["use_colors"] = False
    return cfg
