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

from server.wire.detokenizer import decode_many, decodes_in_one_call
from server.wire.outputs import LOGPROB_FLOOR, Logprob, TokenLogprobs
from server.engine.sequence import Sequence

# Plain sampling (no log-probs) of at least this many rows goes through the fused kernels on CUDA
# (bench/sampler.py on the H200: 64 rows 0.17 / 0.16 ms torch / fused, 256 rows 0.45 / 0.16).
FUSED_MIN_ROWS = 128


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


def _on(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, without waiting for the device: on CUDA through pinned
    memory, non-blocking (a blocking copy waits for every queued kernel: with async scheduling, for the
    step in flight)."""
    t = torch.tensor(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _summary(p) -> tuple:
    """What SamplingMeta reads of one SamplingParams, in its column order: history (logits edited from the
    sequence's tokens), blocks async following, grammar, greedy, temperature (1.0 for greedy rows), top_k
    (0: off), top_p, min_p, logprobs."""
    greedy = p.greedy
    return (bool(p.logit_bias or p.needs_penalties or p.min_tokens),
            bool(p.needs_penalties or p.min_tokens or p.grammar is not None), p.grammar is not None, greedy,
            1.0 if greedy else float(p.temperature), p.top_k if p.top_k > 0 else 0, p.top_p, p.min_p, p.logprobs)


class SamplingMeta:
    """What a batch's rows ask for, as lists and device tensors, built once per batch composition: the
    decode steps of a steady batch (the same sequences in the same order) reuse it, so a step does no
    per-row Python and no host-to-device copy for its parameters (ModelRunner keeps the last one)."""

    def __init__(self, seqs: list[Sequence], device: torch.device, batch_invariant: bool = False):
        self.seqs = list(seqs)
        # One summary per distinct params object (a request's n sequences share one; a batch of requests
        # holds a few dozen), then each field's column in C: a new batch composition (a sequence ending,
        # one admitted: most steps of a rollout's tail) costs a dict lookup per row.
        summaries: dict[int, tuple] = {}
        rows = []
        for seq in seqs:
            row = summaries.get(id(seq.params))  # the params outlive this call: their ids are theirs
            if row is None:
                row = summaries[id(seq.params)] = _summary(seq.params)
            rows.append(row)
        history, blocks_follow, grammar, greedy, temps, top_k, top_p, min_p, logprobs = (
            zip(*rows) if rows else ((),) * 9)
        # Rows whose logits depend on their history (penalties, a bias, min_tokens): edited one by one.
        self.history = [i for i, h in enumerate(history) if h]
        # Whether the next step may be sampled before this one's tokens reach the host (async scheduling):
        # not when a row's logits depend on its tokens (penalties, min_tokens) or its grammar's state.
        self.can_follow = not any(blocks_follow)
        self.grammar = any(grammar)  # rows with a grammar mask (runner.launch)
        self.all_greedy = all(greedy)
        self.temps = self.greedy_rows = self.top_k = self.top_p = self.min_p = None
        # Every sampled row at temperature 1 (RL rollouts): logits / 1 is the logits, so that pass over
        # [rows, vocab] is skipped (the same values, bit for bit). Greedy rows count as 1.
        self.unit_temperature = all(t == 1.0 for t in temps)
        self.seeded = [i for i, s in enumerate(seqs) if s.generator is not None and not greedy[i]]
        if not self.all_greedy:
            if not self.unit_temperature:
                self.temps = _on(list(temps), device)[:, None]
            self.greedy_rows = _on(list(greedy), device) if any(greedy) else None
            if any(min_p):
                self.min_p = _on([float(m) for m in min_p], device)[:, None]
            if any(top_k) or not all(p >= 1.0 for p in top_p):
                self.top_k = _on([k if k else -1 for k in top_k], device)[:, None]
                self.top_p = _on([float(p) for p in top_p], device)[:, None]
        # Log-probs: the rows that ask, and the largest top-k among them.
        self.want = [i for i, lp in enumerate(logprobs) if lp is not None]
        self.want_k = [logprobs[i] or 0 for i in self.want]
        self.k = max(self.want_k, default=0)
        self.want_rows = None
        if self.want and len(self.want) < len(seqs):
            self.want_rows = _on(self.want, device)
        # What RL rollouts ask (plain temperature or greedy, the sampled token's log-prob) is drawn on CUDA
        # in one pass over each row (fused_sample.py): each row's temperature, 0 for a greedy one. Greedy
        # rows with no log-probs keep the argmax, already one pass; plain sampling of fewer rows than
        # FUSED_MIN_ROWS keeps the torch path, which launches faster (H200: 0.08 against 0.17 ms at 1 row).
        # Not in the batch-invariant mode: whether a row went through it would follow the batch (its size,
        # its other rows' params), and prompt log-probs are scored by the torch path's log-softmax.
        self.fused_temps = None
        if (device.type == "cuda" and not batch_invariant and self.top_k is None and self.min_p is None
                and not self.seeded
                and self.k == 0 and (self.want or (not self.all_greedy and len(seqs) >= FUSED_MIN_ROWS))):
            self.fused_temps = _on([0.0 if g else float(t) for g, t in zip(greedy, temps)], device)

    def matches(self, seqs: list[Sequence]) -> bool:
        return seqs == self.seqs  # identity first, element by element, in C


def _filter(scaled: torch.Tensor, meta: SamplingMeta) -> torch.Tensor:
    """top-k, top-p and min-p on temperature-scaled logits, vectorized over rows."""
    if meta.min_p is not None:
        probs = scaled.softmax(-1)
        floor = meta.min_p * probs.max(-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if meta.top_k is None:
        return scaled
    sorted_logits, order = scaled.sort(-1, descending=True)
    V = scaled.shape[-1]
    ranks = torch.arange(V, device=scaled.device)[None, :]
    k = torch.where(meta.top_k > 0, meta.top_k, V)
    drop = ranks >= k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
    before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= before >= meta.top_p
    drop[:, 0] = False
    return scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


class DeviceSample:
    """A batch's sampled tokens (and log-prob table) on the device, on their way to the host: the copies
    are queued behind the sampling (into pinned memory on CUDA) with an event, so the host can do other
    work (async scheduling: launch the next step) before read() waits for them."""

    def __init__(self, tokens: torch.Tensor, table: torch.Tensor | None, tokens_in_table: bool = False):
        self.tokens = tokens  # [N] int64 on the device: the next step's input ids come from here
        # Only what the host needs crosses: the table alone when its first column holds every token.
        sources = [t for t in (None if tokens_in_table else tokens, table) if t is not None]
        self._event = None
        if tokens.device.type == "cuda":
            # non_blocking device-to-host copies land in pinned memory, queued on the current stream.
            self._host = [t.to("cpu", non_blocking=True) for t in sources]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = sources
        self._has_tokens = not tokens_in_table
        self._has_table = table is not None

    def read(self) -> tuple[list[int] | None, torch.Tensor | None]:
        """(the tokens as a list, or None when the table's first column holds them; the table or None)."""
        if self._event is not None:
            self._event.synchronize()
        host = list(self._host)
        tokens = host.pop(0).tolist() if self._has_tokens else None
        return tokens, (host[0] if self._has_table else None)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int], tokenizer=None,
           meta: SamplingMeta | None = None) -> tuple[list[int], list]:
    """logits [N, V] float32 or the model's dtype, one row per sequence that needs a token (grammar masks
    already applied). The tokens (and the log-prob table) reach the host in one transfer. Log-probs are
    WireLogprobs tuples (logprob_list.py), None for a row that did not ask."""
    if meta is None or not meta.matches(seqs):
        meta = SamplingMeta(seqs, logits.device)
    return read_sample(sample_on_device(logits, seqs, eos_ids, meta), seqs, meta, tokenizer)


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int],
                     meta: SamplingMeta) -> DeviceSample:
    """The device half of sample(): everything up to the tokens and log-prob table, queued, with their
    copies to the host; no synchronization (except rows that edit their logits from their history).
    logits: float32, or the model's dtype from a CUDA graph, converted here unless the fused sampler reads them."""
    if meta.history:
        logits = logits.float()
    for i in meta.history:
        s = seqs[i]
        p = s.params
        if p.logit_bias or p.needs_penalties or (p.min_tokens and s.num_output_tokens < p.min_tokens):
            stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids))
            _apply_history(logits[i], s, stop_ids)

    if meta.fused_temps is not None:
        from server.engine.fused_sample import fused_sample  # Triton: imported where CUDA samples

        tokens, table = fused_sample(logits, meta.fused_temps, bool(meta.want))
        if table is not None and meta.want_rows is not None:
            table = table[meta.want_rows]
        return DeviceSample(tokens, table, tokens_in_table=table is not None and meta.want_rows is None)
    if meta.all_greedy and not meta.want:
        # In the logits' own dtype: widening bf16 to float32 is exact, so the argmax (the first of ties
        # alike) is the same, without a pass that writes the float32 copy (256 rows x 128k: 134 MB).
        return DeviceSample(logits.argmax(-1), None)
    logits = logits.float()
    # Each pass over [rows, vocab] costs device time at large batches (256 x 128k floats is 131 MB): only
    # the passes whose results are used run (no argmax of the logits when no row is greedy, no division
    # by temperatures that are all 1, the noise divided in place).
    if meta.all_greedy:
        tokens = logits.argmax(-1)
    else:
        probs = _filter(logits if meta.unit_temperature else logits / meta.temps, meta).softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and lets each seeded row
        # draw its noise from its own generator, so its output does not depend on the batch.
        noise = torch.empty_like(probs).exponential_()
        for i in meta.seeded:
            noise[i].exponential_(generator=seqs[i].generator)
        drawn = probs.div_(noise).argmax(-1)
        tokens = drawn if meta.greedy_rows is None else torch.where(meta.greedy_rows, logits.argmax(-1), drawn)
    if not meta.want:
        return DeviceSample(tokens, None)
    return DeviceSample(tokens, _logprob_table(logits, tokens, meta), tokens_in_table=meta.want_rows is None)


