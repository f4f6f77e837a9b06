"""Loading weights from disk for /update_weights {"path"} and SGLang's /update_weights_from_disk.

The files are read on a worker thread (checkpoint_read.py), so a file that blocks (a FIFO, a hung
mount) holds up this one request, never the engine thread or /health; the engine thread only checks
names and shapes and copies from memory.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import Request

from server.engine.errors import ConflictError
from server.engine.sleep_state import AWAKE
from server.engine.tags import WEIGHTS
from server.model.checkpoint_read import read_checkpoint


async def load_from_disk(request: Request, path: str | None, weight_version: str | None) -> dict[str, Any]:
    """The engine's update report; no path: the served checkpoint again."""
    engine = request.app.state.engine
    core = engine.core
    if not path and core.config.load_format == "dummy":  # no file to read: the seeded random weights
        return await engine.call(lambda c: c.update_weights(weight_version=weight_version))
    if engine.state.tag_states.get(WEIGHTS, AWAKE) != AWAKE:
        raise ConflictError("the weights are asleep; wake them first with POST /wake_up?tags=weights")
    folder = Path(path).expanduser() if path else core.model_path
    named = await asyncio.to_thread(read_checkpoint, folder)
    return await engine.call(lambda c: c.update_weights(
        named_tensors=named.items(), weight_version=weight_version, read_from=str(folder), served=not path))
