"""Incremental detokenization that never splits a multi-byte character, and stop-string matching."""
from __future__ import annotations

# Tokens of context decoded before the new ones, so tokenizers that mark word starts
# (SentencePiece's leading space) render the first new token as they would mid-text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """The text the new token completes; "" while it ends inside a multi-byte character."""
        self.ids.append(token_id)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # Keep the window short: decoding cost stays constant however long the output grows.
        if self.prefix_offset > 64:
            drop = self.prefix_offset - _CONTEXT_TOKENS
            del self.ids[:drop]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return full[len(prefix):]

    def flush(self) -> str:
        """At the end: whatever bytes are still pending, even if they do not form a character."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last `new_chars` characters: (start, stop)."""
    longest = max(map(len, stops))
    window_start = max(0, len(text) - new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, window_start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
