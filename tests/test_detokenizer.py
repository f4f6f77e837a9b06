"""Incremental detokenization never splits a multi-byte character and matches a one-shot decode."""
from __future__ import annotations

import pytest

from server.engine.detokenizer import IncrementalDetokenizer, find_stop


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


@pytest.mark.parametrize("text", [
    "Plain ASCII text, with punctuation!",
    "Émojis 🙂🚀 and CJK 漢字かな, mixed with accents: naïve café.",
    "  leading spaces and\nnew lines\n\n",
])
def test_incremental_equals_one_shot(tokenizer, text):
    prompt = tokenizer("Context:").input_ids
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_find_stop_only_looks_at_new_text():
    assert find_stop("abc STOP def", ["STOP"], new_chars=8) == (4, "STOP")
    assert find_stop("STOP then more", ["STOP"], new_chars=4) is None
    assert find_stop("xx ab", ["b", "ab"], new_chars=2) == (3, "ab")
