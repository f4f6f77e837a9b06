"""The plain values a step hands from stage to stage: the scheduler's ScheduledBatch (which sequences run, how
many new tokens each) goes to the model runner, and the runner's StepResult (token ids, log-probs, grammars
done) goes back to Scheduler.update_from_output, the one place that applies it to the sequences."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.wire.logprob_list import WireLogprobs
from server.wire.outputs import TokenLogprobs

if TYPE_CHECKING:
    from server.engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    items: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: int = 0
    num_tokens: int = 0  # the sum of new tokens
    # Scheduler.removals when it was made: while it is the same, every sequence of the batch still runs.
    mark: tuple[int, int] = (0, 0)

    @property
    def decode_only(self) -> bool:
        """Every item is one token (the steady state of generation)."""
        return self.num_tokens == len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass
class StepResult:
    """What a step computed, as plain values (ModelRunner's answer; Scheduler.update_from_output applies it).
    Row i of the sampled lists belongs to the sequence seq_ids[i]."""
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[WireLogprobs | None] | None = None     # per row, when any row asked (logprob_list.py)
    prompt_logprobs: list[tuple[str, list[TokenLogprobs]]] = field(default_factory=list)  # (request id, new entries)
    grammar_done: set[int] = field(default_factory=set)   # seq ids whose grammar admits no further token
    # Routed experts of the sequences that asked (routed_experts.py): (seq id, first position, rows
    # [positions, sparse layers, top-k]).
    routed_experts: list[tuple[int, int, Any]] = field(default_factory=list)


__all__ = ["ScheduledBatch", "StepResult"]
