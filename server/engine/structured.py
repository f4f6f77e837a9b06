"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance.

Compiling can take long for a big schema, so the server compiles off the engine thread (the API
awaits `GrammarCompiler.compile` in a worker thread) and caches by spec; each sequence then gets a
cheap copy of the compiled matcher. Its token masks, step by step, are grammar_masks.py's.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

from server.wire.params import InvalidRequestError, StructuredOutputs

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
