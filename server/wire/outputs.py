"""What the engine hands back: the vLLM shape (`out.outputs[i].text`, `.token_ids`, `.finish_reason`),
plus the deltas since the previous output, which streaming needs."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


# The lowest log-prob reported: -inf (a token masked out) and NaN are sent as this, since JSON has neither.
LOGPROB_FLOOR = -9999.0


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top-k).
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # Read as lists of TokenLogprobs; they are logprob_list.LogprobList, which builds each dict when read.
    logprobs: Sequence[TokenLogprobs] | None = None
    finish_reason: str | None = None        # "stop" | "length" | "abort"
    stop_reason: int | str | None = None    # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: Sequence[TokenLogprobs] | None = None
    # With return_routed_experts, once finished: the experts each token was routed to, an integer array
    # [prompt + generated - 1 tokens, sparse layers, top-k] (vLLM's layout; server/engine/routed_experts.py).
    routed_experts: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When the engine saw the request (time.monotonic()): vLLM's queue, prefill and decode times. Not
    frozen: a frozen dataclass's __init__ costs 2.5x, and one is built per request per step in process."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (vLLM's shape).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