def read_sample(ds: DeviceSample, seqs: list[Sequence], meta: SamplingMeta, tokenizer) -> tuple[list[int], list]:
    """The host half of sample(): waits for the copies, returns (tokens, log-probs per row)."""
    tokens, table = ds.read()
    if table is None:
        return tokens, [None] * len(seqs)  # type: ignore[return-value]
    return _logprobs(table, tokens, seqs, meta, tokenizer)


def _logprob_table(logits: torch.Tensor, tokens: torch.Tensor, meta: SamplingMeta) -> torch.Tensor:
    """For every row that asks, the sampled token's log-prob and rank plus the top-k, computed for all
    those rows at once and read back with the tokens in one transfer (RL rollouts ask for logprobs=0 on
    every token; a few syncs per row cost milliseconds a step at batch 256). Columns: token id, log-prob,
    rank, then k top log-probs and k top ids (float64 holds every id and rank exactly)."""
    # Extreme penalties make ±inf logits and NaN log-probs, which JSON cannot carry: report them as
    # vLLM does, -9999.0 for anything not finite (and for -inf, the log-prob of a masked token).
    rows = logits if meta.want_rows is None else logits[meta.want_rows]
    rows = rows.log_softmax(-1)
    rows = torch.nan_to_num(rows, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0).clamp_(min=LOGPROB_FLOOR)
    chosen_ids = (tokens if meta.want_rows is None else tokens[meta.want_rows])[:, None]
    chosen = rows.gather(1, chosen_ids)
    parts = [chosen_ids, chosen, (rows > chosen).sum(-1, keepdim=True) + 1]
    if meta.k:
        top_v, top_i = rows.topk(meta.k, dim=-1)
        parts += [top_v, top_i]
    return torch.cat([p.to(torch.float64) for p in parts], dim=1)


