"""The HTTP server's own settings (the engine's are an EngineConfig)."""
from __future__ import annotations

import os
from dataclasses import dataclass

API_KEY_ENV = "ROLLOUT_ENGINE_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # localhost only unless the user says otherwise
    port: int = 30000
    api_key: str | None = None  # every route but /health then needs "Authorization: Bearer KEY"
    max_body_bytes: int = 32 << 20  # larger request bodies get 413
    max_queued_requests: int = 1024  # samples admitted at once (queued or running); past it, 503 + Retry-After
    served_model_name: str | None = None  # the model id /v1/models reports (default: the model argument)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError("host must be an address such as 127.0.0.1 (0.0.0.0 for every interface), got "
                             f"{self.host!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be an integer >= 1, got {self.max_queued_requests!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError(f"served_model_name must be a non-empty string or None, got {self.served_model_name!r}")

    @staticmethod
    def env_api_key() -> str | None:
        return os.environ.get(API_KEY_ENV) or None
