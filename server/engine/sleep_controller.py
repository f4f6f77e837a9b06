"""The sleep state machine: its one owner.

SleepController decides every sleep, pause, wake and resume, keeps the level, the pause, the pending
sleep (with its mode=wait drain) and whether the weights are whole (weights_valid, the parameters
reloaded, weight_version, transfer_active, the open weight session), and publishes a frozen SleepState
after each transition. It is the only writer of that state. The pool keeps the memory state per tag;
the controller is the policy on top. The engine core and the in-process LLM only call it (both from the
one thread that drives the engine); where a transition needs the engine to act (reset the KV, write
the rotary tables again), the method returns what to do and the core does it.

Weight updates that arrive in pieces (vLLM's start / update... / finish) follow this policy:
- open_weight_session opens a session; update calls outside a session are sessions of their own.
- begin_weight_write stops stepping (transfer_active) and marks the weights invalid: from the first
  byte until the finish they may be a mix of two versions, and nothing is served from a mix.
- end_weight_write records what landed. A write that failed after bytes landed breaks the session:
  the weights stay invalid (503 weights_invalid) until a complete update (every parameter); so
  does a failed write after earlier writes of the same session landed.
- finish_weight_session makes the weights valid again if the session was whole and the weights were
  valid before it (a partial update of valid weights is what the trainer asked for); if they were
  invalid before (sleep level 2, a broken transfer), only once every parameter was reloaded. It also
  sets weight_version.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Iterable, Protocol

from allocator import MemoryPool
from allocator.timing import Clock
from server.wire.errors import ConflictError
from server.engine.sleep_plan import DISCARDED, INTERNAL_ACTIONS, OFFLOADED, SleepPlan
from server.wire.sleep_state import AWAKE, SleepReport, SleepState
from server.wire.tags import ALL_TAGS, INTERNAL_TAGS, KV_CACHE, USER_TAGS, WEIGHTS, parse_tags
from server.heap import frozen_objects

Done = Callable[["SleepReport | None", "BaseException | None"], None]


class SleepTarget(Protocol):
    """What the controller needs from the engine it puts to sleep (EngineCore; a fake in unit tests)."""

    pool: MemoryPool

    @property
    def has_unfinished(self) -> bool: ...

    def drain(self) -> object: ...  # record the step in flight (async scheduling): nothing runs on the device

    def abort_all(self) -> int: ...

    def preempt_all(self) -> None: ...

    def reset_prefix_cache(self) -> None: ...


@dataclass
class WeightSession:
    """An update in pieces (start / update... / finish), from its start to its finish."""
    valid_before: bool
    explicit: bool           # opened by start (else one update call is the whole session)
    loaded: set[str] = field(default_factory=set)
    broken: bool = False
    writes: int = 0


@dataclass(frozen=True)
class SessionEnd:
    """What finish_weight_session decided, and what the engine must do about it."""
    report: dict
    rewrite_buffers: bool    # write the config-derived buffers (rotary tables) again: a level-2 sleep took them
    forget_kv: bool          # KV computed with the old weights must never be reused


@dataclass(frozen=True)
class _PendingSleep:
    plan: SleepPlan
    offload: tuple[str, ...]
    discard: tuple[str, ...]
    on_done: Done | None
    since: float  # begin_sleep's start (perf_counter): pending_ms counts from here


class SleepController:
    def __init__(self, target: SleepTarget, enabled: bool = True, weight_version: str | None = None):
        self._target = target
        self._pool = target.pool
        self.enabled = enabled
        self._level: int | None = None
        self._paused = False
        self._pending: _PendingSleep | None = None
        # Whether the weights are whole, and what they are: written here only.
        self.weights_valid = True
        self.reloaded: set[str] = set()      # parameters loaded since the weights were last invalidated
        self.weight_version = weight_version
        self.weight_updates = 0              # completed transfer sessions (the default weight_version)
        self.transfer_active = False         # a transfer thread is writing the weights: no step may run
        self.weight_session: WeightSession | None = None
        # Called (on the engine thread) with the new state after every change: the async engine
        # wakes the requests it holds with it.
        self.listeners: list[Callable[[SleepState], None]] = []
        self.state = self._snapshot()

    # -- the published state ---------------------------------------------------------------------

    def _snapshot(self) -> SleepState:
        tag_states = {t: self._pool.tag_state(t) for t in ALL_TAGS}
        return SleepState(level=self._level, tag_states=MappingProxyType(tag_states), paused=self._paused,
                          draining=self._pending is not None and self._pending.plan.mode == "wait",
                          weights_valid=self.weights_valid, weight_version=self.weight_version,
                          transfer_active=self.transfer_active, update_open=self._update_open)

    @property
    def _update_open(self) -> bool:
        """A trainer's session (start .. finish) that may still make the weights whole: requests wait for
        it. A broken one cannot (only a complete update can), and a one-call update is transfer_active."""
        session = self.weight_session
        return session is not None and session.explicit and not session.broken

    def publish(self) -> None:
        self.state = self._snapshot()
        for fn in self.listeners:
            fn(self.state)

    # -- sleep and pause ---------------------------------------------------------------------------

    def begin_sleep(self, level: int, tags: str | Iterable[str] | None = None, mode: str = "abort",
                    clear_cache: bool = False, on_done: Done | None = None) -> SleepReport | None:
        """Start a sleep (level 1, 2) or a pause (level 0). Returns a report at once for a repeat that
        changes nothing; otherwise the sleep is pending until `ready` and `finish_sleep()` (mode=wait
        drains the requests in flight meanwhile, refusing new ones), and None is returned."""
        called = time.perf_counter()  # the plan's pool reads below count as the engine's (pending_ms)
        if not self.enabled:
            raise ConflictError("sleep mode is disabled for this engine (enable_sleep_mode=False)")
        plan = SleepPlan.make(level, list(tags) if tags is not None and not isinstance(tags, str) else tags,
                              mode, clear_cache)
        if self._pending is not None:
            raise ConflictError("a sleep is already in progress (draining requests); wait for it to finish")
        if self.transfer_active:
            raise ConflictError("a weight transfer is writing the weights; sleep after it returns")
        action = "pause" if plan.level == 0 else "sleep"
        if plan.level == 0:
            if self._paused:
                return SleepReport(action, changed=False, level=0)
            self._pending = _PendingSleep(plan, (), (), on_done, called)
        else:
            offload, discard = self._diff(plan)
            if not offload and not discard:
                return SleepReport(action, changed=False, level=plan.level)
            self._pending = _PendingSleep(plan, offload, discard, on_done, called)
        if plan.mode == "wait":
            self.publish()  # draining: new requests are refused (or held) from now on
        return None

    def _diff(self, plan: SleepPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The tags to offload and to discard so that every tag is as the plan wants. A tag asleep in
        another way than asked cannot be changed in place: 409 (wake it first)."""
        held = set(self._pool.stats().tags)  # only tags holding memory sleep
        now = {t: self._pool.tag_state(t) for t in held}
        want = {t: a for t, a in plan.want.items() if t in held}
        clashes = [f"{t} is {now[t]}, level {plan.level} would have it {a}"
                   for t, a in want.items() if now[t] not in (AWAKE, a)]
        if clashes:
            raise ConflictError(f"already asleep in another way ({'; '.join(clashes)}); wake those tags first "
                                "with POST /wake_up (after a level-2 sleep, also POST /update_weights)")
        todo = {t: a for t, a in want.items() if now[t] == AWAKE}
        if todo:  # the internal tags sleep with the first tag that sleeps
            todo.update({t: a for t, a in INTERNAL_ACTIONS.items() if t in held and now[t] == AWAKE})
        return (tuple(t for t, a in todo.items() if a == OFFLOADED),
                tuple(t for t, a in todo.items() if a == DISCARDED))

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def ready(self) -> bool:
        """A pending sleep may be applied now: mode=wait once no request is left (or none can advance,
        as when a pause holds them), other modes at once."""
        p = self._pending
        return p is not None and (p.plan.mode != "wait" or not self._target.has_unfinished
                                  or not self.state.can_run)

    def finish_sleep_if_ready(self) -> SleepReport | None:
        """Apply the pending sleep if it may be applied now (see `ready`); None if there is none or not yet."""
        return self.finish_sleep() if self.ready else None

    def finish_sleep(self) -> SleepReport:
        """Apply the pending sleep. Returns once the memory is really released (the pool synchronizes).
        Its on_done, if any, hears the outcome too."""
        pending = self._pending
        assert pending is not None, "finish_sleep without a pending sleep"
        self._pending = None
        clock = Clock()
        try:  # whatever fails, the caller hears it (a server's sleep call would otherwise wait forever)
            report, pool_timings = self._apply(pending, clock)
            self.publish()
            clock.mark("publish")
            # pending_ms: from the call to the sleep's start (the drain of mode=wait, or the step in flight).
            report = replace(report, timings=self._timings(clock, pool=pool_timings,
                                                           pending_ms=(clock.start - pending.since) * 1e3,
                                                           at=_stamps(pending.since)))
        except BaseException as e:
            try:
                self.publish()
            finally:
                if pending.on_done is not None:
                    pending.on_done(None, e)
            raise
        if pending.on_done is not None:
            pending.on_done(report, None)
        return report

    def _apply(self, p: _PendingSleep, clock: Clock) -> tuple[SleepReport, dict]:
        """Apply a pending sleep; returns its report and the pool's timings (marking clock's phases)."""
        plan, target = p.plan, self._target
        target.drain()  # the step in flight ends first: it reads and writes what is about to change
        clock.mark("drain")
        aborted = 0
        if plan.mode in ("abort", "wait"):
            aborted = target.abort_all()
            clock.mark("abort")
        elif p.discard:
            # mode=keep: KV is about to go (or was computed by weights about to go), so every running
            # sequence recomputes it after wake.
            target.preempt_all()
            clock.mark("preempt")
        if plan.level == 0:
            self._paused = True
            if self._level is None:  # a pause on top of a sleep keeps the sleep's level
                self._level = 0
            if plan.clear_cache:
                target.reset_prefix_cache()
            clock.mark("prefix_cache")
            return SleepReport("pause", changed=True, level=0, aborted=aborted, seconds=clock.elapsed), {}
        if KV_CACHE in p.discard:
            target.reset_prefix_cache()  # the KV those hashes point to is about to vanish
        if WEIGHTS in p.discard:
            self.weights_valid = False
            self.reloaded = set()
            self.weight_session = None  # what a transfer session wrote is gone with the memory
        clock.mark("prefix_cache")
        report = self._pool.sleep(offload_tags=list(p.offload), discard_tags=list(p.discard))
        clock.mark("pool")
        self._level = max(self._level or 0, plan.level)
        return SleepReport("sleep", changed=True, level=plan.level, aborted=aborted,
                           offloaded=tuple(t for t in p.offload if t in USER_TAGS),
                           discarded=tuple(t for t in p.discard if t in USER_TAGS),
                           bytes_offloaded=report.bytes_offloaded, bytes_discarded=report.bytes_discarded,
                           seconds=clock.elapsed), report.timings

    def sleep(self, level: int, tags: str | Iterable[str] | None = None, mode: str = "abort",
              clear_cache: bool = False, step: Callable[[], object] | None = None) -> SleepReport:
        """The whole sleep for a synchronous driver (the in-process LLM): begin, drain with `step`, apply."""
        report = self.begin_sleep(level, tags, mode, clear_cache)
        if report is not None:
            return report
        while not self.ready and step is not None:
            step()
        return self.finish_sleep()

    # -- wake and resume ---------------------------------------------------------------------------

    def _refuse_while_pending(self, what: str) -> None:
        if self._pending is not None:
            raise ConflictError(f"a sleep is in progress (draining requests); {what} after it completes")

    def wake_up(self, tags: str | Iterable[str] | None = None) -> SleepReport:
        """Wake the tags asked (all by default; a full wake also ends a pause). The internal tags wake
        with whatever wake leaves no user tag asleep, so the engine can always run after the last wake."""
        self._refuse_while_pending("wake")
        chosen = parse_tags(tags)
        asleep = self.state.asleep
        targets = [t for t in (chosen or USER_TAGS) if t in asleep]
        if not any(t in asleep and t not in targets for t in USER_TAGS):
            targets += [t for t in INTERNAL_TAGS if t in asleep]
        unpause = chosen is None and self._paused
        if not targets and not unpause:
            return SleepReport("wake_up", changed=False, level=self._level)
        clock = Clock()
        from_level = self._level
        pool_report = self._pool.wake_up(targets) if targets else None
        clock.mark("pool")
        if unpause:
            self._paused = False
        self._settle_level()
        clock.mark("publish")
        return SleepReport("wake_up", changed=True, level=from_level,
                           woke=tuple(t for t in targets if t in USER_TAGS),
                           bytes_restored=pool_report.bytes_restored if pool_report else 0,
                           seconds=clock.elapsed,
                           timings=self._timings(clock, pool=pool_report.timings if pool_report else {},
                                                 at=_stamps(clock.start)))

    @staticmethod
    def _timings(clock: Clock, **extra: object) -> dict:
        """The clock's report, with how many start-up objects the collector skips (server/heap.py)."""
        timings = clock.report(**extra)
        timings["gc"]["frozen_objects"] = frozen_objects()
        return timings

    def resume(self) -> SleepReport:
        """End a pause. Tags that sleep keep sleeping (wake them with wake_up)."""
        self._refuse_while_pending("resume")
        if not self._paused:
            return SleepReport("resume", changed=False, level=self._level)
        self._paused = False
        self._settle_level()
        return SleepReport("resume", changed=True, level=0)

    def _settle_level(self) -> None:
        if not self._pool.sleeping_tags() and not self._paused:
            self._level = None
        self.publish()

    # -- weights -----------------------------------------------------------------------------------

    def check_weight_update(self) -> None:
        """Weights may change in place when they are awake and nothing would step on them meanwhile."""
        st = self.state
        if self.transfer_active:
            raise ConflictError("a weight transfer is already in progress; wait for it to finish")
        if st.draining:
            raise ConflictError("the server is draining requests before a sleep; update the weights after it")
        if st.tag_states.get(WEIGHTS, AWAKE) != AWAKE:
            raise ConflictError("the weights are asleep; wake them first with POST /wake_up?tags=weights")
        if self._target.has_unfinished and st.can_run:
            raise ConflictError("requests are running; pause the server (POST /pause?mode=keep keeps them) or "
                                "sleep it before updating weights")

    def weights_invalidated(self) -> None:
        """An update wrote weights that cannot be served (NaN or Inf): invalid until a complete update."""
        self.weights_valid = False
        self.reloaded = set()
        self.publish()

    def weights_loaded(self, loaded: set[str], all_names: set[str], version: str | None,
                       set_version: bool) -> None:
        """After an in-place load: the weights are whole again once every parameter has been loaded
        since the level-2 sleep that discarded them."""
        if not self.weights_valid:
            self.reloaded |= loaded
            if not all_names - self.reloaded:
                self.weights_valid = True
        if set_version:
            self.weight_version = version
        self.publish()


    # -- weight updates in pieces (the policy is in the module's docstring) ------------------------------

    def open_weight_session(self) -> dict:
        self.check_weight_update()
        previous = self.weight_session
        self.weight_session = WeightSession(valid_before=self.weights_valid, explicit=True)
        return {"restarted": previous is not None, "weights_valid": self.weights_valid}

    def begin_weight_write(self) -> None:
        """The caller drained the step in flight first (it reads the weights)."""
        self.check_weight_update()
        if self.weight_session is None:
            self.weight_session = WeightSession(valid_before=self.weights_valid, explicit=False)
        self.transfer_active = True
        self.weights_valid = False
        self.publish()

    def end_weight_write(self, loaded: set[str], failed: bool) -> bool:
        """Record a write's outcome. True when it was a one-call session that must finish now."""
        self.transfer_active = False
        session = self.weight_session
        assert session is not None, "end_weight_write without begin_weight_write"
        session.writes += 1
        if failed and (loaded or session.loaded):
            # Bytes of this update landed (in this write or an earlier one of the session) and the rest
            # never will: whatever the trainer does next, these weights are not a version it sent.
            session.broken = True
            session.loaded = set()
            self.reloaded = set()  # a complete update is needed now
        else:
            session.loaded |= loaded
        if failed and not session.loaded and not session.broken and session.writes == 1:
            self.weights_valid = session.valid_before  # nothing landed: nothing changed
            if not session.explicit:
                self.weight_session = None
            self.publish()
            return False
        if not session.explicit and not failed:
            return True
        self.publish()
        return False

    def finish_weight_session(self, weight_version: str | None, all_names: set[str]) -> SessionEnd:
        session = self.weight_session
        if self.transfer_active:
            raise ConflictError("a weight transfer is still in progress; finish after it returns")
        self.weight_session = None
        if session is None:
            return SessionEnd({"tensors": 0, "weights_valid": self.weights_valid,
                               "weight_version": self.weight_version}, False, False)
        if session.valid_before and not session.broken:
            valid = True
        else:
            self.reloaded |= session.loaded
            valid = all_names <= self.reloaded
        self.weights_valid = valid
        if session.loaded:
            self.weight_updates += 1
            self.weight_version = weight_version if weight_version is not None else str(self.weight_updates)
        elif weight_version is not None:
            self.weight_version = weight_version
        self.publish()
        # Buffers derived from the config (rotary tables) live under the weights tag too: a level-2 sleep
        # discarded them with the weights. Weights valid when the session began kept them (rewriting costs
        # ~85 ms at 32K positions on the CPU: more than the transfer).
        return SessionEnd({"tensors": len(session.loaded), "weights_valid": valid,
                           "weight_version": self.weight_version, "broken": session.broken},
                          rewrite_buffers=bool(session.loaded) and not session.valid_before,
                          forget_kv=bool(session.loaded))


def _stamps(called: float) -> dict[str, float]:
    """When the call reached the engine thread and when its report was done, as perf_counter() reads them
    (CLOCK_MONOTONIC on Linux: one clock for every process), for the API process's channel timings
    (EngineClient._with_channel)."""
    return {"called_s": called, "done_s": time.perf_counter()}


__all__ = ["SleepController", "SleepTarget", "SleepState", "SleepReport", "WeightSession", "SessionEnd"]
