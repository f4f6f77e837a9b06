"""Grammar masks on CUDA: pinned buffers, the transfer and the byte-wise unpacking expression give
exactly llguidance's masks (the CPU tests check the same walk with numpy's unpacking)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from server.engine.grammar_masks import apply_token_bitmask, bit_values_on

pytestmark = pytest.mark.gpu


def test_masks_equal_llguidance_on_cuda():
    from transformers import AutoTokenizer

    from server.engine.structured import GrammarCompiler
    from testkit.models import tokenizer_folder
    from tests.engine.test_grammar_masks import walk

    tok = AutoTokenizer.from_pretrained(tokenizer_folder())
    device = torch.device("cuda")
    walk(GrammarCompiler(tok, len(tok) + 13), device, bit_values_on(device))


def test_cuda_unpacking_equals_cpu():
    rng = np.random.default_rng(2)
    vocab = 128256 + 7  # a model's padded vocabulary, not a multiple of 32
    packed = torch.from_numpy(rng.integers(-2**31, 2**31, size=(33, (vocab + 31) // 32)).astype(np.int32))
    logits = torch.randn(33, vocab)
    on_gpu = logits.cuda()
    apply_token_bitmask(logits, packed)
    apply_token_bitmask(on_gpu, packed.pin_memory(), bit_values_on(on_gpu.device))
    assert torch.equal(on_gpu.cpu(), logits)
