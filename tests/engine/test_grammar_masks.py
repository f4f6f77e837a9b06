"""GrammarMasks against llguidance itself: the masks it applies (batches in any order, new sequences
joining, all-allowed for rows without a grammar) are exactly the masks a fresh copy of each grammar,
advanced token by token, computes; and both unpacking paths (the CPU one and the expression CUDA runs)
agree."""
from __future__ import annotations

import random
from dataclasses import dataclass

import llguidance.torch as llt
import numpy as np
import pytest
import torch
from testkit.models import tokenizer_folder

from server.engine.grammar_masks import GrammarMasks, apply_token_bitmask, forbidden_tokens
from server.wire.params import StructuredOutputs
from server.engine.structured import GrammarCompiler

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "bb"]}}}}


@dataclass
class Seq:
    """What GrammarMasks reads of a Sequence: its id and its matcher (None: no grammar)."""
    seq_id: int
    matcher: object


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder())
    return GrammarCompiler(tok, len(tok) + 13)  # a padded vocabulary, as models have: never allowed


def reference_forbidden(matcher, vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    packed = torch.empty((1, words), dtype=torch.int32)
    llt.fill_next_token_bitmask(matcher, packed)
    bits = np.unpackbits(packed.numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little")
    return torch.from_numpy(bits[0] == 0)


def test_masks_equal_llguidance_through_reorders_and_new_sequences(compiler):
    walk(compiler, torch.device("cpu"), None)


def walk(compiler, device: torch.device, bit_values: torch.Tensor | None) -> None:
    """60 steps of random batches through GrammarMasks on `device`, every masked row checked against
    llguidance (tests/gpu runs it on CUDA)."""
    vocab = compiler.vocab_size
    grammars = [compiler.compile(StructuredOutputs(json=SCHEMA)),
                compiler.compile(StructuredOutputs(regex=r"[0-9]{2,5}x")),
                compiler.compile(StructuredOutputs(choice=["yes", "no"]))]
    masks = GrammarMasks(vocab, device, bit_values)
    rng = random.Random(0)
    live: list[tuple[Seq, object]] = []   # (sequence, its reference matcher: advanced alongside)
    next_id, checked_rows, completed, masked_steps = 0, 0, 0, 0
    batch: list = []
    done: set[int] = set()
    for step in range(60):
        while len(live) < 6:  # new sequences join, some without a grammar
            g = rng.choice(grammars + [None])
            live.append((Seq(next_id, g.matcher() if g else None), g.matcher() if g else None))
            next_id += 1
        # Half the steps sample exactly the constrained sequences the last step left running, in
        # its order (a decode batch's steady state); the others some of the sequences in any order
        # (new ones, preempted ones skip a step).
        steady = [(s, r) for s, r in batch if r is not None and s.seq_id not in done] if step else []
        if not (steady and step % 2):
            batch = rng.sample(live, rng.randint(1, len(live)))
        else:
            batch = steady
        logits = torch.zeros(len(batch), vocab, device=device)
        masked_steps += any(ref is not None for _, ref in batch)
        masks.apply(logits, [s for s, _ in batch])
        logits = logits.cpu()
        tokens = []
        for row, (seq, ref) in enumerate(batch):
            if ref is None:
                assert not torch.isinf(logits[row]).any()
                tokens.append(rng.randrange(vocab))
                continue
            assert torch.equal(torch.isinf(logits[row]), reference_forbidden(ref, vocab)), (step, row)
            checked_rows += 1
            tokens.append(rng.choice(torch.nonzero(~torch.isinf(logits[row])).flatten().tolist()))
        complete = masks.advance([(s, t) for (s, _), t in zip(batch, tokens)])
        for (seq, ref), t in zip(batch, tokens):
            if ref is None:
                continue
            assert ref.consume_token(t)
            assert (seq.seq_id in complete) == (ref.is_stopped() and not ref.is_error())
        done = {s.seq_id for (s, ref), t in zip(batch, tokens) if s.seq_id in complete or
                (ref is None and rng.random() < 0.2)}
        completed += len(complete)
        live = [(s, r) for s, r in live if s.seq_id not in done]
    assert checked_rows > 60 and completed > 3  # the walk did cover masks and finished grammars
    assert masks.times.steps == masked_steps  # the bench's split counts every masked step


def test_cpu_and_device_unpacking_agree():
    rng = np.random.default_rng(1)
    vocab = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    packed = torch.from_numpy(rng.integers(-2**31, 2**31, size=(7, (vocab + 31) // 32)).astype(np.int32))
    logits = torch.randn(7, vocab)
    expected = logits.clone()
    for r in range(7):
        for t in range(vocab):
            if not (int(packed[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply_token_bitmask(logits, packed)
    assert torch.equal(logits, expected)
    assert torch.equal(forbidden_tokens(packed, vocab), torch.isinf(expected))
