"""Engine outputs → OpenAI JSON: whole responses, stream chunks, usage and log-probs.

Plain dicts rather than pydantic models: a stream builds one per token per client, and the shapes
are fixed by OpenAI's API reference, not by us.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from server.wire.logprob_list import LogprobList, WireLogprobs
from server.wire.outputs import CompletionOutput, RequestOutput, TokenLogprobs


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """Usage over every prompt of a request (a completions request may carry several)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, Any]]:
    """The k best alternatives by rank (the sampled token is in `entry` even when it ranks lower)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return [kv for kv in ranked if kv[1].rank is not None and kv[1].rank <= k][:k]


def _piece(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _finite(x: float) -> float:
    # JSON has no -Infinity: a token the grammar or a bias ruled out reports vLLM's floor instead.
    return max(x, -9999.0)


class TokenNames:
    """How a token is shown in log-probs: its text, or `token_id:N` (return_tokens_as_token_ids)."""

    def __init__(self, as_ids: bool):
        self.as_ids = as_ids

    def __call__(self, token: int, lp: Any) -> str:
        return f"token_id:{token}" if self.as_ids else _piece(lp)


class CompletionLogprobs:
    """Builds the completions `logprobs` object; `offset` carries text_offset across stream chunks.
    k = 0 still reports the sampled token in top_logprobs, as vLLM does."""

    def __init__(self, k: int, start_offset: int = 0, names: TokenNames | None = None, first_piece: str = ""):
        self.k = k
        self.offset = start_offset
        self.names = names or TokenNames(False)
        self.first_piece = first_piece  # the text of the prompt's first token (echo), which has no entry

    def build(self, token_ids: list[int], entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        if self.k == 0 and isinstance(entries, LogprobList):
            return self._sampled_only(token_ids, entries.wire)
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, entry in zip(token_ids, entries):
            offsets.append(self.offset)
            if entry is None:  # the first prompt token (echo): nothing predicts it
                piece = self.first_piece
                tokens.append(f"token_id:{tok}" if self.names.as_ids else piece)
                token_lps.append(None)
                tops.append(None)
                self.offset += len(piece)
                continue
            lp = entry[tok]
            tokens.append(self.names(tok, lp))
            token_lps.append(_finite(lp.logprob))
            alts = _top(entry, self.k) if self.k else [(tok, lp)]
            tops.append({self.names(t, alt): _finite(alt.logprob) for t, alt in alts})
            self.offset += len(_piece(lp))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _sampled_only(self, token_ids: list[int], wire: list[WireLogprobs]) -> dict[str, Any]:
        """build() for logprobs=0 (RL rollouts ask for it on every token of hundreds of sequences, all
        answered at the end of one request; TRL with return_tokens_as_token_ids): the same object from the
        engine's (token, logprob, rank, text) tuples, ~4x less work per token."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = self.offset
        as_ids = self.names.as_ids
        for tok, w in zip(token_ids, wire):
            value, piece = w[1], w[3]  # the sampled token's (token, logprob, rank, text) lead every tuple
            if piece is None:
                piece = ""
            if value < -9999.0:  # _finite
                value = -9999.0
            name = f"token_id:{tok}" if as_ids else piece
            offsets.append(offset)
            tokens.append(name)
            token_lps.append(value)
            tops.append({name: value})
            offset += len(piece)
        self.offset = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(entries: list[TokenLogprobs | None] | None, names: TokenNames) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": names(t, lp)} for t, lp in e.items()}
            for e in entries]


def chat_logprobs(token_ids: list[int], entries: list[TokenLogprobs], k: int,
                  names: TokenNames | None = None) -> dict[str, Any]:
    names = names or TokenNames(False)

    def item(tok: int, lp: Any) -> dict[str, Any]:
        name = names(tok, lp)
        return {"token": name, "logprob": _finite(lp.logprob), "bytes": list(_piece(lp).encode("utf-8"))}

    content = []
    for tok, entry in zip(token_ids, entries):
        row = item(tok, entry[tok])
        row["top_logprobs"] = [item(t, alt) for t, alt in _top(entry, k)]
        content.append(row)
    return {"content": content}


def routed_experts_json(routed: Any) -> dict[str, Any]:
    """A choice's routed experts, compactly: the array's bytes (C order, little-endian) in base64, with its
    dtype and shape [tokens, sparse layers, top-k] (docs/moe.md). A JSON list of lists would be ~3x larger."""
    arr = np.ascontiguousarray(routed)
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": base64.b64encode(little.tobytes()).decode()}


def completion_choice(index: int, o: CompletionOutput, text: str, logprobs: dict | None,
                      **extra: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason, **extra}


def chat_choice(o: CompletionOutput, logprobs: dict | None, **extra: Any) -> dict[str, Any]:
    return {"index": o.index, "message": {"role": "assistant", "content": o.text}, "logprobs": logprobs,
            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason, **extra}


def envelope(kind: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}


def encode_json(value: Any) -> bytes:
    """JSON as starlette's JSONResponse encodes it: compact, UTF-8, no NaN."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def encoded_envelope(kind: str, request_id: str, created: int, model: str, choice_parts: list[bytes],
                     **extra: Any) -> bytes:
    """encode_json(envelope(...)) with the choices already encoded: each part is one or more encoded choices,
    comma-separated, in the choices' order. (A quote inside a JSON string is escaped, so the empty list's
    bytes below occur once, where the choices go.)"""
    head = encode_json(envelope(kind, request_id, created, model, [], **extra))
    cut = head.index(b'"choices":[]') + len(b'"choices":[')
    return head[:cut] + b",".join(choice_parts) + head[cut:]
