"""What the HTTP layer needs beyond the engine's own configuration (server/config.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None          # guards /v1/*
    admin_api_key: str | None = None    # guards the dev-mode routes; falls back to api_key
    dev_mode: bool = False              # mount /sleep, /wake_up, ... (404 otherwise)
    log_level: str = "info"
    weight_transfer_config: Any = None  # a WeightTransferConfig: the backend that trainers push weights over

    @property
    def effective_admin_key(self) -> str | None:
        return self.admin_api_key or self.api_key
