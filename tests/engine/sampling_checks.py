"""Checks of fused_sample.fused_sample against torch, shared by the interpreted (CPU) and GPU tests: the same
tokens as argmax for greedy rows, the same log-probs and ranks as log_softmax, and draws that follow
softmax(logits / T) (a chi-square bound; torch.manual_seed makes each run the same draws). Rows span several
chunks (the kernel's programs), with the candidates spread over chunks, tiles and quarters."""
from __future__ import annotations

import torch

from server.engine.fused_sample import CHUNK, fused_sample


def check_greedy_and_table(device: str, rows: int, vocab: int, chunk: int = CHUNK) -> None:
    torch.manual_seed(1)
    logits = (torch.randn(rows, vocab) * 4).to(device)
    logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie across chunks: the first wins
    logits[1, :] = float("-inf")
    logits[1, vocab - 2] = 0.0                                          # one finite logit: log-prob 0, rank 1
    temps = torch.tensor([0.0 if i % 2 == 0 else 1.0 for i in range(rows)], device=device)
    temps[1] = 0.7
    tokens, table = fused_sample(logits, temps, want_table=True, chunk=chunk)
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy]), "greedy rows must take torch's argmax"
    assert tokens[0].item() == vocab // 2 and tokens[1].item() == vocab - 2
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    assert torch.equal(table[:, 0].long(), tokens)
    assert torch.allclose(table[:, 1].float(), chosen.clamp(min=-9999.0), atol=1e-4, rtol=1e-5)
    # The rank counts larger logits: log_softmax's order, without the ties its rounding makes (256 rows of
    # 128k columns had some: two logits 1 ulp apart, one log-prob).
    chosen_logits = logits.gather(1, tokens[:, None])
    assert torch.equal(table[:, 2].long(), (logits > chosen_logits).sum(-1) + 1)
    assert ((table[:, 2].long() - ((lp > chosen[:, None]).sum(-1) + 1)).abs() <= 2).all()
    assert not torch.isinf(logits.gather(1, tokens[:, None])).any(), "a token of logit -inf was drawn"
    tokens2, table2 = fused_sample(logits, temps, want_table=False, chunk=chunk)
    assert table2 is None and torch.equal(tokens2[greedy], tokens[greedy])


def check_distribution(device: str, draws: int, temperature: float, vocab: int, chunk: int = CHUNK) -> None:
    values = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, -3.0, 1.5, 0.2, 2.2])
    columns = [int(i * (vocab - 1) / (len(values) - 1)) for i in range(len(values))]  # first to last column
    row = torch.full((vocab,), float("-inf"))
    row[columns] = values
    expected = (values / temperature).softmax(-1).double()
    torch.manual_seed(2)
    logits = row.to(device).expand(draws, -1).contiguous()
    temps = torch.full((draws,), temperature, device=device)
    tokens, _ = fused_sample(logits, temps, False, chunk=chunk)
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    assert counts.sum() == counts[columns].sum(), "a token of logit -inf was drawn"
    chi2 = (((counts[columns] - expected * draws) ** 2) / (expected * draws)).sum().item()
    # 8 degrees of freedom: P(chi2 > 26.1) = 0.001; a wrong temperature or a biased draw lands far above.
    assert chi2 < 26.1, f"draws do not follow softmax(logits / {temperature}): chi2 {chi2:.1f}, {counts[columns].tolist()}"
    torch.manual_seed(2)
    again, _ = fused_sample(logits, temps, False, chunk=chunk)
    assert torch.equal(again, tokens), "the same torch seed must give the same draws"


def check_draws_cover(device: str, draws: int, vocab: int, chunk: int) -> None:
    """A cheap check for the interpreter (each program runs in Python): two equal logits in the first and the
    last chunk and a smaller one between are all drawn, and nothing else. (The chi-square runs on the GPU.)"""
    row = torch.full((vocab,), float("-inf"))
    row[[5, vocab // 2, vocab - 1]] = torch.tensor([0.0, -1.0, 0.0])  # p = 0.42, 0.16, 0.42
    torch.manual_seed(3)
    tokens, _ = fused_sample(row.to(device).expand(draws, -1).contiguous(), torch.ones(draws, device=device), False,
                             chunk=chunk)
    assert set(tokens.tolist()) == {5, vocab // 2, vocab - 1}, torch.bincount(tokens.cpu()).nonzero().tolist()


def check_model_dtype_reads_as_float32(device: str, rows: int, vocab: int, chunk: int = CHUNK) -> None:
    """bfloat16 logits (a CUDA graph's) give the same tokens, log-probs and ranks as the same values converted
    to float32 first, draw for draw: the kernel converts each value as it loads it."""
    torch.manual_seed(4)
    logits = (torch.randn(rows, vocab) * 4).to(torch.bfloat16).to(device)
    temps = torch.tensor([0.0 if i % 3 == 0 else 1.0 for i in range(rows)], device=device)
    for want_table in (True, False):
        torch.manual_seed(5)
        tokens, table = fused_sample(logits, temps, want_table, chunk=chunk)
        torch.manual_seed(5)
        tokens32, table32 = fused_sample(logits.float(), temps, want_table, chunk=chunk)
        assert torch.equal(tokens, tokens32)
        assert (table is None and table32 is None) or torch.equal(table, table32)
