"""Incremental detokenization that never splits a multi-byte character, and stop-string matching.

Both processes use it: the engine for the text its stop strings need (and for in-process callers), the API
process for the text of a streamed request without stop strings (SamplingParams.text_by_api), which the
engine sends as token ids only. So it lives in server.wire and imports neither torch nor the engine."""
from __future__ import annotations

import functools

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
        # The step's fast path (detokenize_step): with a byte-level decoder, while the prefix window is
        # whole tokens and nothing is pending, a whole token's new text is its own cached text.
        self.pieces = _fast_pieces(tokenizer)
        self.clean = self.pieces is not None and self._window_whole()

    def _window_whole(self) -> bool:
        """Every token of the window and of what is pending decodes to whole characters or to nothing (an id
        the tokenizer does not know): then the decode of the window plus one more such token is the
        window's text plus that token's."""
        pieces = self.pieces
        return pieces is not None and all(pieces[t] is not None for t in self.ids[self.prefix_offset:])

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """The text the new token completes; "" while it ends inside a multi-byte character."""
        prefix, full = self.push(token_id)
        return self.take(*decode_many(self.tokenizer, [prefix, full], self.skip))

    def push(self, token_id: int) -> tuple[list[int], list[int]]:
        """Record the token; the two windows whose texts `take` needs (decode_many can decode the
        windows of a whole step in one call)."""
        self.ids.append(token_id)
        return self.ids[self.prefix_offset:self.read_offset], self.ids[self.prefix_offset:]

    def take(self, prefix: str, full: str) -> str:
        """The new text, given the decoded windows of the last push."""
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            self.clean = self._window_whole()  # bytes pending: the next token goes through the tokenizer too
            return ""
        self._advance()
        self.clean = self._window_whole()
        return full[len(prefix):]

    def add_whole(self, token_id: int) -> str | None:
        """add() without the tokenizer, where it is not needed: while the window is `clean`, a token that
        decodes to whole characters (or to nothing) adds its own cached text. None (and nothing recorded)
        when the windows must be decoded."""
        if not self.clean:
            return None
        piece = self.pieces[token_id]  # type: ignore[index]
        if piece is None:
            return None
        self.ids.append(token_id)
        if piece:
            self._advance()
        # else an id the tokenizer drops: nothing new, and take() would leave it pending too
        return piece

    def _advance(self) -> None:
        """The text up to the last token is out: the window moves on."""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # Keep the window short: decoding cost stays constant however long the output grows.
        if self.prefix_offset > 64:
            drop = self.prefix_offset - _CONTEXT_TOKENS
            del self.ids[:drop]
            self.prefix_offset -= drop
            self.read_offset -= drop

    def flush(self) -> str:
        """At the end: whatever bytes are still pending, even if they do not form a character."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.ids)
        self.clean = self.pieces is not None  # an empty window
        return full[len(prefix):] if len(full) > len(prefix) else ""


def decode_many(tokenizer, windows: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """tokenizer.decode of each window. A fast tokenizer without clean-up (what decode then is: the
    Rust tokenizer's decode) decodes them all in one call: ~6x less per window than a decode call
    each through transformers (measured 49 -> 9 us on the loaded 2-core host, 256 windows). With a
    byte-level decoder, a window of tokens that each decode to whole characters is the concatenation of
    their texts (cached per token): no call at all for most windows of a step."""
    if not decodes_in_one_call(tokenizer):
        return [tokenizer.decode(w, skip_special_tokens=skip_special_tokens) for w in windows]
    backend = tokenizer.backend_tokenizer
    pieces = _whole_pieces(tokenizer)
    if pieces is None:
        return backend.decode_batch(windows, skip_special_tokens=skip_special_tokens)
    texts: list[str] = []
    rest: list[int] = []
    for i, w in enumerate(windows):
        try:
            texts.append("".join([pieces[t] for t in w]))
        except TypeError:  # a token that is special, or only part of a character: the tokenizer decides
            texts.append("")
            rest.append(i)
    if rest:
        for i, text in zip(rest, backend.decode_batch([windows[i] for i in rest],
                                                      skip_special_tokens=skip_special_tokens)):
            texts[i] = text
    return texts


class _WholePieces(dict):
    """token id -> its text when the token is a plain vocabulary token that decodes to whole characters,
    "" for an id the tokenizer does not know (decode drops it: a model whose vocabulary is larger than its
    tokenizer's samples them), else None. A byte-level decoder (GPT-2's, Llama 3's, SmolLM2's) maps each
    token to bytes and decodes their concatenation, so a window of such tokens decodes to the concatenation
    of their texts. Added tokens (special or not: a skip may drop either) always go to the tokenizer."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.special = set(tokenizer.backend_tokenizer.get_added_tokens_decoder()) | set(tokenizer.all_special_ids)

    def __missing__(self, token_id: int) -> str | None:
        text = None
        backend = self.tokenizer.backend_tokenizer
        if token_id not in self.special:
            try:
                known = backend.id_to_token(token_id) is not None
            except (OverflowError, TypeError):  # not a token id at all: the tokenizer decides
                known = True
            if not known:
                text = ""
            else:
                decoded = backend.decode([token_id], skip_special_tokens=False)
                if decoded and "\ufffd" not in decoded:
                    text = decoded
        self[token_id] = text
        return text


@functools.lru_cache(maxsize=8)
def _whole_pieces(tokenizer) -> _WholePieces | None:
    decoder = getattr(tokenizer.backend_tokenizer, "decoder", None)
    return _WholePieces(tokenizer) if type(decoder).__name__ == "ByteLevel" else None


def decodes_in_one_call(tokenizer) -> bool:
    """A fast tokenizer that cleans up no spaces: its decode is the Rust tokenizer's, so decode_many decodes
    many windows in one call, and a longer window's text extends a shorter one's."""
    return (getattr(tokenizer, "backend_tokenizer", None) is not None
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True))


