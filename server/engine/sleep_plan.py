"""What a sleep call means, decided before anything is touched (docs/architecture.md, "Sleep semantics")."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.params import InvalidRequestError

TAGS = ("weights", "kv_cache", "cuda_graph")
MODES = ("abort", "wait", "keep")

# Per level, what happens to each tag: "offload" (back up, restore on wake), "discard", or kept awake.
LEVEL_ACTIONS: dict[int, dict[str, str]] = {
    0: {},
    1: {"weights": "offload", "kv_cache": "discard", "cuda_graph": "offload"},
    2: {"weights": "discard", "kv_cache": "discard", "cuda_graph": "offload"},
}


def check_tags(tags: list[str] | None, param: str = "tags") -> list[str] | None:
    if not tags:
        return None
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise InvalidRequestError(f"unknown tag {unknown[0]!r}; tags are {', '.join(TAGS)}", param=param)
    return list(dict.fromkeys(tags))


@dataclass(frozen=True)
class SleepPlan:
    level: int
    mode: str
    offload: tuple[str, ...]
    discard: tuple[str, ...]

    @property
    def tags(self) -> tuple[str, ...]:
        return self.offload + self.discard

    @classmethod
    def make(cls, level: int, tags: list[str] | None, mode: str) -> "SleepPlan":
        if level not in LEVEL_ACTIONS:
            raise InvalidRequestError(f"level must be 0, 1 or 2, got {level}", param="level")
        if mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(MODES)}, got {mode!r}", param="mode")
        chosen = check_tags(tags)
        if chosen is not None and level == 0:
            raise InvalidRequestError("level 0 keeps all memory; tags apply to levels 1 and 2", param="tags")
        actions = LEVEL_ACTIONS[level]
        selected = chosen if chosen is not None else list(TAGS)
        return cls(level=level, mode=mode,
                   offload=tuple(t for t in selected if actions.get(t) == "offload"),
                   discard=tuple(t for t in selected if actions.get(t) == "discard"))


def refusal(state: dict) -> tuple[str, str] | None:
    """Why new generation is refused in this sleep state (EngineCore.sleep_state()'s dict; missing
    keys count as awake), as (code, message), or None when it can be served. The checks are in
    order of precedence: the engine, the fast 503 path, /health and /metrics all read this one."""
    if state.get("draining"):
        return "draining", "the server is draining requests before it sleeps; retry after it wakes"
    if state.get("sleeping_tags"):
        return "sleeping", (f"the server is sleeping ({', '.join(state['sleeping_tags'])} asleep); "
                            "wake it with POST /wake_up")
    if not state.get("weights_valid", True):
        return "weights_invalid", ("the weights are not whole (discarded by sleep level 2, or a weight update is "
                                   "in progress or broke off); load weights with POST /update_weights")
    if state.get("paused"):
        return "paused", "the server is paused; resume it with POST /resume or POST /wake_up"
    return None
