"""EngineClient: the API process's handle on the engine process (server/engine/process.py).

Every engine operation is a named command on one channel (server/wire/messages.py), so commands
reach the engine in the order they were sent and run between two steps. Outputs come back as one
frame per engine step with every request's delta; `_on_frame` hands each delta to its request's
OutputStream in one event-loop callback. The engine's status (sleep state, stats) rides on every frame, so
the held-request gate, /health and /metrics read it without a round trip. Static facts (model,
context length, KV plan, config) arrive once, in `info`.

If the engine process dies (killed, crashed, out of memory), every waiting call and request gets
EngineDeadError (503) at once and `on_death` tells the server to exit.

With --api-server-count N, the first API process `launch`es the engine with N channels and owns it (its
shutdown stops the engine); each other API process `connect`s to one of the rest (server/api/servers.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from server.config import EngineConfig
from server.wire.messages import (SHORT_DELTA, Call, Delta, EngineInfo, Failed, Frame, Ready, Reply, Start,
                                   StartFailed, Status, SyncChannel, pack, read_message)
from server.wire.stats import EngineStats
from server.wire.errors import EngineDeadError, EngineUnavailableError
from server.api.hold import HeldRequests, HoldPolicy
from server.wire.detokenizer import IncrementalDetokenizer, detokenize_step, prefix_stable
from server.wire.logprob_list import LogprobList
from server.wire.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.wire.params import RequestOutputKind, SamplingParams, StructuredOutputs
from server.wire.sleep_state import SleepReport, SleepState
from server.api.spawn import SpawnedEngine, spawn_engine

if TYPE_CHECKING:
    from server.api.metrics import RequestTracker

log = logging.getLogger("sleepserve.engine")

SHUTDOWN_TIMEOUT_S = 30.0
OUTBOX_HOLD_S = 0.001  # the longest a call waits in the outbox for the rest of its event-loop turn


class EngineStartError(RuntimeError):
    """The engine process could not start; `expected` for a bad flag, model or size (no traceback)."""

    def __init__(self, message: str, expected: bool):
        super().__init__(message)
        self.expected = expected


@dataclass(frozen=True)
class Load:
    """GET /load: how much work the server has (vLLM's server_load) and where it is."""
    server_load: int          # generation requests accepted and not finished, held ones included
    running: int              # sequences in the running batch
    waiting: int              # sequences waiting for the scheduler
    held: int                 # requests waiting for the server to wake, resume or get valid weights
    held_by_reason: dict[str, int]


class _Seq:
    """One sampled sequence as the API has it: the whole so far, and what is new since the route last took it."""
    __slots__ = ("token_ids", "text", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
                 "new_ids", "new_text", "new_logprobs", "routed_experts")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.new_ids: list[int] = []
        self.new_text = ""
        self.new_logprobs: list | None = None
        self.routed_experts = None  # a numpy array, with the end, when the request asked


def text_tokenizer(stream_tokenizer: Any, params: SamplingParams) -> Any:
    """The tokenizer this process makes the request's text with (then it is a text_by_api request), or None:
    the engine makes it. Only a streamed request without stop strings: a FINAL_ONLY one has its text decoded
    once at its end anyway, and stop strings are checked on the text as it grows, on the engine thread."""
    if stream_tokenizer is None or params.output_kind is RequestOutputKind.FINAL_ONLY or params.stop:
        return None
    return stream_tokenizer


def rest_of(final: str, shown: str) -> str:
    """The new text that ends a sequence whose text so far was `shown`, given the engine's whole text: the
    part of `final` after `shown`. With a prefix_stable tokenizer `shown` is always a prefix of `final`; were it
    not, the chunks already sent cannot be taken back, and the rest after their common prefix is the best end
    (tests/wire/test_channel.py checks that it never comes to this)."""
    if final.startswith(shown):
        return final[len(shown):]
    return final[len(os.path.commonprefix([final, shown])):]


class OutputStream:
    """One request's outputs, rebuilt from the engine's deltas (channel.py documents the tuple).

    `apply` (the frame's callback) only records; the route's task `take`s an output when it runs. If
    it is behind (a slow client, a loaded event loop), the deltas of several steps become one output:
    one SSE chunk instead of one per step, and no RequestOutput built for nobody.

    With a tokenizer (a text_by_api request: SamplingParams), the engine sends no text until a sequence ends,
    and this makes it: `apply` keeps each sequence's new ids in `owed`, and make_texts (for every stream of a
    frame at once, or take) turns them into what the engine would have given, token by token, with one
    IncrementalDetokenizer per sequence whose context is the prompt's last ids (from the request's first
    delta). A sequence's end carries the engine's whole text, which becomes the text; the streamed text is its
    prefix (prefix_stable), so the last chunk is the rest of it."""

    def __init__(self, prompt: str | None, prompt_token_ids: list[int] | None, n: int, tokenizer=None,
                 skip_special_tokens: bool = True):
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids or [])
        self.seqs = [_Seq() for _ in range(n)]
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._detoks: list[IncrementalDetokenizer | None] = [None] * n if tokenizer is not None else []
        self.owed: dict[int, list[int]] = {}  # sequence index -> new ids whose text make_texts has not made yet
        self.prompt_logprobs: list | None = None
        self.request_id = ""
        self.finished = False
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.error: BaseException | None = None
        self._news = False
        # The route's task, while it waits for news in next(): a bare future rather than an asyncio.Event,
        # whose wait and set (a loop check, a deque of waiters) cost ~0.6 us more per chunk, of the ~11 us
        # the API's own code spends on one (CPU host, frame to bytes, no uvicorn).
        self._waiter: asyncio.Future | None = None

    def apply(self, d: Delta) -> None:
        if len(d) == SHORT_DELTA:  # one sequence's new tokens mid-stream, nothing else (messages.py)
            self.request_id, token_ids, text, self.num_cached_tokens = d
            acc = self.seqs[0]
            acc.token_ids += token_ids
            acc.new_ids += token_ids
            if self.tokenizer is not None:
                self._owe(0, token_ids)
            else:
                acc.text += text
                acc.new_text += text
            self._news = True
            self._wake()
            return
        request_id, seq_deltas, finished, num_cached, prompt_ids, prompt_logprobs, metrics = d
        self.request_id, self.finished, self.num_cached_tokens = request_id, finished, num_cached
        if prompt_ids is not None:
            self.prompt_token_ids = prompt_ids
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        if metrics is not None:
            self.metrics = RequestMetrics(*metrics)
        for index, token_ids, text, logprobs, cumulative, finish_reason, stop_reason, final_text, routed in seq_deltas:
            acc = self.seqs[index]
            acc.token_ids += token_ids
            acc.new_ids += token_ids
            if self.tokenizer is None:
                acc.text = final_text if final_text is not None else acc.text + text
                acc.new_text += text
            elif final_text is None:
                self._owe(index, token_ids)
            else:  # its end: the whole text, whose rest after what was streamed includes any ids still owed
                self.owed.pop(index, None)
                acc.new_text += rest_of(final_text, acc.text)
                acc.text = final_text
            if logprobs is not None:
                if acc.logprobs is None:
                    acc.logprobs, acc.new_logprobs = [], []
                acc.logprobs += logprobs  # WireLogprobs tuples, kept as they came (logprob_list.py)
                acc.new_logprobs += logprobs  # type: ignore[operator]
            acc.cumulative_logprob = cumulative
            acc.finish_reason, acc.stop_reason = finish_reason, stop_reason
            if routed is not None:
                acc.routed_experts = routed
        self._news = True
        self._wake()

    def _owe(self, index: int, token_ids: list[int]) -> None:
        owed = self.owed.get(index)
        if owed is None:
            self.owed[index] = token_ids  # the unpickled delta's own list: nothing else keeps it
        else:  # two deltas of one frame (or of frames not yet taken: tests, benches)
            owed += token_ids

    def detokenizer(self, index: int) -> IncrementalDetokenizer:
        """Sequence `index`'s detokenizer, made on first use: after the request's first delta, which brings
        the prompt ids the engine used."""
        d = self._detoks[index]
        if d is None:
            d = self._detoks[index] = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids,
                                                             self.skip_special_tokens)
        return d

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: the task was cancelled while it waited
            waiter.set_result(None)

    def take(self) -> RequestOutput | None:
        """Everything new since the last take, as one output (None when nothing is new)."""
        if not self._news:
            return None
        self._news = False
        if self.owed:  # applied outside a frame's make_texts
            make_texts([self])
        outputs = []
        for i, acc in enumerate(self.seqs):
            # token_ids and logprobs are the request's own growing lists: consumers read them, and
            # copying them at every step would cost O(length) per token.
            lps, new_lps = acc.logprobs, acc.new_logprobs
            outputs.append(CompletionOutput(i, acc.text, acc.token_ids, acc.cumulative_logprob,
                                            None if lps is None else LogprobList(lps), acc.finish_reason,
                                            acc.stop_reason, acc.new_text, acc.new_ids,
                                            None if new_lps is None else LogprobList(new_lps), acc.routed_experts))
            acc.new_ids, acc.new_text = [], ""
            if acc.new_logprobs is not None:
                acc.new_logprobs = []
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.num_cached_tokens, self.prompt_logprobs, self.metrics)

    async def next(self) -> RequestOutput:
        """The next output (merged over every delta since the last one); raises the engine's error."""
        while True:
            if self.error is not None:
                raise self.error
            out = self.take()
            if out is not None:
                return out
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