def _logprobs(table: torch.Tensor, tokens: list[int] | None, seqs: list[Sequence], meta: SamplingMeta,
              tokenizer) -> tuple[list[int], list]:
    """The tokens and each asking row's WireLogprobs tuple, from the table _logprob_table made (on the host)."""
    want = meta.want
    k = meta.k
    result: list = [None] * len(seqs)
    chosen_tokens = table[:, 0].long().tolist()
    token_list = chosen_tokens if tokens is None else tokens
    chosen_lps = table[:, 1].tolist()
    ranks = table[:, 2].long().tolist()
    pieces = _pieces(tokenizer)
    if k == 0:  # RL rollouts (logprobs=0): (token, logprob, rank, text) per row, zipped in C
        entries = zip(chosen_tokens, chosen_lps, ranks, map(getattr(pieces, "__getitem__", pieces), chosen_tokens))
        if len(want) == len(seqs):
            return token_list, list(entries)
        for i, entry in zip(want, entries):
            result[i] = entry
        return token_list, result
    # (token, logprob, rank, text) of the sampled token, then of each of the row's top-k
    top_vs = table[:, 3:3 + k].tolist()
    top_is = table[:, 3 + k:].long().tolist()
    for j, (i, tok, lp, rank) in enumerate(zip(want, chosen_tokens, chosen_lps, ranks)):
        entry: tuple = (tok, lp, rank, pieces(tok))
        for r in range(meta.want_k[j]):
            t = top_is[j][r]
            entry += (t, top_vs[j][r], r + 1, pieces(t))
        result[i] = entry
    return token_list, result


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
    return None if tokenizer is None else _pieces(tokenizer)(token_id)


class _PieceCache(dict):
    """A tokenizer's token texts: a token's text never changes, so each is decoded once (tokenizer.decode
    costs ~5 us a call); a lookup is a dict's."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def fill(self, vocab_size: int) -> None:
        """Decode every id below vocab_size now, in one call where the tokenizer allows it (decode_many's
        fast path: 49k ids in 78 ms on the CI host): a rollout with log-probs meets tens of thousands of
        distinct tokens, and on the H200 each first meeting cost ~10-19 us of the engine thread."""
        if not decodes_in_one_call(self.tokenizer):
            return  # decode_many would decode one id per call: no faster than meeting them one by one
        ids = [i for i in range(vocab_size) if i not in self]
        self.update(zip(ids, decode_many(self.tokenizer, [[i] for i in ids], skip_special_tokens=False)))

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id])
        return text

    def __call__(self, token_id: int) -> str:
        return self[token_id]


def _no_piece(token_id: int) -> None:
    return None


@functools.lru_cache(maxsize=8)
def _cached_pieces(tokenizer) -> _PieceCache:
    return _PieceCache(tokenizer)


def _pieces(tokenizer) -> Callable[[int], str | None]:
    return _no_piece if tokenizer is None else _cached_pieces(tokenizer)


def warm_pieces(tokenizer, vocab_size: int) -> None:
    """At start-up: every token's text for log-probs, decoded before the first request needs them."""
    if tokenizer is not None:
        _cached_pieces(tokenizer).fill(vocab_size)
