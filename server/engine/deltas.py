"""The engine process's side of the wire format: what is new in a request since its last delta
(server/wire/messages.py documents the Delta tuple). It reads the engine's Request, so it lives here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from server.wire.messages import Delta

if TYPE_CHECKING:
    from server.engine.sequence import Request


def encode_delta(req: "Request") -> Delta:
    """What is new in a request since its last delta, straight from the engine's Request (on the engine
    thread; EngineCore.wire_outputs): the API keeps the rest. A sequence whose end was sent is left out.
    A plain stream's middle steps take the short form (messages.py)."""
    if req.started_sent and len(req.seqs) == 1 and not req.finished and req.prompt_logprobs is None:
        s = req.seqs[0]
        if s.finish_reason is None and s.logprobs is None:
            if s.lazy_text_tokenizer is not None:  # the API makes its text: the ids are all that is new
                return (req.request_id, s.new_ids(), "", req.num_cached_tokens)
            _, new_text, new_ids, _ = s.delta()
            return (req.request_id, new_ids, new_text, req.num_cached_tokens)
    first = not req.started_sent
    req.started_sent = True
    prompt_logprobs = None
    if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and not req.prompt_logprobs_pending:
        prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
    seqs = []
    for s in req.seqs:
        if s.finish_reason is not None:
            if s.end_sent:
                continue  # the API has its end already
            s.end_sent = True
        text, new_text, new_ids, new_logprobs = s.delta()
        ended = s.finish_reason is not None
        seqs.append((s.index, new_ids, new_text, new_logprobs,
                     s.cumulative_logprob if s.logprobs is not None else None, s.finish_reason, s.stop_reason,
                     text if ended else None, s.routed_output() if ended else None))
    finished = req.finished
    metrics = None
    if finished:
        metrics = (req.arrival_time, req.first_scheduled_time, req.first_token_time, req.last_token_time,
                   req.num_preemptions)
    return (req.request_id, seqs, finished, req.num_cached_tokens,
            req.prompt_token_ids if first else None, prompt_logprobs, metrics)


__all__ = ["encode_delta"]
