"""Turn logits into tokens: penalties, bias, min_tokens, temperature, top-k/top-p/min-p, seeds, log-probs.

Rows that need no history (the common case) are handled as one batch; only rows that ask for
penalties, a bias or min_tokens touch their own slice. Grammar masks (structured outputs) are applied
before this, by the runner (grammar_masks.py). Prompt log-probs are scored here too, from the
prefill's hidden states.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from server.engine.outputs import Logprob, TokenLogprobs
from server.engine.sequence import Sequence

LOGPROB_FLOOR = -9999.0


def _apply_history(row: torch.Tensor, seq: Sequence, stop_ids: list[int]) -> None:
    """Edit one row of logits in place with what depends on this sequence's history and params."""
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), device=row.device, dtype=torch.long)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype))
    if p.min_tokens and seq.num_output_tokens < p.min_tokens and stop_ids:
        row[torch.tensor(stop_ids, device=row.device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device, dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = seq.output_token_ids
        if out:
            counts = torch.bincount(torch.tensor(out, device=row.device), minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _filter(scaled: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """top-k, top-p and min-p on temperature-scaled logits, vectorized over rows."""
    top_k = [s.params.top_k if s.params.top_k > 0 else 0 for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    min_p = [s.params.min_p for s in seqs]
    dev = scaled.device
    if any(min_p):
        probs = scaled.softmax(-1)
        floor = torch.tensor(min_p, device=dev)[:, None] * probs.max(-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return scaled
    sorted_logits, order = scaled.sort(-1, descending=True)
    V = scaled.shape[-1]
    ranks = torch.arange(V, device=dev)[None, :]
    k = torch.tensor([k if k else V for k in top_k], device=dev)[:, None]
    drop = ranks >= k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
    before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= before >= torch.tensor(top_p, device=dev)[:, None]
    drop[:, 0] = False
    return scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int],
           tokenizer=None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [N, V] float32, one row per sequence that needs a token (grammar masks already applied)."""
    for i, s in enumerate(seqs):
        p = s.params
        if p.logit_bias or p.needs_penalties or (p.min_tokens and s.num_output_tokens < p.min_tokens):
            stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids))
            _apply_history(logits[i], s, stop_ids)

    greedy = [s.params.greedy for s in seqs]
    tokens = logits.argmax(-1)
    if not all(greedy):
        temps = torch.tensor([s.params.temperature if not g else 1.0 for s, g in zip(seqs, greedy)],
                             device=logits.device)
        probs = _filter(logits / temps[:, None], seqs).softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and lets each seeded row
        # draw its noise from its own generator, so its output does not depend on the batch.
        noise = torch.empty_like(probs).exponential_()
        for i, s in enumerate(seqs):
            if s.generator is not None and not greedy[i]:
                noise[i].exponential_(generator=s.generator)
        drawn = (probs / noise).argmax(-1)
        tokens = torch.where(torch.tensor(greedy, device=logits.device), tokens, drawn)
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, seqs, token_list, tokenizer)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int], tokenizer) -> list[TokenLogprobs | None]:
    """The sampled token's log-prob and rank, plus the top-k, for every row that asks: computed for
    all those rows at once and read back in one transfer (RL rollouts ask for logprobs=0 on every
    token; a few syncs per row cost milliseconds a step at batch 256)."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(seqs)
    if not want:
        return result
    # Extreme penalties make ±inf logits and NaN log-probs, which JSON cannot carry: report them as
    # vLLM does, -9999.0 for anything not finite (and for -inf, the log-prob of a masked token).
    rows = logits if len(want) == len(seqs) else logits[want]
    rows = rows.log_softmax(-1)
    rows = torch.nan_to_num(rows, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0).clamp_(min=LOGPROB_FLOOR)
    chosen_ids = [tokens[i] for i in want]
    chosen = rows.gather(1, torch.tensor(chosen_ids, device=rows.device)[:, None])
    parts = [chosen, ((rows > chosen).sum(-1, keepdim=True) + 1).to(torch.float64)]
    k = max(seqs[i].params.logprobs or 0 for i in want)
    if k:
        top_v, top_i = rows.topk(k, dim=-1)
        parts += [top_v, top_i]
    # One device-to-host transfer for everything (float64 holds every id and rank exactly).
    table = torch.cat([p.to(torch.float64) for p in parts], dim=1).tolist()
    for j, i in enumerate(want):
        row = table[j]
        tok = chosen_ids[j]
        entry: TokenLogprobs = {}
        for r in range(seqs[i].params.logprobs or 0):
            t = int(row[2 + k + r])
            entry[t] = Logprob(row[2 + r], r + 1, _piece(tokenizer, t))
        entry[tok] = Logprob(row[0], int(row[1]), _piece(tokenizer, tok))
        result[i] = entry
    return result


PROMPT_ROWS_PER_PASS = 256  # logits of at most this many prompt rows at once ([rows, vocab] float32)


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: list[int], ks: list[int], tokenizer) -> list[TokenLogprobs]:
    """One entry per row of `hidden` (final hidden states): the log-prob of its target token (the next
    prompt token) with its rank, plus the row's top ks[i]. Raw model log-probs, as vLLM's default."""
    out: list[TokenLogprobs] = []
    for lo in range(0, hidden.shape[0], PROMPT_ROWS_PER_PASS):
        hi = min(lo + PROMPT_ROWS_PER_PASS, hidden.shape[0])
        lps = compute_logits(hidden[lo:hi]).log_softmax(-1)
        tgt = torch.tensor(targets[lo:hi], device=lps.device)
        chosen = lps.gather(1, tgt[:, None])
        ranks = ((lps > chosen).sum(-1) + 1).tolist()
        k = max(ks[lo:hi])
        top_v, top_i = lps.topk(k, dim=-1) if k else (None, None)
        top_v = top_v.tolist() if k else None
        top_i = top_i.tolist() if k else None
        for j, (t, lp, rank) in enumerate(zip(targets[lo:hi], chosen[:, 0].tolist(), ranks)):
            entry: TokenLogprobs = {}
            for r in range(ks[lo + j]):
                entry[top_i[j][r]] = Logprob(top_v[j][r], r + 1, _piece(tokenizer, top_i[j][r]))  # type: ignore[index]
            entry[t] = Logprob(lp, rank, _piece(tokenizer, t))
            out.append(entry)
    return out


def _piece(tokenizer, token_id: int) -> str | None:
    return None if tokenizer is None else _decoded_piece(tokenizer, token_id)


@functools.lru_cache(maxsize=1 << 18)
def _decoded_piece(tokenizer, token_id: int) -> str:
    # A token's text never changes: decode each once (tokenizer.decode costs ~5 us a call).
    return tokenizer.decode([token_id])
