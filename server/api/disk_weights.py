"""Loading weights from disk for /update_weights {"path"} and SGLang's /update_weights_from_disk.

The engine process reads the files on one of its command threads (checkpoint_read.py), so a file that
blocks (a FIFO, a hung mount) holds up this one request, never the engine thread or /health; the
engine thread only checks names and shapes and copies from memory (server/engine/commands.py).
"""
from __future__ import annotations

from typing import Any

from fastapi import Request


async def load_from_disk(request: Request, path: str | None, weight_version: str | None) -> dict[str, Any]:
    """The engine's update report; no path: the served checkpoint again."""
    return await request.app.state.engine.load_weights(path or None, weight_version)
