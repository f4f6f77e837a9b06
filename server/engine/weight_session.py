"""Weight updates that arrive in pieces (vLLM's start / update... / finish), as engine policy.

The bytes move on the transfer thread; these functions run on the engine thread around them and
decide what the weights are worth:
- start opens a session; update calls outside a session are sessions of their own.
- begin_write stops stepping (transfer_active) and marks the weights invalid: from the first
  byte until finish they may be a mix of two versions, and nothing is served from a mix.
- end_write records what landed. A write that failed after bytes landed breaks the session:
  the weights stay invalid (503 weights_invalid) until a complete update (every parameter); so
  does a failed write after earlier writes of the same session landed.
- finish makes the weights valid again if the session was whole and the weights were valid
  before it (a partial update of valid weights is what the trainer asked for); if they were
  invalid before (sleep level 2, a broken transfer), only once every parameter was reloaded.
  It also sets weight_version.
The state they change (weights_valid, the parameters reloaded, weight_version, transfer_active, the
open session) belongs to the engine's SleepController; these functions are its policy for transfers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.errors import ConflictError
from server.model.loader import parameter_names

if TYPE_CHECKING:
    from server.engine.core import EngineCore


@dataclass
class WeightSession:
    valid_before: bool
    explicit: bool
    loaded: set[str] = field(default_factory=set)
    broken: bool = False
    writes: int = 0


def check_writable(core: "EngineCore") -> None:
    core.sleep_control.check_weight_update()


def start(core: "EngineCore") -> dict:
    check_writable(core)
    ctl = core.sleep_control
    previous = ctl.weight_session
    ctl.weight_session = WeightSession(valid_before=ctl.weights_valid, explicit=True)
    return {"restarted": previous is not None, "weights_valid": ctl.weights_valid}


def begin_write(core: "EngineCore") -> None:
    check_writable(core)
    core.drain()  # a step in flight (async scheduling) reads the weights: it ends before the first byte lands
    ctl = core.sleep_control
    if ctl.weight_session is None:
        ctl.weight_session = WeightSession(valid_before=ctl.weights_valid, explicit=False)
    ctl.transfer_active = True
    ctl.weights_valid = False
    ctl.publish()


def end_write(core: "EngineCore", loaded: set[str], failed: bool) -> dict | None:
    """Returns finish()'s report for a one-call session, else None."""
    ctl = core.sleep_control
    ctl.transfer_active = False
    session = ctl.weight_session
    assert session is not None, "end_write without begin_write"
    session.writes += 1
    if failed and (loaded or session.loaded):
        # Bytes of this update landed (in this write or an earlier one of the session) and the rest
        # never will: whatever the trainer does next, these weights are not a version it sent.
        session.broken = True
        session.loaded = set()
        ctl.reloaded = set()  # a complete update is needed now
    else:
        session.loaded |= loaded
    if failed and not session.loaded and not session.broken and session.writes == 1:
        ctl.weights_valid = session.valid_before  # nothing landed: nothing changed
        if not session.explicit:
            ctl.weight_session = None
        ctl.publish()
        return None
    if not session.explicit and not failed:
        return finish(core, None)
    ctl.publish()
    return None


def finish(core: "EngineCore", weight_version: str | None) -> dict:
    ctl = core.sleep_control
    session = ctl.weight_session
    if ctl.transfer_active:
        raise ConflictError("a weight transfer is still in progress; finish after it returns")
    ctl.weight_session = None
    if session is None:
        return {"tensors": 0, "weights_valid": ctl.weights_valid, "weight_version": ctl.weight_version}
    if session.valid_before and not session.broken:
        valid = True
    else:
        ctl.reloaded |= session.loaded
        valid = parameter_names(core.model) <= ctl.reloaded
    ctl.weights_valid = valid
    if session.loaded:
        if not session.valid_before:
            # Buffers derived from the config (rotary tables) live under the weights tag too: a level-2
            # sleep discarded them with the weights, so write them again (as a disk load does). Weights
            # that were valid when the session began were not discarded, nor were the tables: not
            # recomputed then (on the CPU, ~2 ms at 1K positions, ~85 ms at 32K: more than the transfer).
            core.model.init_buffers()
        # KV computed with the old weights must never be reused (requests kept by a pause recompute theirs).
        core.preempt_all()
        core.blocks.reset_prefix_cache()
        ctl.weight_updates += 1
        ctl.weight_version = weight_version if weight_version is not None else str(ctl.weight_updates)
    elif weight_version is not None:
        ctl.weight_version = weight_version
    ctl.publish()
    return {"tensors": len(session.loaded), "weights_valid": valid, "weight_version": ctl.weight_version,
            "broken": session.broken}
