"""Incremental detokenization never splits a multi-byte character and matches a one-shot decode."""
from __future__ import annotations

import pytest

from server.wire.detokenizer import IncrementalDetokenizer, find_stop


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


def test_a_step_of_many_sequences_detokenizes_as_one_at_a_time(tokenizer):
    """core.postprocess decodes a step's windows in one call; each sequence's text must be what its
    own incremental decode gives, special tokens skipped or not."""
    from server.wire.detokenizer import decode_many, detokenize_step

    texts = ["Émojis 🙂🚀 and CJK 漢字かな", "def f(x):\n    return x", "naïve café, 1 2 3"]
    streams = [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts]
    prompt = tokenizer("Context:").input_ids
    for skip in (True, False):
        alone = [IncrementalDetokenizer(tokenizer, prompt, skip) for _ in streams]
        together = [IncrementalDetokenizer(tokenizer, prompt, skip) for _ in streams]
        got: list[list[str]] = [[] for _ in streams]
        want: list[list[str]] = [[] for _ in streams]
        for step in range(max(map(len, streams))):
            live = [i for i, s in enumerate(streams) if step < len(s)]
            for i, text in zip(live, detokenize_step([(together[i], streams[i][step]) for i in live])):
                got[i].append(text)
            for i in live:
                want[i].append(alone[i].add(streams[i][step]))
        assert got == want
        assert "".join(got[1]).startswith("def f(x):")
    windows = [s[:k] for s in streams for k in (1, 3, len(s))]
    for skip in (True, False):
        assert decode_many(tokenizer, windows, skip) == [tokenizer.decode(w, skip_special_tokens=skip) for w in windows]


def test_text_decoded_at_the_end_equals_incremental(tokenizer):
    """A FINAL_ONLY sequence without stop strings is detokenized once, at its end (detokenize_many): it must
    be the text the incremental decode builds token by token, on any tokens. Random ids make broken UTF-8
    (byte tokens that start or continue a character without ending it) and special tokens."""
    import random

    from server.wire.detokenizer import detokenize_many, prefix_stable

    assert prefix_stable(tokenizer)
    rng = random.Random(0)
    vocab = len(tokenizer)
    byte_tokens = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])][:200]
    specials = list(tokenizer.all_special_ids)
    for case in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        pool = byte_tokens if case % 3 == 0 else specials + byte_tokens if case % 3 == 1 else None
        out = [rng.choice(pool) if pool and rng.random() < 0.5 else rng.randrange(vocab)
               for _ in range(rng.randrange(1, 150))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tokenizer, prompt, skip)
            incremental = "".join(detok.add(t) for t in out) + detok.flush()
            assert detokenize_many(tokenizer, [(prompt, out)], skip) == [incremental], (case, skip)


def test_sequences_that_end_in_one_step_decode_their_texts_in_one_call(llm, monkeypatch):
    """FINAL_ONLY sequences (no stop strings) owe their text until they end; those that end in the same step
    (here the 4 samples of one request, forced to one length) are decoded in one detokenize_many call, and
    their texts are the ones a streamed request builds token by token."""
    from server import SamplingParams
    from server.engine import sequence
    from server.wire.params import RequestOutputKind

    calls: list[int] = []
    many = sequence.detokenize_many

    def counted(tokenizer, jobs, skip):
        calls.append(len(jobs))
        return many(tokenizer, jobs, skip)
    monkeypatch.setattr(sequence, "detokenize_many", counted)
    params = dict(n=4, temperature=1.0, seed=11, max_tokens=9, ignore_eos=True)
    lazy, = llm.generate("Once upon a time", SamplingParams(**params))
    assert calls == [4]
    streamed, = llm.generate("Once upon a time", SamplingParams(**params, output_kind=RequestOutputKind.CUMULATIVE))
    assert [o.text for o in lazy.outputs] == [o.text for o in streamed.outputs]
    assert all(o.text for o in lazy.outputs)


def test_a_steps_windows_decode_as_the_tokenizer_decodes_them(tokenizer):
    """decode_many joins the cached texts of tokens that decode to whole characters (a byte-level decoder)
    and asks the tokenizer for the rest: on random windows (broken UTF-8, special tokens, long and short)
    every text must be the tokenizer's own decode, special tokens skipped or not."""
    import random

    from server.wire.detokenizer import _whole_pieces, decode_many

    assert _whole_pieces(tokenizer) is not None  # the embedded model's decoder is byte-level
    rng = random.Random(1)
    vocab = len(tokenizer)
    added = list(tokenizer.backend_tokenizer.get_added_tokens_decoder())  # special or not (<jupyter_script>)
    odd = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])][:200] + added
    windows = [[rng.choice(odd) if rng.random() < 0.2 else rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
               for _ in range(400)]
    for skip in (True, False):
        assert decode_many(tokenizer, windows, skip) == [tokenizer.decode(w, skip_special_tokens=skip)
                                                         for w in windows]


def test_the_steps_fast_path_gives_what_the_tokenizer_gives(tokenizer):
    """detokenize_step hands a whole token's cached text out directly while its detokenizer's window is whole
    tokens with nothing pending, and decodes the others: on random ids (broken UTF-8 that a later byte
    completes or never does, special tokens in the prompt and the output, ids past the tokenizer's vocabulary,
    which a model with a larger one samples and decode drops) each sequence's texts must be what add() (the
    tokenizer's decode of both windows, every time) gives, special tokens skipped or not."""
    import random

    from server.wire.detokenizer import decode_many, detokenize_step

    rng = random.Random(2)
    vocab = len(tokenizer)
    odd = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])][:200] + list(tokenizer.all_special_ids)
    odd += [vocab + k for k in range(0, 5000, 97)]  # unknown ids
    emoji = tokenizer("🙂🚀漢字", add_special_tokens=False).input_ids
    for skip in (True, False):
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))] + ([rng.choice(odd)] if k % 4 == 0 else [])
                   for k in range(24)]
        streams = [[rng.choice(odd) if rng.random() < 0.1 else rng.choice(emoji) if rng.random() < 0.1
                    else rng.randrange(vocab) for _ in range(rng.randrange(20, 120))] for _ in prompts]
        together = [IncrementalDetokenizer(tokenizer, p, skip) for p in prompts]
        alone = [IncrementalDetokenizer(tokenizer, p, skip) for p in prompts]
        fast = 0
        for step in range(max(map(len, streams))):
            live = [i for i, s in enumerate(streams) if step < len(s)]
            fast += sum(together[i].clean for i in live)
            got = detokenize_step([(together[i], streams[i][step]) for i in live])
            assert got == [alone[i].add(streams[i][step]) for i in live], (skip, step)
        assert [d.flush() for d in together] == [d.flush() for d in alone]
        assert fast > 0  # the fast path ran
    windows = [[rng.choice(odd) if rng.random() < 0.3 else rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
               for _ in range(200)]
    for skip in (True, False):
        assert decode_many(tokenizer, windows, skip) == [tokenizer.decode(w, skip_special_tokens=skip) for w in windows]
