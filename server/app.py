"""The FastAPI app around one AsyncEngine, and `serve`, which runs it under uvicorn.

The engine is built before uvicorn starts, so a bad model path, a bad flag value or a KV cache
that does not fit fails at once with a clear message and exit code 1, before any port is bound.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import Depends, FastAPI

from server import __version__
from server.api import admin, docs, health, openai, weight_transfer
from server.api.errors import install_error_handlers
from server.api.guard import check_dev_request
from server.api.middleware import BodyLimit, ContainErrors
from server.api.openapi import install_openapi
from server.api.settings import ServerSettings
from server.api.tokens import Tokens
from server.config import EngineConfig
from server.engine.engine import AsyncEngine
from server.logging_setup import AccessLogMiddleware, configure_logging
from server.metrics import ServerMetrics

log = logging.getLogger("sleepserve.server")


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            # Joining the engine thread can take a step's time; keep the loop free meanwhile.
            if app.state.weight_transfer is not None:
                await asyncio.to_thread(app.state.weight_transfer.shutdown)
            await asyncio.to_thread(engine.shutdown)
            app.state.tokens.close()
            app.state.shut_down = True

    # The docs routes are our own (docs.py): behind the key, or off with --no-docs.
    app = FastAPI(title="sleepserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, description="OpenAI-compatible inference server whose memory can sleep and wake.")
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = ServerMetrics(engine, engine.core.served_model_name)
    app.state.tokens = Tokens(engine.core.model_path, engine.core.max_model_len)
    app.state.served_model_name = engine.core.served_model_name
    app.state.started_at = int(time.time())
    app.state.shut_down = False
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.state.weight_transfer = None
    if settings.dev_mode:
        app.include_router(admin.router, dependencies=[Depends(check_dev_request)])
        app.include_router(weight_transfer.router, dependencies=[Depends(check_dev_request)])
        if settings.weight_transfer_config is not None:
            app.state.weight_transfer = weight_transfer.WeightTransferService(engine, settings.weight_transfer_config)
    if settings.docs:
        app.include_router(docs.router)
    install_openapi(app)
    # Outermost last: the access log sees every answer, ContainErrors every bug, BodyLimit every body.
    app.add_middleware(BodyLimit)
    app.add_middleware(ContainErrors)
    app.add_middleware(AccessLogMiddleware)
    return app


def startup_lines(engine: AsyncEngine, settings: ServerSettings) -> list[str]:
    core = engine.core
    plan = core.kv_plan
    dtype = str(core.dtype).removeprefix("torch.")
    admin_key = "admin key required" if settings.effective_admin_key else "no admin key"
    return [
        f"sleepserve {__version__}: model {core.served_model_name!r} from {core.model_path}",
        f"device {core.device}, dtype {dtype}, weights loaded in {core.load_seconds:.1f} s "
        f"(weight_version {core.weight_version!r})",
        f"KV cache: {plan.usable_blocks} blocks of {plan.block_size} tokens = {plan.bytes / 2**30:.2f} GiB "
        f"({plan.capacity_tokens} tokens); max model len {core.max_model_len}, "
        f"max num seqs {core.config.max_num_seqs}, prefix caching "
        f"{'on' if core.config.enable_prefix_caching else 'off'}",
        "weight transfer: " + (f"{settings.weight_transfer_config.backend} (POST /init_weight_transfer_engine, "
                               "/start_weight_update, /update_weights, /finish_weight_update)"
                               if settings.weight_transfer_config and settings.dev_mode else "off"),
        "sleep mode dev routes: " + (f"on (POST /sleep, /wake_up, /update_weights, ...; {admin_key})"
                                     if settings.dev_mode else "off (start with --dev-mode to enable)"),
        "API key: " + ("required on /v1/*" if settings.api_key else "none (anyone who can connect may generate)"),
    ]


class GracefulServer:
    """uvicorn's Server, with SIGTERM made graceful (built lazily: uvicorn is imported by serve()).

    On SIGTERM (or Ctrl-C) uvicorn stops accepting and waits for the requests in flight; after
    `grace` seconds every engine request still running is aborted, so each stream ends with
    finish_reason "abort" and [DONE] and each non-streamed request answers, before uvicorn's own
    deadline (grace + 5 s) would cancel tasks mid-response. SIGTERM then exits 0: it is the normal
    way to stop a service (uvicorn re-raises the signal, which made the exit status 143)."""

    @staticmethod
    def make(config, engine: AsyncEngine, grace: float):
        import signal

        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame) -> None:
                super().handle_exit(sig, frame)
                if sig == signal.SIGTERM:
                    self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

            async def shutdown(self, sockets=None) -> None:
                async def abort_after_grace() -> None:
                    await asyncio.sleep(grace)
                    if engine.dead is None:
                        n = await engine.call(lambda core: core.abort_all())
                        if n:
                            log.info("shutdown: aborted %d request(s) still running after %.0f s", n, grace)

                aborter = asyncio.ensure_future(abort_after_grace())
                try:
                    await super().shutdown(sockets)
                finally:
                    aborter.cancel()

        return Server(config)


def serve(settings: ServerSettings, config: EngineConfig) -> int:
    """Load, then serve until interrupted. Returns the process exit code (see README, "Exit codes")."""
    import uvicorn

    from allocator import PoolError
    from server.model.default_model import ModelNotFoundError
    from server.model.loader import WeightLoadError

    configure_logging(settings.log_level)
    try:
        engine = AsyncEngine(config)
    except (ModelNotFoundError, WeightLoadError, PoolError, ValueError, OSError) as e:
        log.error("could not start: %s", e)
        return 1
    except KeyboardInterrupt:
        return 130
    for line in startup_lines(engine, settings):
        log.info(line)

    try:
        app = create_app(engine, settings)
    except ValueError as e:  # a weight-transfer backend this device cannot run
        log.error("could not start: %s", e)
        engine.shutdown()
        return 1
    grace = settings.shutdown_grace_period
    server = GracefulServer.make(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=grace + 5, server_header=False), engine, grace)
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C after its graceful shutdown; the shutdown is done, so no traceback.
        return 130
    finally:
        if not app.state.shut_down:  # uvicorn never ran the lifespan (e.g. it could not bind)
            engine.shutdown()
    return 0 if server.started else 1
