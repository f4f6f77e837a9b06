"""The async engine: one background thread drives EngineCore; asyncio handlers await results.

Every call that changes engine state (add, abort, sleep, wake, update weights) runs as a command
on the engine thread, between steps, so transitions never interleave. Heavy compute releases the
GIL, so the event loop stays responsive while a step runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Callable

from server.config import EngineConfig
from server.engine.build import build_engine
from server.engine.core import EngineCore
from server.engine.errors import EngineDeadError, EngineUnavailableError
from server.engine.hold import HeldRequests, HoldPolicy
from server.engine.outputs import RequestOutput
from server.engine.params import SamplingParams
from server.engine.sleep_state import SleepReport, SleepState

log = logging.getLogger("sleepserve.engine")

MAX_CONSECUTIVE_FAILURES = 3

Settle = Callable[[Any, "BaseException | None"], None]


def _thread_future() -> tuple[asyncio.Future, Settle]:
    """A future of the running loop, and a function any thread may call once to settle it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        def apply() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        loop.call_soon_threadsafe(apply)

    return fut, settle


@dataclass(frozen=True)
class Load:
    """GET /load: how much work the server has (vLLM's server_load) and where it is."""
    server_load: int          # generation requests accepted and not finished, held ones included
    running: int              # sequences in the running batch
    waiting: int              # sequences waiting for the scheduler
    held: int                 # requests waiting for the server to wake, resume or get valid weights
    held_by_reason: dict[str, int]


class AsyncEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None):
        self.config = config
        self.core = core or build_engine(config)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self.stats = self.core.stats()  # refreshed after every command and step; the loop reads it
        self.held = HeldRequests(HoldPolicy(config.while_asleep, config.max_held_requests,
                                            config.held_request_timeout), lambda: self.state)
        self.core.sleep_control.listeners.append(self.held.state_changed)
        self._active = 0  # generate() calls in progress (GET /load's server_load)
        # Observers (metrics): called on the engine thread with the report of each sleep, pause, wake, resume.
        self.on_transition: list[Callable[[SleepReport], None]] = []
        # Observers (metrics): called on the engine thread with the tokens each step ran.
        self.on_step: list[Callable[[int], None]] = []

    @property
    def state(self) -> SleepState:
        """The sleep state the controller published last (safe to read from the event loop)."""
        return self.core.sleep_state

    def load(self) -> Load:
        return Load(server_load=self._active, running=self.stats.running, waiting=self.stats.waiting,
                    held=self.held.count, held_by_reason=dict(self.held.by_reason))

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sleepserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.core.close()

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        failures = 0
        while not self._stop:
            self._drain_commands()
            # Only mode=wait waits for the requests in flight; abort and keep sleep at once (between steps).
            if core.sleep_control.ready:
                self._finish_sleep()
            if core.can_step and self.dead is None:
                try:
                    core.step()
                    failures = 0
                    for fn in self.on_step if core.step_tokens else ():
                        fn(core.step_tokens)
                except Exception as e:  # a failed step must not take the server down...
                    log.exception("engine step failed; aborting the requests in flight")
                    self._fail_all(e)
                    failures += 1
                    if failures >= MAX_CONSECUTIVE_FAILURES:
                        # ...but a step that keeps failing (a lost device, a corrupted context)
                        # means nothing can be served: say so instead of failing every request.
                        log.critical("%d steps failed in a row; the engine is dead: %s", failures, e)
                        self.dead = e
                self.stats = core.stats()
            else:
                self._wake.wait(0.5)
                self._wake.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()
            self.stats = self.core.stats()

    def _fail_all(self, error: Exception) -> None:
        for req in list(self.core.requests.values()):
            cb, req.on_output = req.on_output, None  # the handler gets the error, not an abort
            self.core.abort_request(req.request_id)
            if cb is not None:
                cb(error)  # type: ignore[arg-type]

    def _finish_sleep(self) -> None:
        try:
            self.core.sleep_control.finish_sleep()  # its on_done settles the caller's future
        except BaseException:
            log.exception("sleep failed")
        self.stats = self.core.stats()

    def _notify(self, report: SleepReport) -> None:
        if not report.changed:
            return
        for fn in self.on_transition:
            try:
                fn(report)
            except Exception:
                log.exception("transition observer failed")

    # -- commands --------------------------------------------------------------------------------

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread, between steps, and await its result."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        fut, settle = _thread_future()

        def cmd() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(self.core)
            except BaseException as e:
                error = e
            self.stats = self.core.stats()
            settle(result, error)

        self._commands.put(cmd)
        self._wake.set()
        return await fut

    def refuse_now(self) -> None:
        """With --while-asleep reject, 503 at once while the engine cannot serve (no round trip)."""
        self.held.refuse_now()

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield outputs (each with its delta) until the request finishes. While the engine cannot serve,
        the request is held first (or refused, per HoldPolicy). Closing the iterator early (a client
        that went away) drops a held request and aborts an admitted one, freeing its KV blocks."""
        self._active += 1
        try:
            async with contextlib.aclosing(self._generate(request_id, prompt, prompt_token_ids, params)) as gen:
                async for out in gen:
                    yield out
        finally:
            self._active -= 1

    async def _generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                        params: SamplingParams) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def on_output(out: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        deadline = None
        while True:
            # Cancelled while held (the client left): nothing reached the engine, nothing to undo.
            deadline = await self.held.wait_until_servable(deadline)
            try:
                await self.call(lambda core: core.add_request(request_id, prompt, prompt_token_ids, params,
                                                              on_output))
                break
            except EngineUnavailableError:
                # The engine fell asleep between the check and the add: hold again (or refuse).
                if self.held.policy.while_asleep == "reject":
                    raise
            except asyncio.CancelledError:
                # Cancelled while the add waited for a step to end: the add still runs, so undo it, or the
                # request would run to max_tokens for nobody (abort is queued behind the add, FIFO).
                await self.abort(request_id)
                raise
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self.dead is None:
            await self.call(lambda core: core.abort_request(request_id))

    # -- sleep mode (the state machine is the core's SleepController; this only sequences it) -------

    async def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort",
                    clear_cache: bool = False) -> SleepReport:
        """Sleep (level 1, 2) or pause (level 0). abort and keep apply between two steps; wait first
        lets the requests in flight finish (refusing or holding new ones)."""
        fut, settle = _thread_future()

        def done(report: SleepReport | None, error: BaseException | None) -> None:
            if report is not None:
                self._notify(report)
            settle(report, error)

        def begin(core: EngineCore) -> None:
            report = core.sleep_control.begin_sleep(level, tags, mode, clear_cache, on_done=done)
            if report is not None:  # a repeat: nothing to wait for
                settle(report, None)

        await self.call(begin)
        self._wake.set()
        return await fut

    async def wake_up(self, tags: list[str] | None = None) -> SleepReport:
        def wake(core: EngineCore) -> SleepReport:
            report = core.sleep_control.wake_up(tags)
            self._notify(report)
            return report

        return await self.call(wake)

    async def resume(self) -> SleepReport:
        def resume(core: EngineCore) -> SleepReport:
            report = core.sleep_control.resume()
            self._notify(report)
            return report

        return await self.call(resume)

    async def snapshot(self) -> dict:
        """Sleep state, engine stats and pool stats, read consistently on the engine thread."""
        def read(core: EngineCore) -> dict:
            return {"state": core.sleep_state.as_dict(), "stats": asdict(core.stats()),
                    "pool": core.pool.stats().as_dict()}
        return await self.call(read)
