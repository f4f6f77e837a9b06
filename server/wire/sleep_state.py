"""What the sleep state machine is in (SleepState) and what one transition did (SleepReport).

Both are frozen: SleepController publishes a new SleepState after every transition, and any thread
(the event loop's fast paths, /health, /metrics) may read the latest one without a round trip.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from server.wire.tags import USER_TAGS, WEIGHTS

AWAKE = "awake"


@dataclass(frozen=True)
class Refusal:
    """Why new generation cannot run now: a machine-readable code and a message saying what to do."""
    code: str       # draining | sleeping | weights_invalid | paused
    message: str
    # Whether a request should wait for it to end (held) rather than get 503 at once: a drain, a sleep, a
    # pause and a weight update in progress end by themselves (a wake, a resume, the update's finish);
    # weights left invalid with no update open (a level-2 sleep woken without one, a broken transfer)
    # end only when someone sends weights, so holding would only run the requests into the hold timeout.
    holds: bool = True


# The states a server can be in, for /health and the engine_state gauge; "awake" serves.
ENGINE_STATES = ("awake", "paused", "draining", "sleeping", "weights_invalid")


@dataclass(frozen=True)
class SleepState:
    level: int | None = None              # level of the last sleep while anything sleeps or is paused
    tag_states: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # tags that hold memory
    paused: bool = False
    draining: bool = False                # a mode=wait sleep or pause waits for the requests in flight
    weights_valid: bool = True            # False from a level-2 sleep until every weight is loaded again
    weight_version: str | None = None
    transfer_active: bool = False         # a weight transfer is writing the weights right now
    update_open: bool = False             # a weight-transfer session is open (start .. finish)

    @property
    def asleep(self) -> dict[str, str]:
        """Every tag whose memory is released (internal ones included), with its state."""
        return {t: s for t, s in self.tag_states.items() if s != AWAKE}

    @property
    def sleeping_tags(self) -> list[str]:
        """The user-facing tags that sleep (the internal graph tag follows them)."""
        return sorted(t for t in self.asleep if t in USER_TAGS)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep) or self.paused

    @property
    def can_run(self) -> bool:
        """Whether the engine may step: nothing asleep, not paused, weights whole."""
        return not self.asleep and not self.paused and self.weights_valid and not self.transfer_active

    @property
    def refusal(self) -> Refusal | None:
        """Why new generation is refused, or None when it can be served. In order of precedence: the
        engine, the held-request gate, /health, 503 codes and /metrics all read this one property."""
        if self.draining:
            return Refusal("draining", "the server is draining requests before it sleeps; retry after it wakes")
        if self.asleep:
            names = self.sleeping_tags or sorted(self.asleep)
            return Refusal("sleeping", f"the server is sleeping ({', '.join(names)} asleep); "
                                       "wake it with POST /wake_up")
        if not self.weights_valid:
            return Refusal("weights_invalid",
                           "the weights are not whole (discarded by sleep level 2, or a weight update is in progress "
                           "or broke off); load weights with POST /update_weights",
                           holds=self.paused or self.transfer_active or self.update_open)
        if self.paused:
            return Refusal("paused", "the server is paused; resume it with POST /resume or POST /wake_up")
        return None

    @property
    def name(self) -> str:
        """One word for /health and the engine_state gauge: "awake" or the refusal's code."""
        refused = self.refusal
        return refused.code if refused else "awake"

    @property
    def vllm_paused(self) -> bool:
        """vLLM's /is_paused: a sleep of level 1 or 2 pauses the scheduler first, and only the wake that
        leaves nothing asleep resumes it (a pause, level 0, until /resume or a full wake)."""
        return self.paused or bool(self.asleep)

    @property
    def vllm_sleep_state(self) -> str | None:
        """vLLM's vllm:engine_sleep_state label: awake, weights_offloaded (level 1) or discard_all (level 2);
        None while paused with everything kept (vLLM's level 0 sets all three gauges to 0)."""
        weights = self.tag_states.get(WEIGHTS, AWAKE)
        if weights == "discarded" or not self.weights_valid:
            return "discard_all"
        if self.asleep:
            return "weights_offloaded"
        if self.paused:
            return None
        return "awake"

    def __reduce__(self) -> tuple:
        # The engine process publishes it to the API process; a mapping proxy cannot be pickled.
        return _rebuild_state, (self.level, dict(self.tag_states), self.paused, self.draining, self.weights_valid,
                                self.weight_version, self.transfer_active, self.update_open)

    def as_dict(self) -> dict[str, Any]:
        """The JSON of /is_sleeping (and the `state` of every dev route's answer)."""
        return {"is_sleeping": self.is_sleeping, "level": self.level, "sleeping_tags": self.sleeping_tags,
                "tag_states": dict(self.tag_states), "paused": self.paused, "draining": self.draining,
                "weights_valid": self.weights_valid, "weight_version": self.weight_version,
                "transfer_active": self.transfer_active, "update_open": self.update_open}


def _rebuild_state(level: int | None, tag_states: dict[str, str], *rest: Any) -> SleepState:
    return SleepState(level, MappingProxyType(tag_states), *rest)


@dataclass(frozen=True)
class SleepReport:
    """What one sleep, pause, wake or resume did. `changed` is False for a repeat that found the state
    already as asked (idempotent: nothing was touched)."""
    action: str                           # sleep | pause | wake_up | resume
    changed: bool
    level: int | None = None              # sleep/pause: the level asked; wake: the level it woke from
    aborted: int = 0                      # requests ended with finish_reason "abort"
    offloaded: tuple[str, ...] = ()
    discarded: tuple[str, ...] = ()
    woke: tuple[str, ...] = ()
    bytes_offloaded: int = 0
    bytes_discarded: int = 0
    bytes_restored: int = 0
    seconds: float = 0.0
    # Where a sleep's or a wake's time went (allocator/timing.py): {"total_ms", "phases_ms" (the
    # engine's steps: abort, prefix_cache, pool, publish; they add up to total_ms), "gc" (the Python
    # collector's pauses inside the call), "pending_ms" (sleep: from the call to its start, the drain
    # of mode=wait included), "pool" (the pool's own phases, driver calls and, for a sleep, how far the
    # last wake's background KV mapping had got), "at" (called_s, done_s: the engine's perf_counter() when
    # the call reached its thread and when the report was done; through the server these become "channel":
    # to_engine_ms and to_api_ms, the trips between the API process and the engine thread)}. Empty for a
    # call that changed nothing.
    timings: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("offloaded", "discarded", "woke"):
            d[key] = list(d[key])
        return d