def _fast_pieces(tokenizer) -> _WholePieces | None:
    """The whole-token texts decode_many would join for this tokenizer, or None where it asks the
    tokenizer for every window (no fast tokenizer, a clean-up of spaces, a decoder that is not byte-level)."""
    return _whole_pieces(tokenizer) if decodes_in_one_call(tokenizer) else None


def detokenize_step(pairs: list[tuple[IncrementalDetokenizer, int]]) -> list[str]:
    """IncrementalDetokenizer.add for one new token of each of many sequences, decoded together.

    Most tokens take the fast path: a detokenizer whose window is whole tokens with no bytes pending
    (`clean`) and a new token that decodes to whole characters (or to nothing): its text is the token's cached text,
    with no window built, joined or compared (what add() would return, by the byte-level decoder's
    concatenation; tests/engine/test_detokenizer.py checks it on random ids). The others are decoded together."""
    out: list[str] = [""] * len(pairs)
    slow: list[int] = []
    for i, (d, t) in enumerate(pairs):
        piece = d.add_whole(t) if d.clean else None
        if piece is None:
            slow.append(i)
        else:
            out[i] = piece
    if not slow:
        return out
    windows = {i: pairs[i][0].push(pairs[i][1]) for i in slow}
    texts: dict[int, tuple[str, str]] = {}
    groups: dict[tuple[int, bool], list[int]] = {}  # one decode call per (tokenizer, skip) in the step
    for i in slow:
        d = pairs[i][0]
        groups.setdefault((id(d.tokenizer), d.skip), []).append(i)
    for rows in groups.values():
        d = pairs[rows[0]][0]
        flat = [w for i in rows for w in windows[i]]
        decoded = decode_many(d.tokenizer, flat, d.skip)
        for j, i in enumerate(rows):
            texts[i] = (decoded[2 * j], decoded[2 * j + 1])
    for i in slow:
        out[i] = pairs[i][0].take(*texts[i])
    return out


def prefix_stable(tokenizer) -> bool:
    """Whether decoding the tokens of a text in one go gives what IncrementalDetokenizer gives token by
    token (concatenated, with its flush): true of a fast tokenizer that cleans up no spaces (the decode of
    a longer window then extends the shorter one's text; tests/engine/test_detokenizer.py checks it on random ids)."""
    return decodes_in_one_call(tokenizer)


def detokenize_many(tokenizer, jobs: list[tuple[list[int], list[int]]], skip_special_tokens: bool) -> list[str]:
    """The text of each (prompt ids, output ids)'s output after its prompt, decoded at once (sequences whose
    text is wanted only at their end): the same context as IncrementalDetokenizer, two windows a job, all in
    one decode_many call, so the sequences that end in the same step (a rollout's wave of 256) decode together
    (on the 2-core CI host, 256 x 512 tokens: 79 ms one by one, 32 ms at once)."""
    windows: list[list[int]] = []
    for prompt_ids, output_ids in jobs:
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        windows += [context, context + list(output_ids)]
    texts = decode_many(tokenizer, windows, skip_special_tokens)
    return [full[len(prefix):] if len(full) > len(prefix) else "" for prefix, full in zip(texts[::2], texts[1::2])]


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
