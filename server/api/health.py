"""Open routes (no key): /health, /version, /load, /metrics. Health reports the sleep state without failing:
a sleeping server is healthy, it is just not serving; only a dead engine answers 503."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server import __version__

router = APIRouter()
log = logging.getLogger("sleepserve.api")

POOL_SCRAPE_TIMEOUT_S = 2.0


@router.get("/health")
async def health(request: Request) -> Response:
    engine = request.app.state.engine
    if engine.dead is not None:
        return JSONResponse({"status": "dead", "detail": f"{engine.dead}; restart the server"},
                            status_code=503)
    state = engine.state
    body: dict[str, Any] = {"status": "ok" if state.name == "awake" else state.name}
    full = state.as_dict()
    body.update({k: full[k] for k in ("is_sleeping", "level", "sleeping_tags", "paused", "draining",
                                      "weights_valid")})
    return JSONResponse(body)


@router.get("/version")
async def version(request: Request) -> dict[str, Any]:
    return {"version": __version__, "model": request.app.state.served_model_name,
            "weight_version": request.app.state.engine.state.weight_version}


@router.get("/load")
async def load(request: Request) -> dict[str, Any]:
    """vLLM's server_load (generation requests in progress, held ones included) and where they are:
    sequences running and waiting in the engine, requests held while the server is paused or asleep
    (by reason: paused, sleeping, draining, weights_invalid)."""
    return asdict(request.app.state.engine.load())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    engine = request.app.state.engine
    ranks = None
    try:
        # Pool stats are read on the engine thread; a sleep or wake in progress holds the pool, and a
        # scrape must not hang on it: past the timeout, this scrape goes without the pool gauges.
        ranks = (await asyncio.wait_for(engine.snapshot(), POOL_SCRAPE_TIMEOUT_S))["ranks"]
    except asyncio.TimeoutError:
        log.debug("pool stats not ready within %.1f s; scraping without them", POOL_SCRAPE_TIMEOUT_S)
    except Exception as e:  # a dead engine still has metrics worth reading
        log.debug("pool stats unavailable: %s", e)
    return Response(request.app.state.metrics.render(ranks), media_type=CONTENT_TYPE_LATEST)
