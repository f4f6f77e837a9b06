"""The channel between the API process and the engine process: one Unix socket pair, one pickled
message per frame (an 8-byte length, then pickle protocol 5).

API -> engine: `Call` (a named command; `call_id` None for a one-way one such as abort), or a list of
Calls: those the API made in one event-loop turn (a burst of requests arrives together), run in order.
Engine -> API: `Start` answers (`Ready` with the static facts, or `StartFailed`), then `Frame`s:
every delta, reply and step count since the last frame, in the order they happened, plus the
engine's status (sleep state when it changed, stats, dead). The engine sends at most one frame per
step, so a step's outputs for every request cross in one message and the API dispatches them in
one event-loop callback.

Exceptions cross as (class, args, attributes) and are rebuilt without calling their __init__, so
every engine error (InvalidRequestError's param and code, EngineUnavailableError's Retry-After)
reaches the API's status mapping intact.
"""
from __future__ import annotations

import asyncio
import importlib
import pickle
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from server.config import EngineConfig
from server.wire.sleep_state import SleepState
from server.wire.stats import EngineStats, KVPlan

_HEADER = struct.Struct("!Q")
# Only exceptions of these packages are rebuilt as themselves; anything else arrives as RuntimeError.
_TRUSTED = ("server.", "allocator.", "builtins")


# -- messages ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Start:
    """The first message: what to build. The engine answers Ready or StartFailed."""
    config: EngineConfig
    transfer_config: Any = None       # a WeightTransferConfig (dev mode), or None
    log_level: str = "info"


@dataclass(frozen=True)
class EngineInfo:
    """Static facts, sent once: nothing here changes while the engine runs."""
    pid: int
    served_model_name: str
    model_path: str
    model_type: str
    dtype: str                        # "bfloat16", without "torch."
    device: str                       # "cpu", "cuda", "cuda:1"
    max_model_len: int
    vocab_size: int
    load_seconds: float
    config: EngineConfig
    kv_plan: KVPlan
    ranks: list = field(default_factory=list)  # each tensor-parallel rank's {"rank", "pid", "device"}

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]


@dataclass(frozen=True)
class Status:
    """What the engine is now: the API reads it without a round trip (held requests, /health, /metrics)."""
    stats: EngineStats
    state: SleepState | None = None   # None: unchanged since the last frame
    dead: str | None = None           # the engine loop stopped (steps kept failing): why


@dataclass(frozen=True)
class Ready:
    info: EngineInfo
    status: Status


@dataclass(frozen=True)
class StartFailed:
    error: "WireError"
    expected: bool                    # a bad flag, model or size (exit 1, no traceback) rather than a bug


@dataclass(frozen=True)
class Call:
    call_id: int | None
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    call_id: int
    result: Any = None
    error: "WireError | None" = None


# What one request added in a step, only the new part (the API keeps the rest). Plain tuples, not
# dataclasses: pickling 64 of them is ~8x faster (measured: 0.19 ms against 1.6 ms for dataclasses or
# named tuples on the loaded 2-core CI machine), and this crosses once per step on the engine's time.
#   Delta    = (request_id, [SeqDelta, ...], finished, num_cached_tokens,
#               prompt_token_ids (on a request's first delta, else None),
#               prompt_logprobs (once, when the prefill computed them all, else None),
#               metrics (when it finishes: (arrival, first_scheduled, first_token, last_token) times and the
#               request's preemptions, else None))
#   SeqDelta = (index, new token ids, new text, new log-probs (WireLogprobs each) or None, cumulative_logprob,
#               finish_reason, stop_reason, the whole text (once, when the sequence finishes, else None),
#               routed experts (once, when it finishes, if asked: a numpy array, routed_experts.py; else None))
#   New text is "" until a sequence ends for a FINAL_ONLY request without stop strings and for a text_by_api one
#   (params.py): the engine decodes its text once, at the end (the whole text, also as new text). For a
#   text_by_api request (a stream without stop strings) the API process makes the text as it goes from the new
#   token ids (engine_client.OutputStream), in either form, and its end from the whole text.
#   WireLogprobs: logprob_list.py (plain values: Logprob objects pickle ~10x slower, and a FINAL_ONLY
#               request's last delta carries all of its log-probs at once).
#   Or, for what most streamed steps are (one sequence, no log-probs, neither a request's first delta nor its
#   last, no prompt log-probs to send), the short form (request_id, new token ids, new text, num_cached_tokens):
#   64 of them pickle in 9 us against 34 us for the long form and unpickle in 16 against 37 (CPU host), on the
#   engine thread's time once per step for every stream (at 256 streams py-spy put a third of the engine
#   thread's extra streaming work in building and pickling deltas, H200, 2026-12-05).
Delta = tuple
SHORT_DELTA = 4  # the short form's length
SeqDelta = tuple


@dataclass(frozen=True)
class Failed:
    """A request ended by an engine error (its step failed) rather than by a finish reason."""
    request_id: str
    error: "WireError"


@dataclass(frozen=True)
class Frame:
    items: list                       # Delta (a tuple) | Failed | Reply, in the order they happened
    status: Status
    step_tokens: list[int] = field(default_factory=list)  # tokens each step ran since the last frame


# -- exceptions ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class WireError:
    module: str
    qualname: str
    args: tuple
    attrs: dict

    @classmethod
    def of(cls, e: BaseException) -> "WireError":
        attrs = dict(getattr(e, "__dict__", {}))
        try:
            pickle.dumps((e.args, attrs))
        except Exception:  # an attribute that cannot travel: keep the message only
            return cls("builtins", "RuntimeError", (f"{type(e).__name__}: {e}",), {})
        return cls(type(e).__module__, type(e).__qualname__, e.args, attrs)

    def rebuild(self) -> BaseException:
        if self.module.startswith(_TRUSTED):
            try:
                cls = getattr(importlib.import_module(self.module), self.qualname)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    e = cls.__new__(cls)
                    BaseException.__init__(e, *self.args)
                    e.__dict__.update(self.attrs)
                    return e
            except Exception:
                pass
        return RuntimeError(*self.args)


# -- framing -------------------------------------------------------------------------------------

def pack(msg: Any) -> bytes:
    body = pickle.dumps(msg, protocol=5)
    return _HEADER.pack(len(body)) + body


class SyncChannel:
    """The engine's end (and the API's during start-up): blocking, sends from any thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: Any) -> None:
        data = pack(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> Any:
        """The next message; EOFError when the other end closed."""
        (n,) = _HEADER.unpack(self._read(_HEADER.size))
        return pickle.loads(self._read(n))

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("the other end closed the channel")
            got += k
        return bytes(buf)


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The API's end, on the event loop. IncompleteReadError when the engine closed the channel."""
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(n))


__all__ = ["Start", "EngineInfo", "Status", "Ready", "StartFailed", "Call", "Reply", "SeqDelta", "Delta", "SHORT_DELTA",
           "Failed", "Frame", "WireError", "pack", "SyncChannel", "read_message"]
