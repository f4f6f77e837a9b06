"""What a sleep call means, decided before anything is touched (docs/sleep.md).

A plan names what each tag should become; SleepController compares it with what the tags are and
either applies the difference, answers that nothing changes (an idempotent repeat), or refuses.
"""
from __future__ import annotations

from dataclasses import dataclass

from server.wire.params import InvalidRequestError
from server.wire.tags import CUDA_GRAPH, KV_CACHE, USER_TAGS, WEIGHTS, parse_tags

MODES = ("abort", "wait", "keep")
OFFLOADED, DISCARDED = "offloaded", "discarded"

# Per level, what each user tag becomes. The graph tag is always backed up (a graph is small and
# re-capturing it would change addresses), and it sleeps with the first tag that sleeps.
LEVEL_ACTIONS: dict[int, dict[str, str]] = {
    0: {},
    1: {WEIGHTS: OFFLOADED, KV_CACHE: DISCARDED},
    2: {WEIGHTS: DISCARDED, KV_CACHE: DISCARDED},
}
INTERNAL_ACTIONS: dict[str, str] = {CUDA_GRAPH: OFFLOADED}
# Every tag some level backs up to host memory: the backups prepared at start-up.
OFFLOADED_TAGS: tuple[str, ...] = tuple(dict.fromkeys(
    t for actions in (*LEVEL_ACTIONS.values(), INTERNAL_ACTIONS) for t, a in actions.items() if a == OFFLOADED))


@dataclass(frozen=True)
class SleepPlan:
    level: int
    mode: str
    want: dict[str, str]          # user tag -> offloaded | discarded (empty for level 0, a pause)
    clear_cache: bool = False     # pause only: reset the prefix cache too

    @classmethod
    def make(cls, level: int, tags: str | list[str] | tuple[str, ...] | None, mode: str,
             clear_cache: bool = False) -> "SleepPlan":
        if level not in LEVEL_ACTIONS:
            raise InvalidRequestError(f"level must be 0, 1 or 2, got {level}", param="level")
        if mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {', '.join(MODES)}, got {mode!r}", param="mode")
        chosen = parse_tags(tags)
        if chosen is not None and level == 0:
            raise InvalidRequestError("level 0 keeps all memory; tags apply to levels 1 and 2", param="tags")
        selected = chosen or USER_TAGS
        return cls(level=level, mode=mode, want={t: LEVEL_ACTIONS[level][t] for t in selected if level},
                   clear_cache=clear_cache)
