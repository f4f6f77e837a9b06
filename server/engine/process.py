"""The engine process: `python -m server.engine.process --fd N`, started by the API process
(server/api/engine_client.py) with one end of a socket pair as fd N.

It owns EngineCore (scheduler, pool, sleep state machine, model) and the weight-transfer receiver,
since both write the model's tensors; the API process never creates a CUDA context. Threads:
- the engine thread builds the engine (every device call of start-up: one cuBLAS handle, see main), then
  runs commands between steps, steps, and sends one frame per loop turn (every request's delta, the
  replies, the status);
- a reader thread receives commands and queues them (ENGINE commands) or hands them to a command
  thread (THREAD commands: compiles, disk reads, joining a transfer group);
- command threads, and the weight-transfer thread (server/engine/transfer_service.py), which hands a
  receive's end back to the engine thread (an ENGINE command answered by a future).
The process ends when the API asks (`shutdown`) or goes away (end of the channel, or its death
signal: the kernel kills this process if the API process dies, so no engine outlives its server).

With --api-server-count N the engine has N channels (`--fd a,b,...`), one per API process: the first
one's process started the engine and owns it (Start, shutdown, its end stops the engine); every channel
gets Ready and the status, each request's deltas go to the channel that added it, each reply to the
channel that called. A later channel that closes (its API process exited) takes its requests with it.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from server.wire.messages import (Call, EngineInfo, Failed, Frame, Ready, Reply, Start, StartFailed,
                                   Status, SyncChannel, WireError)
from server.engine.deltas import encode_delta
from server.engine.commands import ENGINE, EngineCommands
from server.engine.core import EngineCore
from server.wire.outputs import RequestOutput
from server.engine.sequence import Request
from server.heap import freeze_startup_heap
from server.process_death import die_with_parent

log = logging.getLogger("sleepserve.engine")

MAX_CONSECUTIVE_FAILURES = 3
# The admission window: when requests reach an idle engine (nothing running, no step in the last
# ADMIT_QUIET_S), it waits while more keep arriving (a gap under ADMIT_QUIET_S) before its first step, at most
# ADMIT_WINDOW_S, and never once the waiting prompts fill a step. A burst (64 clients at once, parsed by the
# API over a few ms) is then prefilled in one step, as a caller that adds them all at once gets, rather than
# the first few starting a step that the others wait behind and then joining in later steps. A lone request
# waits ADMIT_QUIET_S. A steady flow of short requests (max_tokens 1: each step empties the engine) is not
# held: a step ran just before, so its arrivals go straight into the next one.
ADMIT_QUIET_S = 0.003
ADMIT_WINDOW_S = 0.05
COMMAND_THREADS = 8  # THREAD commands at once (a transfer waiting on a trainer, a slow disk read, compiles)
# A step, or a frame's send to the API, that takes longer than this is logged (a warning): the engine thread
# stalled, on the device or on an API process that does not read its channel. The 1B rollout through HTTP
# stalled ~3-4 s once a run (H200, 2026-12-02) with neither process busy; this says which wait it was.
SLOW_S = 0.5


class _Link:
    """One API process's channel and what its next frame carries. `local` is the engine thread's own
    (deltas, its replies: no lock); `remote` holds replies from command threads (under the server's lock)."""
    __slots__ = ("chan", "index", "local", "remote", "open")

    def __init__(self, chan: SyncChannel, index: int):
        self.chan, self.index = chan, index
        self.local: list = []
        self.remote: list = []
        self.open = True


class EngineServer:
    def __init__(self, core: EngineCore, chans: list[SyncChannel], transfer_config: Any = None):
        self.core = core
        self.links = [_Link(chan, i) for i, chan in enumerate(chans)]
        self._owner: dict[str, _Link] = {}  # request id -> the link that added it (engine thread; several links only)
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._last_message = 0.0  # time.monotonic() when the reader got the API's last message
        self._last_step = 0.0     # time.monotonic() when the engine thread's last step ended
        self._steps = 0           # steps the engine thread ran (the slow-step and slow-send warnings name them)
        self._stop = False
        self._engine_thread: threading.Thread | None = None
        self.dead: str | None = None
        self.shutdown_call: Call | None = None
        self._pool = ThreadPoolExecutor(COMMAND_THREADS, thread_name_prefix="sleepserve-command")
        self._lock = threading.Lock()  # the links' `remote` lists, and one frame at a time
        self._step_tokens: list[int] = []
        self._sent_state: Any = None
        self._stats = core.stats()
        self._sent_stats: Any = None
        transfers = None
        if transfer_config is not None:
            from server.engine.transfer_service import WeightTransferService
            transfers = WeightTransferService(transfer_config, core, self.on_engine, self._submit)
        self.transfers = transfers
        self.commands = EngineCommands(core, self.on_engine, self._emit, transfers)
        core.wire_outputs(self._emit_request)  # only what is new crosses, encoded from the request itself
        core.runner.watch(self._rank_lost)
        self._failures = 0  # steps failed in a row

    def _rank_lost(self, error: BaseException) -> None:
        """A tensor-parallel worker died (any thread): nothing can run again. The step that was running
        fails with the worker's error (its requests get 503 naming the rank), the status says dead,
        then this process exits and the API process, as for any engine death, exits with code 3."""
        self.dead = str(error)
        self._wake.set()

        def exit_soon() -> None:
            deadline = time.monotonic() + 10
            while self.core.requests and time.monotonic() < deadline:
                time.sleep(0.05)  # the step that failed ends its requests with the worker's error...
            time.sleep(0.5)  # ...and its frame reaches the API before the channel closes
            log.critical("the engine process exits: %s", error)
            logging.shutdown()
            os._exit(3)

        threading.Thread(target=exit_soon, name="sleepserve-rank-lost", daemon=True).start()

    # -- from other threads ------------------------------------------------------------------------

    def on_engine(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread between two steps, none in flight (these write weights or read
        the engine's whole state); block this (command) thread for it."""
        fut: Future = Future()

        def run() -> None:
            try:
                self.core.drain()
                fut.set_result(fn(self.core))
            except BaseException as e:
                fut.set_exception(e)
        self._submit(run)
        return fut.result()

    def _submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)
        self._wake.set()

    def read_commands(self, link: _Link) -> None:
        """A reader thread, one per link: until its API process closes the channel or (the first link) asks to
        shut down. The first link's end stops the engine; another's aborts the requests it added."""
        while self.shutdown_call is None:
            try:
                msg = link.chan.recv()  # a Call, or a list of them (the API's calls of one event-loop turn)
            except (EOFError, OSError):
                break
            self._last_message = time.monotonic()
            for call in msg if type(msg) is list else (msg,):
                if call.name == "shutdown" and link.index == 0:  # answered once the memory is released (main)
                    self.shutdown_call = call
                    break
                self._dispatch(call, link)
        if link.index == 0:
            if self.shutdown_call is None:  # (a shutdown's link stays open for the last frame and its reply)
                link.open = False
                log.info("the API process closed the channel; the engine stops")
            self._stop = True
            self._wake.set()
        else:
            link.open = False
            self._submit(lambda: self._drop_link(link))

    def _drop_link(self, link: _Link) -> None:
        """Engine thread: end the requests of a link that closed (nobody reads their outputs)."""
        n = self._abort_owned(link, tell=False)
        log.info("API process %d closed its channel%s", link.index, f"; its {n} request(s) were aborted" if n else "")

    def _abort_owned(self, link: _Link, tell: bool = True) -> int:
        """Engine thread: abort the requests `link` added; tell: their last deltas (finish_reason abort) go out."""
        mine = [r for r, owner in self._owner.items() if owner is link]
        for request_id in mine:
            req = self.core.requests.get(request_id)
            if req is not None:
                if not tell:
                    req.on_output = None
                self.core.abort_request(request_id)
            self._owner.pop(request_id, None)
        return len(mine)

    def _dispatch(self, call: Call, link: _Link) -> None:
        try:
            where, fn = self.commands.lookup(call.name)
        except Exception as e:
            self._reply_from_thread(call, link, None, e)
            return
        if where == ENGINE:
            if len(self.links) > 1 and call.name == "add":
                fn = self._owned_add(fn, link)
            elif len(self.links) > 1 and call.name == "abort_all":  # an API process's shutdown: its requests only
                fn = lambda: self._abort_owned(link)  # noqa: E731
            self._submit(lambda: self._run_on_engine(call, link, fn))
        else:
            self._pool.submit(self._run_on_thread, call, link, fn)

    def _owned_add(self, add: Callable, link: _Link) -> Callable:
        """With several links, an add records whose request it is before any of its deltas can exist."""
        def run(request_id: str, *args: Any, **kwargs: Any) -> Any:
            if request_id in self.core.requests:  # the add refuses it; the request that has the id keeps its owner
                return add(request_id, *args, **kwargs)
            self._owner[request_id] = link
            try:
                return add(request_id, *args, **kwargs)
            except BaseException:
                self._owner.pop(request_id, None)
                raise
        return run

    def _run_on_thread(self, call: Call, link: _Link, fn: Callable) -> None:
        try:
            result = fn(*call.args, **call.kwargs)
        except BaseException as e:
            self._reply_from_thread(call, link, None, e)
        else:
            self._reply_from_thread(call, link, result, None)

    def _reply_from_thread(self, call: Call, link: _Link, result: Any, error: BaseException | None) -> None:
        if call.call_id is None:
            if error is not None:
                log.warning("command %s failed: %s", call.name, error)
            return
        with self._lock:
            link.remote.append(Reply(call.call_id, result, WireError.of(error) if error else None))
        self.flush(engine_thread=False)

    # -- the engine thread -------------------------------------------------------------------------

    def _run_on_engine(self, call: Call, link: _Link, fn: Callable) -> None:
        try:
            result = fn(*call.args, **call.kwargs)
        except BaseException as e:
            self._reply(call, link, None, e)
            return
        if isinstance(result, Future):  # answered when it resolves (finish_sleep, a transfer's end: engine thread)
            result.add_done_callback(lambda f: self._reply(call, link, None if f.exception() else f.result(),
                                                           f.exception()))
        else:
            self._reply(call, link, result)

    def _reply(self, call: Call, link: _Link, result: Any, error: BaseException | None = None) -> None:
        if call.call_id is None:
            if error is not None:
                log.warning("command %s failed: %s", call.name, error)
            return
        if threading.current_thread() is not self._engine_thread:  # a future resolved elsewhere
            self._reply_from_thread(call, link, result, error)
            return
        link.local.append(Reply(call.call_id, result, WireError.of(error) if error else None))

    def _emit(self, out: RequestOutput) -> None:
        """Every request's on_output: it marks the request's outputs as wanted (_fail_all unsets it), and
        the core, in wire mode, hands the request itself to _emit_request instead of calling it."""
        raise AssertionError("the engine process builds no RequestOutput (EngineCore.wire_outputs)")

    def _emit_request(self, req: Request) -> None:
        """An advanced request (engine thread): what the API does not have yet crosses in the next frame, on
        the channel that added it."""
        delta = encode_delta(req)
        if len(self.links) == 1:
            self.links[0].local.append(delta)
            return
        link = self._owner.pop(req.request_id, None) if req.finished else self._owner.get(req.request_id)
        if link is not None:
            link.local.append(delta)

    def flush(self, engine_thread: bool = True) -> None:
        """Send each open link one frame with everything since its last one; every link gets the status when it
        changed. The steps' token counts go to the first link only (its process's metrics count them once)."""
        with self._lock:
            steps: list[int] = []
            if engine_thread:
                steps, self._step_tokens = self._step_tokens, []
            state = self.core.sleep_state
            changed = state is not self._sent_state
            stats = self._stats
            news = changed or stats != self._sent_stats
            self._sent_state, self._sent_stats = state, stats
            status = Status(stats, state if changed else None, self.dead)
            for link in self.links:
                items = link.remote
                if engine_thread and link.local:
                    items, link.local = link.local + items if items else link.local, []
                link.remote = []
                ours = steps if link.index == 0 else []
                if not link.open or (not items and not ours and not news):
                    continue
                try:
                    started = time.monotonic()
                    link.chan.send(Frame(items, status, ours))
                    took = time.monotonic() - started
                    if took > SLOW_S:
                        log.warning("sending API process %d a frame (%d items) took %.2f s after step %d: it did "
                                    "not read its channel", link.index, len(items), took, self._steps)
                except OSError:
                    link.open = False
                    if link.index == 0:
                        self._stop = True  # the API is gone; the reader thread says so too

    def run(self) -> None:
        """The engine thread: commands in the order they came, a pending sleep between steps, a step."""
        self._engine_thread = threading.current_thread()
        core = self.core
        while not self._stop:
            self._drain()
            # Only mode=wait waits for the requests in flight; abort and keep sleep at once (between steps).
            if core.sleep_control.pending:
                self._finish_sleep_if_ready()
            if core.can_step and self.dead is None:
                if not core.scheduler.running and time.monotonic() - self._last_step > ADMIT_QUIET_S:
                    self._gather_arrivals()
                    if not core.can_step or self._stop:
                        continue
                self._step()
                self.flush()
            else:
                self.flush()
                self._wake.wait(0.5)
                self._wake.clear()
        self._drain()  # the shutdown's reply
        self.flush()

    def _finish_sleep_if_ready(self) -> None:
        try:
            if self.core.sleep_control.finish_sleep_if_ready() is not None:  # its on_done answers the caller
                self._stats = self.core.stats()
        except BaseException:
            log.exception("sleep failed")
            self._stats = self.core.stats()

    def _step(self) -> None:
        """One core step; a failed step fails the requests in flight, and one that keeps failing (a lost
        device, a corrupted context) marks the engine dead instead of failing every request after it."""
        core = self.core
        try:
            started = time.monotonic()
            core.step()
            self._steps += 1
            took = time.monotonic() - started
            if took > SLOW_S:
                log.warning("engine step %d took %.2f s (%d sequences running)", self._steps, took,
                            len(core.scheduler.running))
            self._failures = 0
            if tokens := core.take_step_tokens():
                self._step_tokens.append(tokens)
        except Exception as e:
            log.exception("engine step failed; aborting the requests in flight")
            self._fail_all(e)
            self._failures += 1
            if self._failures >= MAX_CONSECUTIVE_FAILURES:
                log.critical("%d steps failed in a row; the engine is dead: %s", self._failures, e)
                self.dead = str(e)
        self._stats = core.stats()
        self._last_step = time.monotonic()

    def _gather_arrivals(self) -> None:
        """The admission window (ADMIT_QUIET_S): requests reached an idle engine; take in those still
        arriving, running every command in order as usual (a sleep or an abort among them applies)."""
        sched = self.core.scheduler
        deadline = time.monotonic() + ADMIT_WINDOW_S
        while not self._stop and sched.waiting and not sched.running and self.core.sleep_state.can_run:
            if (len(sched.waiting) >= sched.max_num_seqs
                    or sum(s.num_tokens for s in sched.waiting) >= sched.max_num_batched_tokens):
                return  # the first step is full already
            wait = min(self._last_message + ADMIT_QUIET_S, deadline) - time.monotonic()
            if wait <= 0:
                return
            self._wake.wait(wait)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        ran = False
        while True:
            try:
                fn = self._queue.get_nowait()
            except queue.Empty:
                break
            fn()
            ran = True
        if ran:
            self._stats = self.core.stats()

    def _fail_all(self, error: Exception) -> None:
        for req in list(self.core.requests.values()):
            req.on_output = None  # the API gets the error, not an abort
            self.core.abort_request(req.request_id)
            link = self._owner.pop(req.request_id, None) if len(self.links) > 1 else self.links[0]
            if link is not None:
                link.local.append(Failed(req.request_id, WireError.of(error)))

    def close(self) -> None:
        if self.transfers is not None:
            self.transfers.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.core.close()


def info_of(core: EngineCore) -> EngineInfo:
    return EngineInfo(pid=os.getpid(), served_model_name=core.served_model_name, model_path=str(core.model_path),
                      model_type=core.model_config.model_type, dtype=str(core.dtype).removeprefix("torch."),
                      device=str(core.device), max_model_len=core.max_model_len,
                      vocab_size=core.model_config.vocab_size, load_seconds=core.load_seconds, config=core.config,
                      kv_plan=core.kv_plan, ranks=core.runner.ranks())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server.engine.process",
                                 description="sleepserve's engine process (started by `sleepserve serve`)")
    ap.add_argument("--fd", required=True,
                    help="this end of each API process's socket pair, comma-separated; the first one's process owns "
                         "the engine")
    ap.add_argument("--parent", type=int, required=True, help="the API process's pid")
    args = ap.parse_args(argv)
    die_with_parent(args.parent)
    # Ctrl-C (and systemd's SIGTERM to the whole control group) reaches this process too: the API
    # process runs the graceful shutdown and then tells this one to stop, so the engine keeps serving
    # the requests that finish meanwhile. SIGKILL still ends it (and the API then exits with code 3).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chans = [SyncChannel(socket.socket(fileno=int(fd))) for fd in args.fd.split(",")]
    chan = chans[0]
    # Imported before the Start arrives: the CLI spawns this process before its own imports (spawn.py).
    from server.engine.build import build_engine
    from server.logging_setup import configure_logging
    from server.model.tokenizer import import_tokenizer_code

    import_tokenizer_code()  # the engine loads the tokenizer too: most of that load is transformers' imports
    try:
        start: Start = chan.recv()
    except (EOFError, OSError):  # the API process exited before starting the engine (a usage error)
        return 0
    configure_logging(start.log_level)
    # Everything that touches the device runs on one thread, the engine thread (not the main one):
    # torch keeps a cuBLAS handle and workspace per thread, 64 MiB of device memory at its default workspace
    # that no sleep frees (H200: +64 MiB asleep when start-up ran on the main thread and steps here). And
    # torch's CPU thread team behaves differently from the main thread (on the loaded 2-core CI host,
    # 8 requests x 8 tokens took 59 s from the main thread and 3.9 s from another one).
    code: list[int] = []

    def run() -> None:
        try:
            code.append(_serve(chans, start, build_engine))
        except BaseException:  # e.g. a Ready that no API process is left to read
            log.critical("the engine process failed", exc_info=True)
            code.append(1)

    engine = threading.Thread(target=run, name="sleepserve-engine")
    engine.start()
    engine.join()
    # Nothing is left to clean up (the pool is closed, its files were unlinked when made): skip the
    # interpreter's teardown, which took 6.5 s of the loaded CI host's time after the pool was closed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code[0] if code else 1)


def _serve(chans: list[SyncChannel], start: Start, build_engine: Callable[..., EngineCore]) -> int:
    """Build the engine, say Ready on every channel, serve until shutdown, release the memory; the
    process's exit code. Runs on the engine thread."""
    from allocator import PoolError
    from server.model.default_model import ModelNotFoundError
    from server.wire.errors import WeightLoadError

    chan = chans[0]
    try:
        core = build_engine(start.config)
    except (ModelNotFoundError, WeightLoadError, PoolError, ValueError, OSError) as e:
        chan.send(StartFailed(WireError.of(e), expected=True))
        return 1
    except BaseException as e:
        log.exception("the engine could not start")
        chan.send(StartFailed(WireError.of(e), expected=False))
        return 1
    try:
        server = EngineServer(core, chans, start.transfer_config)
    except ValueError as e:  # a weight-transfer backend this device cannot run
        core.close()
        chan.send(StartFailed(WireError.of(e), expected=True))
        return 1
    freeze_startup_heap("engine process")  # before Ready: no request is running yet
    ready = Ready(info_of(core), Status(core.stats(), core.sleep_state))
    for c in chans:  # the other API processes start once the first has its Ready; theirs waits in the socket
        c.send(ready)
    server._sent_state = core.sleep_state
    for link in server.links:
        threading.Thread(target=server.read_commands, args=(link,), name=f"sleepserve-channel-{link.index}",
                         daemon=True).start()
    crashed = False
    try:
        server.run()
    except BaseException:  # a bug in the loop itself (steps' own errors are handled there): said before closing
        log.critical("the engine loop crashed", exc_info=True)
        crashed = True
    t0 = time.perf_counter()
    server.close()
    log.info("engine process stopped (memory released in %.2f s)", time.perf_counter() - t0)
    if server.shutdown_call is not None and server.shutdown_call.call_id is not None:
        with contextlib.suppress(OSError):
            chan.send(Frame([Reply(server.shutdown_call.call_id)], Status(core.stats(), None, server.dead)))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
