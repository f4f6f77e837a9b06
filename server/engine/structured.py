"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance, and
their token masks applied to the logits in the sampler.

Compiling can take long for a big schema, so the server compiles off the engine thread (the API
awaits `GrammarCompiler.compile` in a worker thread) and caches by spec; each sequence then gets a
cheap copy of the compiled matcher. On every step the masks of all constrained rows are computed
on the CPU (llguidance, in parallel, without the GIL), copied to the device in one transfer and
applied to their rows at once.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from server.engine.params import InvalidRequestError, StructuredOutputs

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


def _grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for a spec; ValueError for one that cannot be read."""
    import llguidance

    if spec.json_object or spec.json is not None:
        schema = {"type": "object"} if spec.json_object else spec.json
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema if isinstance(schema, str) else json.dumps(schema),
            defaults={"whitespace_flexible": spec.whitespace_flexible})
    if spec.regex is not None:
        return llguidance.grammar_from("regex", spec.regex)
    if spec.choice is not None:
        if not spec.choice or not all(isinstance(c, str) for c in spec.choice):
            raise ValueError("choice must be a non-empty list of strings")
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    return llguidance.grammar_from("grammar", spec.grammar or "")


def _cache_key(spec: StructuredOutputs) -> str:
    return json.dumps([spec.json, spec.regex, spec.choice, spec.grammar, spec.json_object, spec.whitespace_flexible],
                      sort_keys=True)


class CompiledGrammar:
    """A compiled grammar; `matcher()` hands each sequence its own state."""

    def __init__(self, template) -> None:
        self._template = template

    def matcher(self):
        return self._template.deep_copy()


class GrammarCompiler:
    """Thread-safe: the API's worker threads compile, the engine thread only reads the cache."""

    def __init__(self, tokenizer, vocab_size: int):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            # About 0.4 s for a 49k vocabulary: once, on the first constrained request.
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs, param: str = "structured_outputs") -> CompiledGrammar:
        key = _cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            tokenizer = self._tokenizer()
        import llguidance

        try:
            text = _grammar_text(spec)
        except Exception as e:  # malformed schema / regex / grammar text
            raise InvalidRequestError(f"{param}: the grammar could not be compiled: {e}", param) from None
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{param}: the grammar could not be compiled: {matcher.get_error()}", param)
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


_executor = None


def _llg_executor():
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


class _Staging:
    """The packed masks of one step: [rows, words] int32, one bit per token. Reused across steps
    (pinned on CUDA, so the copy to the device is one asynchronous transfer)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.shifts: dict[torch.device, torch.Tensor] = {}

    def get(self, rows: int, words: int, pin: bool) -> torch.Tensor:
        b = self.buffer
        if b is None or b.shape[0] < rows or b.shape[1] != words or b.is_pinned() != pin:
            b = self.buffer = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=pin)
        return b[:rows]


_staging = _Staging()


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set to -inf every logit the grammar forbids, for the given rows of logits [N, V], in place.
    Columns past the tokenizer's vocabulary (padded embedding rows) are always forbidden."""
    import llguidance.torch as llt

    V = logits.shape[-1]
    words = (V + 31) // 32
    dev = logits.device
    packed = _staging.get(len(rows), words, pin=dev.type == "cuda")
    llt.fill_next_token_bitmask_par(_llg_executor(), [(m, i) for i, m in enumerate(matchers)], packed)
    if dev.type == "cuda":
        # 32x less to copy than a bool mask; the device unpacks it.
        shifts = _staging.shifts.get(dev)
        if shifts is None:
            shifts = _staging.shifts[dev] = torch.arange(32, dtype=torch.int32, device=dev)
        bits = packed.to(dev, non_blocking=True)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(rows), words * 32)[:, :V].bool()
    else:
        # Bit j of word w is token 32 w + j: on a little-endian host that is byte order, bit by bit.
        # unpackbits writes 0/1 bytes: valid bools as they are, so the view costs nothing.
        unpacked = np.unpackbits(packed.numpy().view(np.uint8), axis=-1, bitorder="little")
        allowed = torch.from_numpy(unpacked).view(torch.bool)[:, :V]
    forbidden = allowed.logical_not_()
    if len(rows) == logits.shape[0]:  # rows are always in order: all of them, or a subset
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=dev)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
