"""What the HTTP layer needs beyond the engine's own configuration (server/config.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)        # guards /v1/*
    admin_api_key: str | None = field(default=None, repr=False)  # guards the dev-mode routes; falls back to api_key
    dev_mode: bool = False              # mount /sleep, /wake_up, ... (404 otherwise)
    log_level: str = "info"
    weight_transfer_config: Any = None  # a WeightTransferConfig: the backend that trainers push weights over
    allowed_hosts: tuple[str, ...] = ()  # Host / Origin names the dev routes accept beside the bound address
    docs: bool = True                   # serve /docs, /redoc, /openapi.json (behind the key when one is set)
    shutdown_grace_period: float = 10.0  # seconds streams may finish after SIGTERM before they are aborted
    api_server_count: int = 1           # API processes in front of the engine (server/api/servers.py)

    @property
    def effective_admin_key(self) -> str | None:
        return self.admin_api_key or self.api_key
