"""Token texts for log-probs, decoded for the whole vocabulary at start-up (sampler.warm_pieces): each must be
what tokenizer.decode([id]) gives, ids past the tokenizer's vocabulary included (a model may have more rows)."""
from __future__ import annotations

import random

from server.engine.sampler import _cached_pieces, _PieceCache, warm_pieces
from server.model.tokenizer import load_tokenizer
from testkit.models import model_folder


def test_filled_pieces_are_the_tokenizer_decode(tmp_path):
    tok = load_tokenizer(model_folder("llama-tiny", tmp_path))
    cache = _PieceCache(tok)
    size = len(tok) + 100
    cache.fill(size)
    assert len(cache) == size
    for i in random.Random(0).sample(range(size), 2000) + [0, len(tok) - 1, len(tok), size - 1]:
        assert cache[i] == tok.decode([i]), i


def test_warm_pieces_fills_the_cache_the_sampler_reads(tmp_path):
    tok = load_tokenizer(model_folder("llama-tiny", tmp_path))
    warm_pieces(tok, 300)
    assert all(i in _cached_pieces(tok) for i in range(300))
