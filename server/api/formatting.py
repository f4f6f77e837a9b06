"""Engine outputs → OpenAI JSON: whole responses, stream chunks, usage and log-probs.

Plain dicts rather than pydantic models: a stream builds one per token per client, and the shapes
are fixed by OpenAI's API reference, not by us.
"""
from __future__ import annotations

from typing import Any

from server.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, Any]]:
    """The k best alternatives by rank (the sampled token is in `entry` even when it ranks lower)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return [kv for kv in ranked if kv[1].rank is not None and kv[1].rank <= k][:k]


def _piece(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


class CompletionLogprobs:
    """Builds the completions `logprobs` object; `offset` carries text_offset across stream chunks."""

    def __init__(self, k: int, start_offset: int = 0):
        self.k = k
        self.offset = start_offset

    def build(self, token_ids: list[int], entries: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, entry in zip(token_ids, entries):
            lp = entry[tok]
            piece = _piece(lp)
            tokens.append(piece)
            token_lps.append(lp.logprob)
            tops.append({_piece(alt): alt.logprob for _, alt in _top(entry, self.k)} if self.k else None)
            offsets.append(self.offset)
            self.offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[TokenLogprobs], k: int) -> dict[str, Any]:
    def item(lp: Any) -> dict[str, Any]:
        piece = _piece(lp)
        return {"token": piece, "logprob": lp.logprob, "bytes": list(piece.encode("utf-8"))}

    content = []
    for tok, entry in zip(token_ids, entries):
        row = item(entry[tok])
        row["top_logprobs"] = [item(alt) for _, alt in _top(entry, k)]
        content.append(row)
    return {"content": content}


def completion_choice(o: CompletionOutput, text: str, logprobs: dict | None) -> dict[str, Any]:
    return {"index": o.index, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason}


def chat_choice(o: CompletionOutput, logprobs: dict | None) -> dict[str, Any]:
    return {"index": o.index, "message": {"role": "assistant", "content": o.text}, "logprobs": logprobs,
            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}


def envelope(kind: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
             **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}
