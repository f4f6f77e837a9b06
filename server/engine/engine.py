"""The async engine: one background thread drives EngineCore; asyncio handlers await results.

Every call that changes engine state (add, abort, sleep, wake, update weights) runs as a command
on the engine thread, between steps, so transitions never interleave. Heavy compute releases the
GIL, so the event loop stays responsive while a step runs.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable

from server.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.errors import ConflictError, EngineDeadError, EngineUnavailableError
from server.engine.outputs import RequestOutput
from server.engine.params import SamplingParams
from server.engine.sleep_plan import SleepPlan, refusal

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


class AsyncEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None):
        self.config = config
        self.core = core or EngineCore(config)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._pending_sleep: tuple[SleepPlan, Settle] | None = None
        self.dead: BaseException | None = None
        # A snapshot the event loop may read without a round trip: refreshed after every command and step.
        self.state: dict = self.core.sleep_state()
        self.stats = self.core.stats()
        # Observers (metrics): called on the engine thread after each sleep / wake with its report.
        self.on_transition: list[Callable[[str, dict], None]] = []

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
            pending = self._pending_sleep
            if pending is not None and (pending[0].mode != "wait" or not core.has_unfinished):
                self._finish_sleep()
            if core.can_step and self.dead is None:
                try:
                    core.step()
                    failures = 0
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
            self.state = self.core.sleep_state()
            self.stats = self.core.stats()

    def _fail_all(self, error: Exception) -> None:
        for req in list(self.core.requests.values()):
            cb, req.on_output = req.on_output, None  # the handler gets the error, not an abort
            self.core.abort_request(req.request_id)
            if cb is not None:
                cb(error)  # type: ignore[arg-type]

    def _finish_sleep(self) -> None:
        plan, done = self._pending_sleep  # type: ignore[misc]
        self._pending_sleep = None
        try:
            report = self.core.sleep(plan)
        except BaseException as e:
            self.core.draining = False
            self.state = self.core.sleep_state()
            done(None, e)
        else:
            self.state = self.core.sleep_state()  # before done(): the caller reads it next
            self._notify("sleep", report)
            done(report, None)

    def _notify(self, kind: str, report: dict) -> None:
        for fn in self.on_transition:
            try:
                fn(kind, report)
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
            # Refresh the snapshot before the caller resumes: a handler that awaited a wake must not
            # see the pre-wake state in unavailable_reason() (a spurious 503) or in /is_sleeping.
            self.state = self.core.sleep_state()
            self.stats = self.core.stats()
            settle(result, error)

        self._commands.put(cmd)
        self._wake.set()
        return await fut

    def unavailable_reason(self) -> str | None:
        """Why generation would be refused right now, from the snapshot (no round trip)."""
        refused = refusal(self.state)
        return refused[1] if refused else None

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield outputs (each with its delta) until the request finishes. Closing the iterator
        early (a client that went away) aborts the request and frees its KV blocks."""
        reason = self.unavailable_reason()
        if reason:
            raise EngineUnavailableError(reason)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def on_output(out: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        try:
            await self.call(lambda core: core.add_request(request_id, prompt, prompt_token_ids, params, on_output))
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

    # -- sleep mode (the state machine lives in EngineCore; this only sequences it) ---------------

    async def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort") -> dict:
        fut, done = _thread_future()

        def begin(core: EngineCore) -> None:
            if self._pending_sleep is not None:
                raise ConflictError("a sleep is already in progress; wait for it to finish")
            plan = core.plan_sleep(level, tags, mode)
            if plan.mode == "wait":
                core.begin_drain()
            self._pending_sleep = (plan, done)

        await self.call(begin)
        self._wake.set()
        return await fut

    async def wake_up(self, tags: list[str] | None = None) -> dict:
        def wake(core: EngineCore) -> dict:
            if self._pending_sleep is not None:
                raise ConflictError("a sleep is in progress (draining requests); wake after it completes")
            report = core.wake_up(tags)
            self._notify("wake", report)
            return report

        return await self.call(wake)

    async def snapshot(self) -> dict:
        """Sleep state, engine stats and pool stats, read consistently on the engine thread."""
        def read(core: EngineCore) -> dict:
            return {"state": core.sleep_state(), "stats": asdict(core.stats()), "pool": core.pool.stats().as_dict()}
        return await self.call(read)

