"""The batch-invariant mode's CPU building blocks (server/model/batch_invariant.py), bit for bit: a row's GEMM
result in any position of any number of rows, a token's attention as a decode or inside prefill spans among
others, the per-row norm / SiLU / log-softmax at sizes where torch splits work across threads, and the
tensor-parallel sum in rank order over gloo."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from server.model.attention import AttentionContext, PrefillSpan
from server.model.batch_invariant import BatchInvariantTorchOps, fixed_rows_mm, silu
from server.model.ops import TorchOps
from tests.interpreter import ROOT


def test_a_gemm_row_depends_on_its_own_values_only():
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(384, 576, generator=g), torch.randn(384, generator=g)
    x = torch.randn(576, generator=g)
    alone = fixed_rows_mm(x[None], w, bias)[0]
    for rows in (2, 3, 5, 16, 17, 40, 130):
        for at in sorted({0, 1, rows // 2, rows - 1}):
            batch = torch.randn(rows, 576, generator=g)
            batch[at] = x
            assert torch.equal(fixed_rows_mm(batch, w, bias)[at], alone), (rows, at)


def test_the_plain_gemm_is_not_invariant_which_is_why_blocks_exist():
    """MKL computes one row and four rows with different kernels: the test above is not vacuous."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(1536, 576, generator=g), torch.randn(1, 576, generator=g)
    four = torch.cat([x, torch.randn(3, 576, generator=g)])
    assert not torch.equal(torch.mm(x, w.t())[0], torch.mm(four, w.t())[0])


def _cache(blocks: int, bs: int, kv_heads: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, bs, kv_heads, d, generator=g), torch.randn(blocks, bs, kv_heads, d, generator=g)


def test_a_tokens_attention_is_the_same_as_a_decode_and_in_any_prefill_span():
    """Token at position 150 of a sequence (its K/V in the cache): decoded alone, decoded among others,
    the last token of its prompt's last chunk beside other spans and decodes: the same bits."""
    bs, H, KVH, D = 16, 9, 3, 64
    k_cache, v_cache = _cache(96, bs, KVH, D, 0)
    g = torch.Generator().manual_seed(2)
    table = torch.randperm(95, generator=g)[:12].int() + 1
    q_tok = torch.randn(H, D, generator=g)
    ctx_len = 151
    ops = BatchInvariantTorchOps

    def decode(others: int) -> torch.Tensor:
        q = torch.randn(others + 1, H, D, generator=g)
        q[others // 2] = q_tok
        tables = torch.randint(1, 96, (others + 1, 14), generator=g).int()
        tables[others // 2, :12] = table
        lens = torch.randint(1, 200, (others + 1,), generator=g).int()
        lens[others // 2] = ctx_len
        ctx = AttentionContext(torch.zeros(others + 1, dtype=torch.long), others + 1, tables, lens, int(lens.max()))
        return ops.attend(q, None, None, k_cache, v_cache, ctx, 0.125)[others // 2]

    def in_span(chunk: int, decodes: int) -> torch.Tensor:
        other = PrefillSpan(decodes, 30, 70, torch.randint(1, 96, (5,), generator=g).int())
        mine = PrefillSpan(decodes + 30, chunk, ctx_len, table)
        T = decodes + 30 + chunk
        q = torch.randn(T, H, D, generator=g)
        q[T - 1] = q_tok
        tables = torch.randint(1, 96, (decodes, 3), generator=g).int()
        lens = torch.randint(1, 48, (decodes,), generator=g).int()
        ctx = AttentionContext(torch.zeros(T, dtype=torch.long), decodes, tables, lens, 48, prefills=[other, mine])
        return ops.attend(q, None, None, k_cache, v_cache, ctx, 0.125)[T - 1]

    alone = decode(0)
    for result in (decode(1), decode(7), decode(40), in_span(1, 0), in_span(51, 3), in_span(151, 12)):
        assert torch.equal(result, alone)
    # and it is attention: softmax(q k^T) v over the token's 151 keys
    k = k_cache[table.long()].flatten(0, 1)[:ctx_len].repeat_interleave(H // KVH, dim=1)
    v = v_cache[table.long()].flatten(0, 1)[:ctx_len].repeat_interleave(H // KVH, dim=1)
    want = torch.einsum("hk,khd->hd", torch.einsum("hd,khd->hk", q_tok, k).mul(0.125).softmax(-1), v)
    torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_per_row_norm_silu_and_log_softmax(rows):
    """Large enough (300 x 1536 elements) for torch to split elementwise loops across threads, where a loop's
    remainder runs scalar code: the mode's SiLU rounds the same there (torch's fused silu does not)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(576, generator=g), torch.randn(576, generator=g)
    a, logits = torch.randn(1536, generator=g) * 4, torch.randn(49152, generator=g)
    at = rows // 2

    def put(row: torch.Tensor, width: int) -> torch.Tensor:
        batch = torch.randn(rows, width, generator=g) * 4
        batch[at] = row
        return batch

    alone_norm = TorchOps.add_rmsnorm(x[None], None, w, 1e-5)[0][0]
    assert torch.equal(TorchOps.add_rmsnorm(put(x, 576), None, w, 1e-5)[0][at], alone_norm)
    # offset by one element, so the row falls across a vector body / remainder boundary elsewhere
    flat = torch.randn(rows * 1536 + 1, generator=g)
    flat[1 + at * 1536:1 + (at + 1) * 1536] = a
    assert torch.equal(silu(flat)[1 + at * 1536:1 + (at + 1) * 1536], silu(a[None])[0])
    assert torch.equal(put(logits, 49152).log_softmax(-1)[at], logits[None].log_softmax(-1)[0])


RANKS = r"""
import os, socket, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from server.engine.parallel.comm import GlooComm
from server.model.batch_invariant import ordered_all_reduce


def rank(r, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world)
    comm = GlooComm()
    g = torch.Generator().manual_seed(10 + r)
    row = torch.randn(1, 4096, generator=g) * 10 ** r  # magnitudes that make the order matter
    sums = {}
    for rows in (1, 64):  # one row's message and 64 rows' (a ring splits them in other chunks)
        x = torch.cat([row, torch.randn(rows - 1, 4096, generator=g)])
        sums[rows] = ordered_all_reduce(comm, x)[0].clone()
    out[r] = (row[0], sums)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        # fork, from this fresh process (no OpenMP thread started yet: libgomp does not survive a fork
        # after it ran); a spawn would import torch again in each rank
        mp.start_processes(rank, args=(3, port, out), nprocs=3, start_method="fork")
        got = dict(out)
    want = got[0][0] + got[1][0] + got[2][0]
    bad = [(r, n) for r in range(3) for n, v in got[r][1].items() if not torch.equal(v, want)]
    print("ok" if not bad else f"differ: {bad}")
"""


def test_tensor_parallel_sum_in_rank_order_over_gloo(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    res = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok"), res.stdout