def make_texts(streams: list[OutputStream]) -> None:
    """The text of the ids each stream owes (OutputStream.owed), made together: detokenize_step over one token
    of each sequence at a time, so that the tokens of a frame that the tokenizer must decode (bytes of a
    character, special tokens) share one decode call, as they do on the engine thread; the others are their
    cached texts. A stream listed twice is done once."""
    work = []  # (the sequence, its detokenizer, its owed ids)
    for s in streams:
        if s.owed:
            work += [(s.seqs[i], s.detokenizer(i), ids) for i, ids in s.owed.items()]
            s.owed = {}
    k = 0
    while work:
        for (acc, _, _), text in zip(work, detokenize_step([(d, ids[k]) for _, d, ids in work])):
            if text:
                acc.text += text
                acc.new_text += text
        k += 1
        work = [w for w in work if len(w[2]) > k]  # several tokens a delta (--stream-interval): the next ones


class EngineClient:
    def __init__(self, config: EngineConfig, proc: subprocess.Popen | None, sock: socket.socket, ready: Ready):
        self.config = config
        self.info: EngineInfo = ready.info
        self._proc = proc  # None in an API process that did not start the engine (connect)
        self._sock = sock
        self.spare_channels: list[socket.socket] = []  # launch's channels for the other API processes
        self._state: SleepState = ready.status.state  # type: ignore[assignment]
        self.stats: EngineStats = ready.status.stats
        self.dead: BaseException | None = None
        self.held = HeldRequests(HoldPolicy(config.while_asleep, config.max_held_requests,
                                            config.held_request_timeout), lambda: self.state, lambda: self.dead)
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._streams: dict[str, OutputStream] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[Call] = []  # calls of this event-loop turn, sent together (_post)
        self._outbox_since = 0.0
        self.frames_sent = 0           # messages the calls crossed in (tests: a burst shares them)
        self._reader_task: asyncio.Task | None = None
        self._closing = False
        self._active = 0  # generate() calls in progress (GET /load's server_load)
        # Observers (metrics), on the event loop: the report of each sleep, pause, wake, resume that
        # changed something, and the tokens each engine step ran.
        self.on_transition: list[Callable[[SleepReport], None]] = []
        self.on_step: list[Callable[[int], None]] = []
        # Called once, on the event loop, if the engine process dies (the server exits).
        self.on_death: Callable[[BaseException], None] | None = None
        # The tokenizer this process makes streamed text with (text_by_api), on the event loop; None: the engine
        # makes it (set_stream_tokenizer).
        self.stream_tokenizer: Any = None

    def set_stream_tokenizer(self, tokenizer: Any) -> None:
        """Make the text of streamed requests without stop strings here, with `tokenizer` (used on the event
        loop only), rather than on the engine thread, where it costs every streamed sequence ~1 us a step at
        256 streams (docs/architecture.md, Deliver). Only a prefix_stable tokenizer: the engine's lazy text
        decodes the whole output at the end, and the streamed text must be its prefix."""
        self.stream_tokenizer = tokenizer if prefix_stable(tokenizer) else None

    # -- start-up (before the event loop) ----------------------------------------------------------

    @classmethod
    def launch(cls, config: EngineConfig, transfer_config: Any = None, log_level: str = "info",
               channels: int = 1, spawned: SpawnedEngine | None = None) -> "EngineClient":
        """Start the engine process and wait until it has loaded the model (or failed to). channels > 1: the
        engine also serves channels - 1 other API processes, whose ends wait in `spare_channels`. spawned: an
        engine process spawn_engine(channels) started earlier (the CLI's, so that its imports ran beside ours)."""
        spawned = spawned or spawn_engine(channels)
        proc, mine, spare = spawned.proc, spawned.mine, spawned.spare
        chan = SyncChannel(mine)
        try:
            chan.send(Start(config, transfer_config, log_level))
            msg = chan.recv()
        except (EOFError, OSError):
            code = proc.wait()
            raise EngineStartError(f"the engine process exited while loading ({_exit_reason(code)})", False) from None
        except BaseException:  # Ctrl-C while loading: nothing to save yet
            mine.close()
            proc.kill()
            proc.wait()
            raise
        if isinstance(msg, StartFailed):
            proc.wait(SHUTDOWN_TIMEOUT_S)
            raise EngineStartError(str(msg.error.rebuild()), msg.expected)
        assert isinstance(msg, Ready), msg
        client = cls(config, proc, mine, msg)
        client.spare_channels = spare
        return client

    @classmethod
    def connect(cls, sock: socket.socket) -> "EngineClient":
        """An API process that did not start the engine: its channel (one of launch's spare_channels), whose
        Ready the engine sent when it started."""
        msg = SyncChannel(sock).recv()
        assert isinstance(msg, Ready), msg
        return cls(msg.info.config, None, sock, msg)

    @property
    def pid(self) -> int:
        return self.info.pid

    # -- the published status ----------------------------------------------------------------------

    @property
    def state(self) -> SleepState:
        """The sleep state the engine published last (read without a round trip)."""
        return self._state

    def load(self) -> Load:
        return Load(server_load=self._active, running=self.stats.running, waiting=self.stats.waiting,
                    held=self.held.count, held_by_reason=dict(self.held.by_reason))

    # -- the channel, on the event loop --------------------------------------------------------------

    async def attach(self) -> None:
        """Start reading frames (from the server's lifespan, on its event loop)."""
        if self._reader_task is not None:
            return
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        self.held.attach(asyncio.get_running_loop())
        self._reader_task = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self._on_frame(await read_message(reader))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            if not self._closing:
                self._engine_gone(e)

    def _on_frame(self, frame: Frame) -> None:
        self._apply_status(frame.status)
        owing: list[OutputStream] = []  # streams whose text this process makes (text_by_api), all at once
        for item in frame.items:
            if type(item) is tuple:  # a Delta, the common case
                stream = self._streams.get(item[0])
                if stream is not None:
                    stream.apply(item)
                    if stream.owed:
                        owing.append(stream)
            elif isinstance(item, Reply):
                fut = self._calls.pop(item.call_id, None)
                if fut is not None and not fut.done():
                    if item.error is not None:
                        fut.set_exception(item.error.rebuild())
                    else:
                        fut.set_result(item.result)
            elif isinstance(item, Failed):
                stream = self._streams.get(item.request_id)
                if stream is not None:
                    stream.fail(item.error.rebuild())
        if owing:
            make_texts(owing)
        for fn in self.on_step:
            for n in frame.step_tokens:
                fn(n)

    def _apply_status(self, status: Status) -> None:
        self.stats = status.stats
        if status.dead is not None and self.dead is None:
            self.dead = EngineDeadError(f"the engine stopped: {status.dead}")
        if status.state is not None:
            self._state = status.state
            self.held.state_changed(status.state)

    def _engine_gone(self, cause: BaseException) -> None:
        code = None
        if self._proc is not None:
            code = self._proc.poll()
            if code is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self._proc.wait(1.0)
        reason = _exit_reason(code) if code is not None else f"closed its channel ({cause!r})"
        message = f"the engine process (pid {self.pid}) {reason}"
        log.critical("%s; nothing can be served: answering 503 and shutting the server down (restart it)", message)
        self.dead = EngineDeadError(message)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(self.dead)
        self._calls.clear()
        for stream in self._streams.values():
            stream.fail(self.dead)
        self.held.state_changed(self._state)
        if self.on_death is not None:
            self.on_death(self.dead)

    def _send(self, call: Call) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"{self.dead}")
        if self._writer is None:
            raise EngineDeadError("the engine channel is not open")
        self._post(call)

    def _post(self, call: Call) -> None:
        """Queue a call for the engine; every call queued in one event-loop turn crosses as one message.
        A burst of requests (a client's 64 at once, parsed in the same turn or a few) then reaches the engine
        together and is admitted in one step, rather than the first alone starting a step that every other
        one waits behind (each engine step admits whatever has arrived). FIFO order is kept."""
        self._outbox.append(call)
        if len(self._outbox) == 1:
            self._outbox_since = time.monotonic()
            asyncio.get_running_loop().call_soon(self._flush_outbox)
        elif time.monotonic() - self._outbox_since > OUTBOX_HOLD_S:
            # A long turn (dozens of requests parsed in it): what it has so far leaves now, so the gaps between
            # messages stay short and the engine's admission window (process.py) sees the burst go on.
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        calls, self._outbox = self._outbox, []
        if self._writer is None or self._writer.is_closing() or not calls:
            return
        self.frames_sent += 1
        self._writer.write(pack(calls[0] if len(calls) == 1 else calls))

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run the engine command `name` (server/engine/commands.py) and await its reply."""
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._send(Call(call_id, name, args, kwargs))
        self._calls[call_id] = fut
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def notify(self, name: str, *args: Any) -> None:
        """A command whose answer nobody waits for (an abort from a client that went away)."""
        if self.dead is None and self._writer is not None:
            self._post(Call(None, name, args))

    # -- generation ----------------------------------------------------------------------------------

    def refuse_now(self) -> None:
        """With --while-asleep reject, 503 at once while the engine cannot serve (no round trip)."""
        if self.dead is not None:
            raise self.dead
        self.held.refuse_now()

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams, tracker: RequestTracker | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs (each with its delta) until the request finishes. While the engine cannot serve,
        the request is held first (or refused, per HoldPolicy). Closing the iterator early (a client
        that went away) drops a held request and aborts an admitted one, freeing its KV blocks.
        `tracker` (the route's metrics) observes each output and the end.
        One generator (not a wrapper around another): a streamed output passes every layer once per step."""
        deadline = None
        last: RequestOutput | None = None
        tokenizer = text_tokenizer(self.stream_tokenizer, params)
        stream = OutputStream(prompt, prompt_token_ids, params.n, tokenizer, params.skip_special_tokens)
        if params.grammar is not None or tokenizer is not None:
            # compiled objects stay in the engine process (compile_grammar); the text of a stream is made here
            params = replace(params, grammar=None, text_by_api=tokenizer is not None)
        added = False
        finished = False
        self._active += 1
        try:
            while True:
                # Cancelled while held (the client left): nothing reached the engine, nothing to undo.
                deadline = await self.held.wait_until_servable(deadline)
                self._streams[request_id] = stream
                try:
                    await self.call("add", request_id, prompt, prompt_token_ids, params)
                    added = True
                    break
                except EngineUnavailableError:
                    # The engine fell asleep between the check and the add: hold again (or refuse).
                    if self.held.policy.while_asleep == "reject":
                        raise
                except asyncio.CancelledError:
                    added = True  # the add still runs in the engine: the abort follows it (FIFO)
                    raise
            while not finished:
                out = last = await stream.next()
                finished = out.finished
                if tracker is not None:
                    tracker.observe(out)
                yield out
        finally:
            self._active -= 1
            self._streams.pop(request_id, None)
            try:
                if added and not finished:
                    self.notify("abort", request_id)
            finally:  # the request's metrics end however the abort went
                if tracker is not None:
                    tracker.finish(last)

    # -- named commands ------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        self.notify("abort", request_id)

    async def abort_all(self) -> int:
        """Abort every request this API process added (with one API process, every request): each ends with
        finish_reason abort."""
        return await self.call("abort_all")

    async def compile_grammar(self, spec: StructuredOutputs, param: str) -> None:
        """400 (InvalidRequestError naming `param`) if it cannot be compiled; compiled and cached in the
        engine process, off its engine thread, so the add that follows does not wait for it."""
        await self.call("compile_grammar", spec, param)

    async def _timed(self, name: str, *args: Any) -> SleepReport:
        """A sleep, wake or resume; a sleep's and a wake's timings completed with the channel's share
        (_with_channel; a resume reports no timings)."""
        sent = time.perf_counter()
        report = await self.call(name, *args)
        return self._notify(_with_channel(report, sent, time.perf_counter()))

    def _notify(self, report: SleepReport) -> SleepReport:
        if report.changed:
            for fn in self.on_transition:
                try:
                    fn(report)
                except Exception:
                    log.exception("transition observer failed")
        return report

    async def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort",
                    clear_cache: bool = False) -> SleepReport:
        """Sleep (level 1, 2) or pause (level 0). abort and keep apply between two steps; wait first
        lets the requests in flight finish (refusing or holding new ones)."""
        return await self._timed("sleep", level, tags, mode, clear_cache)

    async def wake_up(self, tags: list[str] | None = None) -> SleepReport:
        return await self._timed("wake_up", tags)

    async def resume(self) -> SleepReport:
        return await self._timed("resume")

    async def reset_prefix_cache(self) -> None:
        await self.call("reset_prefix_cache")

    async def start_profile(self) -> None:
        await self.call("start_profile")

    async def stop_profile(self) -> dict:
        """Writing the trace takes seconds for a long one, on the engine thread (step_profiler.py)."""
        return await self.call("stop_profile")

    async def snapshot(self) -> dict:
        """Sleep state, engine stats and pool stats, read consistently between two steps."""
        return await self.call("snapshot")

    async def load_weights(self, path: str | None, weight_version: str | None) -> dict:
        """From disk (the served checkpoint when path is None), read in the engine process off its
        engine thread, then copied in place between two steps."""
        return await self.call("load_weights", path, weight_version)

    # Weight transfers (server/engine/transfer_service.py runs them in the engine process).

    async def transfer_init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            packed: bool | None) -> dict:
        return await self.call("transfer_init", master_address, master_port, rank_offset, world_size, packed)

    async def transfer_start(self) -> dict:
        return await self.call("transfer_start")

    async def transfer_update(self, update_info: dict) -> dict:
        return await self.call("transfer_update", update_info)

    async def transfer_finish(self, weight_version: str | None) -> dict:
        return await self.call("transfer_finish", weight_version)

    async def update_from_tensor(self, serialized: str, weight_version: str | None) -> dict:
        return await self.call("update_from_tensor", serialized, weight_version)

    # -- shutdown ------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Ask the engine to stop (it aborts what is left and releases its memory) and wait for it. An API
        process that did not start the engine only closes its channel (the engine aborts what it added)."""
        self._closing = True
        if self._proc is not None:
            if self.dead is None and self._writer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.call("shutdown"), SHUTDOWN_TIMEOUT_S)
            await asyncio.to_thread(_stop_process, self._proc)
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()

    def shutdown_now(self) -> None:
        """Without an event loop (the server never started serving): close the channel, wait, kill."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._proc is not None:
            _stop_process(self._proc)


def _with_channel(report: SleepReport, sent: float, got: float) -> SleepReport:
    """timings["channel"]: to_engine_ms from this process's send to the engine thread taking the call (the
    channel, the reader thread, the wait for the step in flight), to_api_ms from the engine's report to its
    arrival here (the reply leaves with the engine loop's next frame: after the step in flight, if requests
    run). With the engine's own total they explain a slow call seen through HTTP. The engine's raw
    clock readings (timings["at"]) are consumed here."""
    timings = dict(report.timings)
    stamps = timings.pop("at", None)
    if not stamps:
        return report
    timings["channel"] = {"to_engine_ms": (stamps["called_s"] - sent) * 1e3,
                          "to_api_ms": (got - stamps["done_s"]) * 1e3}
    return replace(report, timings=timings)


def _stop_process(proc: subprocess.Popen) -> None:
    """Wait for the engine to exit on its own (it was asked, or its channel closed); then make it."""
    try:
        proc.wait(SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the engine process (pid %d) did not exit within %.0f s; killing it", proc.pid,
                    SHUTDOWN_TIMEOUT_S)
        proc.kill()
        proc.wait()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with code {code}"


__all__ = ["EngineClient", "EngineStartError", "Load"]
