"""The FastAPI app around one EngineClient, and `serve`, which runs it under uvicorn.

The engine process is started and has loaded the model before uvicorn starts, so a bad model path,
a bad flag value or a KV cache that does not fit fails at once with a clear message and exit code 1,
before any port is bound. If the engine process dies later, the server answers 503 and exits (3).
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import Depends, FastAPI

from server import __version__
from server.api import admin, docs, health, openai, profiling, weight_transfer
from server.api.errors import install_error_handlers
from server.api.guard import check_dev_request
from server.api.loop_watch import watch_loop
from server.api.middleware import BodyLimit, ContainErrors
from server.api.openapi import install_openapi
from server.api.settings import ServerSettings
from server.api.streaming import ServerSend
from server.api.tokens import TokenizerPreload, Tokens
from server.api.servers import (MAX_AUTO_API_SERVERS, START_TIMEOUT_S, STOP_TIMEOUT_S, OtherApiServers,
                                listening_sockets, metrics_folder)
from server.config import EngineConfig, profiler_dir
from server.api.engine_client import EngineClient, EngineStartError
from server.api.spawn import SpawnedEngine, spawn_engine
from server.heap import freeze_startup_heap
from server.logging_setup import AccessLogMiddleware, configure_logging
from server.api.metrics import ServerMetrics, share_metrics

log = logging.getLogger("sleepserve.server")

ENGINE_DIED = 3  # exit code when the engine process died under the server (docs/operations.md, "Shutdown and exit codes")


def create_app(engine: EngineClient, settings: ServerSettings, others: OtherApiServers | None = None,
               metrics_dir: str | None = None, preload: TokenizerPreload | None = None) -> FastAPI:
    """others: the API processes this one started (--api-server-count), which must exit before the engine
    stops; metrics_dir: the folder where every API process keeps its metrics (None with one API process);
    preload: the tokenizer this process started loading while the engine loaded."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.attach()
        if others is not None:  # ready means every API process listens: wait for theirs
            await asyncio.to_thread(others.wait_ready, START_TIMEOUT_S)
        freeze_startup_heap("API process")
        publisher = asyncio.ensure_future(app.state.metrics.publish_every(1.0)) if metrics_dir else None
        watch = asyncio.ensure_future(watch_loop(f"API process {os.getpid()}"))
        try:
            yield
        finally:
            watch.cancel()
            if publisher is not None:
                publisher.cancel()
            if others is not None:  # their requests in flight use the engine until they end
                await asyncio.to_thread(others.wait, settings.shutdown_grace_period + STOP_TIMEOUT_S)
            await engine.shutdown()
            app.state.tokens.close()
            app.state.shut_down = True

    # The docs routes are our own (docs.py): behind the key, or off with --no-docs.
    app = FastAPI(title="sleepserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, description="OpenAI-compatible inference server whose memory can sleep and wake.")
    app.state.engine = engine
    app.state.settings = settings
    info = engine.info
    app.state.metrics = ServerMetrics(engine, info.served_model_name, shared=metrics_dir is not None)
    app.state.tokens = Tokens(Path(info.model_path), info.max_model_len, preload)
    engine.set_stream_tokenizer(app.state.tokens.stream_tokenizer)
    app.state.served_model_name = info.served_model_name
    app.state.started_at = int(time.time())
    app.state.shut_down = False
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    # The receiver itself lives in the engine process (it writes the model's tensors); this is its config.
    app.state.weight_transfer = settings.weight_transfer_config if settings.dev_mode else None
    if settings.dev_mode:
        app.include_router(admin.router, dependencies=[Depends(check_dev_request)])
        app.include_router(weight_transfer.router, dependencies=[Depends(check_dev_request)])
    if settings.docs:
        app.include_router(docs.router)
    if profiler_dir() is not None:  # vLLM's switch for its profiling routes
        app.include_router(profiling.router)
    install_openapi(app)
    # Outermost last: the access log sees every answer, ContainErrors every bug, BodyLimit every body.
    app.add_middleware(BodyLimit)
    app.add_middleware(ContainErrors)
    app.add_middleware(AccessLogMiddleware)
    return app


def startup_lines(engine: EngineClient, settings: ServerSettings) -> list[str]:
    info = engine.info
    plan = info.kv_plan
    admin_key = "admin key required" if settings.effective_admin_key else "no admin key"
    return [
        f"sleepserve {__version__}: model {info.served_model_name!r} from {info.model_path}",
        f"engine process pid {info.pid} (API process pid {os.getpid()}): device {info.device}, dtype {info.dtype}, "
        f"weights loaded in {info.load_seconds:.1f} s (weight_version {engine.state.weight_version!r})"
        + (f"; tensor parallel over {len(info.ranks)} ranks: "
           + ", ".join(f"rank {r['rank']} pid {r['pid']} on {r['device']}" for r in info.ranks)
           if len(info.ranks) > 1 else ""),
        f"KV cache: {plan.usable_blocks} blocks of {plan.block_size} tokens = {plan.bytes / 2**30:.2f} GiB "
        f"({plan.capacity_tokens} tokens); max model len {info.max_model_len}, "
        f"max num seqs {info.config.max_num_seqs}, prefix caching "
        f"{'on' if info.config.enable_prefix_caching else 'off'}",
        "weight transfer: " + (f"{settings.weight_transfer_config.backend} (POST /init_weight_transfer_engine, "
                               "/start_weight_update, /update_weights, /finish_weight_update)"
                               if settings.weight_transfer_config and settings.dev_mode else "off"),
        "sleep mode dev routes: " + (f"on (POST /sleep, /wake_up, /update_weights, ...; {admin_key})"
                                     if settings.dev_mode else "off (start with --dev-mode to enable)"),
        "API key: " + ("required on /v1/*" if settings.api_key else "none (anyone who can connect may generate)"),
        f"API processes: {settings.api_server_count} (--api-server-count; auto, the default, picks 1 per 2 cores "
        f"beyond the engine's 2, at most {MAX_AUTO_API_SERVERS}; this host has {os.cpu_count()} cores)",
        f"HTTP: {_http_stack()}",
    ]


def _http_stack() -> str:
    """What uvicorn's "auto" picks: uvloop and httptools when installed (requirements/base.txt lists
    them; they cut the API process's CPU per streamed chunk), else asyncio's loop and h11."""
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio (uvloop not installed)"
    parser = "httptools" if importlib.util.find_spec("httptools") else "h11 (httptools not installed)"
    return f"event loop {loop}, parser {parser}"


class GracefulServer:
    """uvicorn's Server, with SIGTERM made graceful (built lazily: uvicorn is imported by serve()).

    On SIGTERM (or Ctrl-C) uvicorn stops accepting and waits for the requests in flight; after
    `grace` seconds every engine request still running is aborted, so each stream ends with
    finish_reason "abort" and [DONE] and each non-streamed request answers, before uvicorn's own
    deadline (grace + 5 s) would cancel tasks mid-response. SIGTERM then exits 0: it is the normal
    way to stop a service (uvicorn re-raises the signal, which made the exit status 143)."""

    @staticmethod
    def make(config, engine: EngineClient, grace: float, others: OtherApiServers | None = None,
             on_started: Callable[[], None] | None = None):
        import signal

        import uvicorn

        class Server(uvicorn.Server):
            exit_signal: int | None = None

            def handle_exit(self, sig: int, frame) -> None:
                self.exit_signal = sig
                if others is not None:  # at once: one that exits before this one's shutdown starts is not a death
                    others.stop()
                super().handle_exit(sig, frame)
                if sig == signal.SIGTERM:
                    self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if self.started and on_started is not None:
                    on_started()  # listening, the lifespan's start-up done

            async def shutdown(self, sockets=None) -> None:
                async def abort_after_grace() -> None:
                    await asyncio.sleep(grace)
                    engine.held.close(f"the server is shutting down (its {grace:g} s grace period ended while "
                                      "this request waited for it to wake or resume)")
                    if engine.dead is None:
                        n = await engine.abort_all()
                        if n:
                            log.info("shutdown: aborted %d request(s) still running after %.0f s", n, grace)

                if others is not None:
                    others.stop()  # they shut down gracefully beside this one; the lifespan waits for them
                aborter = asyncio.ensure_future(abort_after_grace())
                try:
                    await super().shutdown(sockets)
                finally:
                    aborter.cancel()

        return Server(config)


def serve(settings: ServerSettings, config: EngineConfig, spawned: SpawnedEngine | None = None) -> int:
    """Load, then serve until interrupted. Returns the process exit code (see docs/operations.md, "Shutdown and exit codes").
    spawned: the engine process, started by the CLI before its imports (spawn.py)."""
    configure_logging(settings.log_level)
    count = settings.api_server_count
    spawned = spawned or spawn_engine(count)
    preload = TokenizerPreload(config.model)  # while the engine loads: this process only waits meanwhile
    if count == 1:
        engine = _launch(settings, config, spawned)
        if not isinstance(engine, EngineClient):
            return engine
        return run_http(create_app(engine, settings, preload=preload), engine, settings)
    # Several API processes: the others start now, while the engine loads (each imports the web stack and loads
    # its tokenizer, then waits for the engine's Ready on its channel); the address is taken before the load.
    try:
        listeners = listening_sockets(settings.host, settings.port, count)
    except OSError as e:
        log.error("could not listen on %s:%d: %s", settings.host, settings.port, e)
        spawned.kill()
        return 1
    metrics_dir = metrics_folder()
    others = None
    engine: EngineClient | int | None = None
    app = None
    try:
        share_metrics(metrics_dir)
        others = OtherApiServers.start(settings, listeners[1:], spawned.spare, metrics_dir, config.model)
        spawned.spare = []  # theirs now
        engine = _launch(settings, config, spawned)
        if not isinstance(engine, EngineClient):
            return engine  # the engine could not start (said why)
        log.info("API processes: %d (pids %s), one engine process", count,
                 ", ".join(map(str, [os.getpid(), *others.pids])))
        app = create_app(engine, settings, others, metrics_dir, preload)
    except BaseException:
        log.exception("could not start the API processes")
        return 1
    finally:
        if app is None:  # the start failed, one way or the other: end what did start
            if others is not None:
                others.stop()
                others.wait(STOP_TIMEOUT_S)
            if isinstance(engine, EngineClient):
                engine.shutdown_now()
            else:
                spawned.kill()
            shutil.rmtree(metrics_dir, ignore_errors=True)
    try:
        return run_http(app, engine, settings, listeners[0], others)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _launch(settings: ServerSettings, config: EngineConfig, spawned: SpawnedEngine) -> EngineClient | int:
    """The engine, loaded (its start-up lines logged), or the exit code when it could not start."""
    transfer_config = settings.weight_transfer_config if settings.dev_mode else None
    try:
        engine = EngineClient.launch(config, transfer_config, settings.log_level, settings.api_server_count, spawned)
    except EngineStartError as e:
        log.error("could not start: %s", e)
        return 1
    except KeyboardInterrupt:
        return 130
    for line in startup_lines(engine, settings):
        log.info(line)
    return engine


def run_http(app: FastAPI, engine: EngineClient, settings: ServerSettings, listener: socket.socket | None = None,
             others: OtherApiServers | None = None, on_started: Callable[[], None] | None = None) -> int:
    """Serve `app` under uvicorn until it stops; the exit code. listener: a socket bound already (several API
    processes); None binds (host, port) here."""
    import uvicorn

    grace = settings.shutdown_grace_period
    server = GracefulServer.make(uvicorn.Config(
        ServerSend(app), host=settings.host, port=settings.port, log_config=None, access_log=False, lifespan="on",
        timeout_graceful_shutdown=grace + 5, server_header=False), engine, grace, others, on_started)
    died: list[BaseException | str] = []

    def on_death(error: BaseException | str) -> None:
        died.append(error)
        server.should_exit = True  # uvicorn stops accepting; requests in flight already got their 503

    engine.on_death = on_death
    if others is not None:
        others.watch(on_death)
    try:
        server.run(sockets=[listener] if listener is not None else None)
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C after its graceful shutdown; the shutdown is done, so no traceback.
        return 130
    finally:
        if not app.state.shut_down:  # uvicorn never ran the lifespan (e.g. it could not bind)
            if others is not None:
                others.stop()
                others.wait(STOP_TIMEOUT_S)
            engine.shutdown_now()
    if died:
        log.error("exiting: %s", died[0])
        return ENGINE_DIED
    if server.exit_signal == signal.SIGINT:
        # uvicorn's re-raised Ctrl-C does nothing in a process that started with SIGINT ignored (a
        # background job of a non-interactive shell): the exit status is the same all the same.
        return 130
    return 0 if server.started else 1
