"""A request and the sequences it samples (n of them), with their KV-cache and output state."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from server.wire.detokenizer import IncrementalDetokenizer, detokenize_many, find_stop
from server.wire.logprob_list import LogprobList, WireLogprobs
from server.wire.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from server.wire.params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sampled continuation. Its tokens are prompt + output; `num_computed` of them have KV in
    the cache (held in `block_table`). Only the scheduler writes num_computed; preemption resets it
    and the KV is recomputed later."""

    def __init__(self, seq_id: int, request: "Request", index: int, generator: torch.Generator | None,
                 lazy_text_tokenizer=None):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.params = request.params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chain hashes of this sequence's full, computed blocks
        self.status = SeqStatus.WAITING
        self.generator = generator
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        # One WireLogprobs tuple per sampled token (logprob_list.py: not a dict per token)
        self.logprobs: list[WireLogprobs] | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.num_cached_tokens = 0
        self.detok: IncrementalDetokenizer | None = None
        # Text only at the end (a FINAL_ONLY request without stop strings: nothing reads it before, and
        # no check needs it): the tokenizer to decode all output tokens with, once it has ended (owed_text,
        # settled with the step's other ended sequences by settle_texts, or by delta()).
        self.lazy_text_tokenizer = lazy_text_tokenizer
        # Once it ended: (tokenizer, the output ids its text is) until settle_texts decodes it, with the other
        # sequences that ended in the same step.
        self.owed_text: tuple | None = None
        # Structured outputs: this sequence's grammar state. Only GrammarMasks (grammar_masks.py) touches
        # it after this: it consumes each sampled token and computes the next mask off the engine thread.
        self.matcher = self.params.grammar.matcher() if self.params.grammar is not None else None
        # What has been handed out already, so each output carries only the new part as its delta.
        self._emitted_text = 0
        self._emitted_tokens = 0
        self.end_sent = False  # the engine process sent its end (channel.encode_delta): nothing more of it
        # With return_routed_experts: the experts each position was routed to (routed_experts.py), by position.
        self.routed_experts: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def lazy_text(self) -> bool:
        return self.lazy_text_tokenizer is not None

    def append(self, token_id: int, logprobs: WireLogprobs | None, eos_ids: frozenset[int],
               max_model_len: int, tokenizer, grammar_complete: bool = False) -> None:
        """Record a sampled token and decide whether the sequence is done. (A step does the same for
        all its sequences in three passes, so their detokenization is one call: core.postprocess.)"""
        if not self.append_token(token_id, logprobs, eos_ids):
            return
        delta = "" if self.lazy_text else self.detokenizer(tokenizer).add(token_id)
        self.append_text(delta, max_model_len, grammar_complete)

    def append_token(self, token_id: int, logprobs: WireLogprobs | None, eos_ids: frozenset[int]) -> bool:
        """First half of append: record the token, finish on EOS or a stop token. True while the
        sequence goes on: then the token's text (append_text) comes next."""
        self.token_ids.append(token_id)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[1]  # (the sampled token's id, its logprob, ...)
        p = self.params
        if not ((token_id in eos_ids and not p.ignore_eos) or token_id in p.stop_token_ids):
            return True  # the common case: one set and one (mostly empty) list looked up
        is_eos = (not p.ignore_eos) and token_id in eos_ids
        if len(self.token_ids) - self.num_prompt_tokens >= p.min_tokens:
            self.finish_reason = "stop"
            self.stop_reason = None if is_eos and token_id not in p.stop_token_ids else token_id
            self._finish_text(last_is_text=False)  # a stop token is not part of the text
            return False
        return True

    def detokenizer(self, tokenizer) -> IncrementalDetokenizer:
        if self.detok is None:
            self.detok = IncrementalDetokenizer(tokenizer, self.request.prompt_token_ids, self.params.skip_special_tokens)
        return self.detok

    def append_text(self, delta: str, max_model_len: int, grammar_complete: bool = False) -> None:
        """Second half: the new token's text: stop strings, a completed grammar (grammar_complete: having
        consumed this token, it admits nothing more), the length limits."""
        p = self.params
        n = len(self.token_ids)
        if delta:
            self.text += delta
            if p.stop and n - self.num_prompt_tokens >= p.min_tokens and self._check_stop_strings(len(delta)):
                return
        if grammar_complete:  # not even EOS may follow: the output is whole
            self.finish_reason = "stop"
            self._finish_text()
            return
        if n >= max_model_len or (p.max_tokens is not None and n - self.num_prompt_tokens >= p.max_tokens):
            self.finish_reason = "length"
            self._finish_text()

    def _check_stop_strings(self, new_chars: int) -> bool:
        hit = find_stop(self.text, self.params.stop, new_chars)
        if hit is None:
            return False
        start, stop = hit
        self.text = self.text[: start + len(stop)] if self.params.include_stop_str_in_output else self.text[:start]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _finish_text(self, last_is_text: bool = True) -> None:
        if self.lazy_text:
            ids = self.output_token_ids
            self.owed_text = (self.lazy_text_tokenizer, ids if last_is_text else ids[:-1])
            self.lazy_text_tokenizer = None  # the text is whole: nothing is added after the end
            return
        if self.detok is not None:
            tail = self.detok.flush()
            if tail:
                self.text += tail
                if self.params.stop and self._check_stop_strings(len(tail)):
                    return

    def abort(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "abort"
            if self.lazy_text:  # what it had generated, as a sequence that was read along would show it
                self._finish_text()  # owed: delta() decodes it

    def delta(self) -> tuple[str, str, list[int], list | None]:
        """(the text as it may be shown, its new part, the new token ids, the new log-probs) since the last
        call, which marks them handed out. While generating, text that might be the start of a stop string
        is held back, so a client never sees text that is later cut off."""
        if self.owed_text is not None:  # ended outside a step's settle_texts (EngineCore.postprocess)
            settle_texts([self])
        text = self.text
        if self.finish_reason is None and self.params.stop:
            hold = max(map(len, self.params.stop)) - 1
            text = text[: max(self._emitted_text, len(text) - hold)]
        emitted = self._emitted_tokens
        new_ids = self.token_ids[self.num_prompt_tokens + emitted:]
        new_logprobs = self.logprobs[emitted:] if self.logprobs is not None else None
        new_text = text[self._emitted_text:]
        self._emitted_text, self._emitted_tokens = len(text), emitted + len(new_ids)
        return text, new_text, new_ids, new_logprobs

    def new_ids(self) -> list[int]:
        """delta()'s new token ids alone, marked handed out: all delta() says of a sequence still generating whose
        text the API makes (lazy text: none here) and that samples no log-probs. The streamed middle steps' path
        (encode_delta's short form), without delta()'s text and stop-string bookkeeping."""
        start = self.num_prompt_tokens + self._emitted_tokens
        ids = self.token_ids[start:]
        self._emitted_tokens += len(ids)
        return ids

    def output(self) -> CompletionOutput:
        """A snapshot: the whole so far, and the delta since the last snapshot (built every step for every
        request an in-process caller reads along: positional arguments, one copy of the token ids)."""
        text, new_text, new_ids, new_logprobs = self.delta()
        lps = self.logprobs
        return CompletionOutput(
            self.index, text, self.token_ids[self.num_prompt_tokens:],
            self.cumulative_logprob if lps is not None else None, LogprobList(lps[:]) if lps is not None else None,
            self.finish_reason, self.stop_reason, new_text, new_ids,
            LogprobList(new_logprobs) if new_logprobs is not None else None,
            self.routed_output() if self.finish_reason is not None else None)

    def routed_output(self) -> np.ndarray | None:
        """With return_routed_experts, the rows of every token that went through the model (all but the
        last sampled one): [tokens, sparse layers, top-k]."""
        held = self.routed_experts
        if held is None or not self.params.return_routed_experts:
            return None
        return held[:self.num_tokens - 1].copy()


def settle_texts(seqs: list[Sequence]) -> None:
    """Decode the owed text of every sequence in seqs that ended with one (a lazy text), in one call per
    tokenizer and skip_special_tokens setting."""
    groups: dict[tuple, list[Sequence]] = {}
    for s in seqs:
        if s.owed_text is not None:
            groups.setdefault((id(s.owed_text[0]), s.params.skip_special_tokens), []).append(s)
    for (_, skip), group in groups.items():
        texts = detokenize_many(group[0].owed_text[0], [(s.request.prompt_token_ids, s.owed_text[1]) for s in group],
                                skip)
        for s, text in zip(group, texts):
            s.text, s.owed_text = text, None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    # Called (on the engine's thread) with each new RequestOutput.
    on_output: Callable[[RequestOutput], None] | None = None
    # time.monotonic() of arrival, first scheduling, first and last sampled token (vllm: latency metrics)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0  # times one of its sequences lost its KV and recomputed it (vllm:request_num_preemptions)
    # params.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it);
    # filled chunk by chunk as the prefill runs (runner.prepare picks the rows).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # What the engine process sent the API already (channel.encode_delta): the first delta, the prompt log-probs.
    started_sent: bool = False
    prompt_logprobs_sent: bool = False
    # Steps with news since the last output handed out (config.stream_interval: every N steps, not every one).
    steps_unsent: int = 0

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt log-probs asked for and not all computed yet (then prefix-cache hits are skipped)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all() over a generator: read for every request at every step
            if s.finish_reason is None:
                return False
        return True

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache gave the request (the most any of its sequences got)."""
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].num_cached_tokens
        return max((s.num_cached_tokens for s in seqs), default=0)

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [s.output() for s in self.seqs], self.finished,
            self.num_cached_tokens, None if self.prompt_logprobs_pending else self.prompt_logprobs,
            RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time, self.last_token_time,
                           self.num_preemptions))
