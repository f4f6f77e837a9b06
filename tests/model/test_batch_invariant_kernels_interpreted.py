"""The batch-invariant mode's CUDA kernels (server/model/batch_invariant_kernels.py) run by Triton's CPU
interpreter on small shapes: a matmul row's bits in any position of any number of rows (tiles of 64 rows:
1 to 130 rows span one to three tiles), and a token's attention the same as a decode alone, among other
decodes, or inside prefill spans."""
from __future__ import annotations

import re

import pytest

from tests.interpreter import run_interpreted, waits_before_memory

pytest.importorskip("triton")

# The interpreter's tl.dot is numpy's matmul, whose OpenBLAS computes a row differently by its place in the
# block (its micro-kernels: rows 6-11 of 64 differ from rows 0-5), which an MMA does not: here it is one 1-row
# product per row, so this test checks the kernel's tiling (no row reads another's, K in one order whatever M,
# padding masked); tests/gpu/test_batch_invariant_gpu.py checks the hardware's.
ROWWISE_DOT = r"""
import numpy as np
_whole_block = np.matmul  # (its own name: BF16_DOT + ROWWISE_DOT composes, each calling the dot before it)
def _rowwise(a, b, *args, **kwargs):
    if a.ndim != 2:
        return _whole_block(a, b, *args, **kwargs)
    return np.concatenate([_whole_block(a[i:i + 1], b, *args, **kwargs) for i in range(a.shape[0])])
np.matmul = _rowwise
"""
MATMUL = ROWWISE_DOT + r"""
import torch
import server.model.batch_invariant_kernels as bik
from server.model.batch_invariant_kernels import fixed_tile_matmul
bik.WORKSPACE_BYTES = 3 * 96 * 4 * 64   # split launches of 64 rows: 130 rows take three
g = torch.Generator().manual_seed(0)
split = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=3)
# (the mode's tile here: no split at 96 x 80 on the interpreter's 4 "multiprocessors"); 2 and 3 K splits of
# 5 BLOCK_K steps (the last split's tail masked: K = 80), through the workspace and serially in one program:
# a row alone through the workspace is the same row among others computed serially, and the reverse.
for tile in (None, dict(split, SPLIT_K=2), dict(split, SPLIT_K=3)):
    dtype, tol = torch.float32, 1e-5  # (fp16 adds a minute of interpreter and no tiling to check)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(80, generator=g).to(dtype)
    alone = fixed_tile_matmul(x[None], w, b, tile=tile)[0]
    torch.testing.assert_close(alone.float(), (x.float() @ w.float().t() + b.float()), rtol=tol, atol=tol)
    for rows in (5, 70, 130):
        for at in sorted({0, rows // 2, rows - 1}):
            batch = torch.randn(rows, 80, generator=g).to(dtype)
            batch[at] = x
            out = torch.empty(rows, 100, dtype=dtype)[:, :96]   # a row stride other than N
            assert torch.equal(fixed_tile_matmul(batch, w, b, out=out, tile=tile)[at], alone), (tile, rows, at)
            if tile is not None:
                serial = fixed_tile_matmul(batch, w, b, tile=dict(tile, SERIAL=True))
                assert torch.equal(serial, out), (tile, rows, "serial")
    if tile is not None:
        assert torch.equal(fixed_tile_matmul(x[None], w, b, tile=dict(tile, SERIAL=True))[0], alone), tile
print("ok")
"""

# The interpreter holds a bf16 tensor as its uint16 bits, and its tl.dot multiplies those bits as integers:
# here a bf16 operand is read as the value it holds (exactly, in fp32), so bf16 inputs give real sums.
BF16_DOT = r"""
import numpy as np
_matmul = np.matmul
def _bf16_as_values(a, b, *args, **kwargs):
    a, b = ((v.astype(np.uint32) << 16).view(np.float32) if v.dtype == np.uint16 else v for v in (a, b))
    return _matmul(a, b, *args, **kwargs)
np.matmul = _bf16_as_values
"""
# SERIAL's sum in one loop over all the splits' K steps (FLAT) against SERIAL's loop a split and against the
# workspace + _sum_splits: the same bits, fp32 and bf16 inputs, 2 to 4 splits, the last one shorter (K = 200:
# 13 steps of 16 in splits of 5 or 4, the tail of one step masked and whole steps past K), M not a multiple of
# BLOCK_M, columns not of BLOCK_N, with and without bias. An fp32 `out` keeps the sums unrounded (bf16 hides an
# order's last bits), where the data tells orders apart: the unsplit sum (what the flat loop computes if its
# reset is lost) and the splits added in reverse order give other bits, the splits added in order these.
FLAT_SERIAL = BF16_DOT + r"""
import torch
import triton
from server.model.batch_invariant_kernels import _fixed_tile_matmul, fixed_tile_matmul
g = torch.Generator().manual_seed(0)
tile = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=3)
for dtype in (torch.float32, torch.bfloat16):
    for M, N, K, splits in ((45, 40, 200, 3), (5, 40, 200, 4), (45, 40, 192, 2)):
        x = torch.randn(M, K, generator=g).to(dtype)
        w = torch.randn(N, K, generator=g).to(dtype)
        for b in (None, torch.randn(N, generator=g).to(dtype)):
            t = dict(tile, SPLIT_K=splits)
            case = (dtype, M, N, K, splits, b is not None)
            for out_dtype in dict.fromkeys((torch.float32, dtype)):
                def run(t):
                    return fixed_tile_matmul(x, w, b, out=torch.empty(M, N, dtype=out_dtype), tile=t)
                workspace, serial, flat = run(t), run(dict(t, SERIAL=True)), run(dict(t, SERIAL=True, FLAT=True))
                assert torch.equal(serial, workspace), (case, out_dtype, "serial")
                assert torch.equal(flat, workspace), (case, out_dtype, "flat")
                if out_dtype == torch.float32:
                    assert not torch.equal(flat, run(dict(t, SPLIT_K=1))), (case, "the splits leave no trace")
            want = x.float() @ w.float().t() + (0 if b is None else b.float())
            torch.testing.assert_close(flat.float(), want, rtol=2e-2, atol=2e-2)
        # The splits' partials as the workspace holds them (fixed_tile_matmul's chunks), added here in two orders.
        chunk = triton.cdiv(triton.cdiv(K, 16), splits) * 16
        parts = torch.empty(triton.cdiv(K, chunk), M, N)
        grid = (triton.cdiv(N, 32) * parts.shape[0] * triton.cdiv(M, 32),)
        _fixed_tile_matmul[grid](x, w, w, parts, M, N, x.stride(0), w.stride(0), N, K=K, SPLIT_K=parts.shape[0],
                                 K_CHUNK=chunk, HAS_BIAS=False, IEEE=dtype == torch.float32, SERIAL=False,
                                 FLAT=False, GDC=False, **tile)
        in_order, reverse = parts[0].clone(), parts[-1].clone()
        for p in parts[1:]:
            in_order += p
        for p in parts.flip(0)[1:]:
            reverse += p
        flat = fixed_tile_matmul(x, w, out=torch.empty(M, N), tile=dict(tile, SPLIT_K=splits, SERIAL=True, FLAT=True))
        assert torch.equal(flat, in_order), (dtype, M, N, K, splits, "in order")
        assert splits == 2 or not torch.equal(flat, reverse), (dtype, M, N, K, splits, "reversed")
print("ok")
"""

# Splits added in groups (GROUP): 4 or 6 splits in groups of 2 or 3, each group's splits in order, then the
# groups in order. A program a split through the workspace (the order in _sum_splits) and a program a group
# (GROUPED: the group's splits added in its program in one loop) give the same bits, fp32 and bf16, rows alone
# and among others, with and without bias; against the partials added here in that order, and against the
# splits added one after the other (another order: other bits where the data tells them apart).
GROUPED = BF16_DOT + ROWWISE_DOT + r"""
import torch
import triton
from server.model.batch_invariant_kernels import _fixed_tile_matmul, fixed_tile_matmul
g = torch.Generator().manual_seed(2)
tile = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=3)
for dtype in (torch.float32, torch.bfloat16):
    for M, N, K, splits, group in ((45, 40, 280, 6, 3), (45, 40, 256, 4, 2), (5, 40, 184, 6, 2)):
        x = torch.randn(M, K, generator=g).to(dtype)
        w = torch.randn(N, K, generator=g).to(dtype)
        t = dict(tile, SPLIT_K=splits, GROUP=group)
        for b in (None, torch.randn(N, generator=g).to(dtype)):
            def run(t, rows=x):
                return fixed_tile_matmul(rows, w, b, out=torch.empty(rows.shape[0], N), tile=t)
            per_split, per_group = run(t), run(dict(t, GROUPED=True))
            case = (dtype, M, N, K, splits, group, b is not None)
            assert torch.equal(per_group, per_split), case
            assert torch.equal(run(t, x[M // 2:M // 2 + 1])[0], per_split[M // 2]), case
            assert torch.equal(run(dict(t, GROUPED=True), x[:1])[0], per_split[0]), case
        chunk = triton.cdiv(triton.cdiv(K, 16), splits) * 16
        parts = torch.empty(splits, M, N)
        grid = (triton.cdiv(N, 32) * splits * triton.cdiv(M, 32),)
        _fixed_tile_matmul[grid](x, w, w, parts, M, N, x.stride(0), w.stride(0), N, K=K, SPLIT_K=splits,
                                 K_CHUNK=chunk, HAS_BIAS=False, IEEE=dtype == torch.float32, SERIAL=False,
                                 FLAT=False, GDC=False, **tile)
        sums = []
        for first in range(0, splits, group):
            s = parts[first].clone()
            for p in parts[first + 1:first + group]:
                s += p
            sums.append(s)
        grouped, in_order = sums[0], parts[0].clone()
        for s in sums[1:]:
            grouped += s
        for p in parts[1:]:
            in_order += p
        got = fixed_tile_matmul(x, w, out=torch.empty(M, N), tile=dict(t, GROUPED=True))
        assert torch.equal(got, grouped), (dtype, M, N, K, splits, group, "grouped order")
        assert not torch.equal(got, in_order), (dtype, M, N, K, splits, group, "the groups leave no trace")
try:
    fixed_tile_matmul(x, w, tile=dict(tile, SPLIT_K=6, GROUP=4))
except ValueError as e:
    assert "groups of 4" in str(e), e
else:
    raise AssertionError("6 splits in groups of 4 accepted")
print("ok")
"""

ATTENTION = r"""
import torch
from server.model.attention import AttentionContext, PrefillSpan
from server.model.batch_invariant_kernels import BatchInvariantTritonOps as ops
bs, H, KVH, D = 16, 6, 2, 32
g = torch.Generator().manual_seed(1)
cache = torch.randn(40, bs, 2, KVH, D, generator=g)   # block-major: K and V are strided views (kv_layout.py)
k_cache, v_cache = cache[:, :, 0], cache[:, :, 1]
table = (torch.randperm(39, generator=g)[:6] + 1).long()
q_tok = torch.randn(H, D, generator=g)
ctx_len = 83

def decode(others):
    q = torch.randn(others + 1, H, D, generator=g)
    q[others // 2] = q_tok
    tables = torch.randint(1, 40, (others + 1, 7), generator=g)
    tables[others // 2, :6] = table
    lens = torch.randint(1, 100, (others + 1,), generator=g)
    lens[others // 2] = ctx_len
    ctx = AttentionContext(torch.zeros(others + 1, dtype=torch.long), others + 1, tables, lens, None)
    return ops.attend(q, None, None, k_cache, v_cache, ctx, 0.17)[others // 2]

def in_span(chunk, decodes):
    other = PrefillSpan(decodes, 9, 20, torch.randint(1, 40, (2,), generator=g))
    mine = PrefillSpan(decodes + 9, chunk, ctx_len, table)
    T = decodes + 9 + chunk
    q = torch.randn(T, H, D, generator=g)
    q[T - 1] = q_tok
    ctx = AttentionContext(torch.zeros(T, dtype=torch.long), decodes, torch.randint(1, 40, (decodes, 2), generator=g),
                           torch.randint(1, 32, (decodes,), generator=g), 32, prefills=[other, mine])
    return ops.attend(q, None, None, k_cache, v_cache, ctx, 0.17)[T - 1]

alone = decode(0)
for r in (decode(3), decode(9), in_span(1, 0), in_span(20, 2), in_span(83, 5)):
    assert torch.equal(r, alone)
k = k_cache[table].flatten(0, 1)[:ctx_len].repeat_interleave(H // KVH, dim=1)
v = v_cache[table].flatten(0, 1)[:ctx_len].repeat_interleave(H // KVH, dim=1)
want = torch.einsum("hk,khd->hd", torch.einsum("hd,khd->hk", q_tok, k).mul(0.17).softmax(-1), v)
torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-5)
print("ok")
"""

# The whole engine on the CUDA path's ops (BatchInvariantTritonOps, their kernels interpreted) on a one-layer
# model: a prompt longer than the token budget (so prefilled in chunks), alone and among other requests, greedy
# and seeded, then re-scored as a prompt: what the H200 test checks, minus the hardware and the graphs.
ENGINE = ROWWISE_DOT + r"""
import tempfile
from dataclasses import replace
from server import LLM
from server.model.batch_invariant_kernels import BatchInvariantTritonOps
from testkit.batch_invariance import GREEDY, SEEDED, alone_and_among, explain, rescored
from testkit.models import model_folder
llm = LLM(model=str(model_folder("llama-micro", tempfile.mkdtemp())), device="cpu", load_format="dummy",
          batch_invariant=True, max_num_batched_tokens=16, kv_cache_memory="16MiB", max_model_len=256)
llm.engine.runner.model.ops = BatchInvariantTritonOps
prompt = [5 + (7 * i) % 1000 for i in range(28)]
targets = [(prompt, replace(GREEDY, max_tokens=3)), (prompt, replace(SEEDED, max_tokens=3))]
for alone, among in alone_and_among(llm, 2, targets=targets):
    assert alone == among, explain(alone, among)
gen, scored = rescored(llm, prompt, replace(GREEDY, max_tokens=3))
assert gen[1] == scored, explain(gen, (gen[0], scored))
print("ok")
"""


# The mode's start-up warm-up: every distinct tile of every weight the mode multiplies, run once, nothing else. In
# bf16 as on a GPU, sized as for 132 multiprocessors: K split on qkv and o_proj, 64-row tiles through the
# workspace, then in one loop from 577 rows; the LM head unsplit, 128-row tiles from 128 rows.
WARM_UP = r"""
import tempfile
import torch
from server import LLM
from server.model import batch_invariant_kernels as bik
from testkit.models import model_folder
llm = LLM(model=str(model_folder("llama-tiny", tempfile.mkdtemp())), device="cpu", load_format="dummy",
          dtype="bfloat16", batch_invariant=True, kv_cache_memory="64MiB", max_model_len=256)
bik._processors = lambda device: 24  # llama-tiny's gate|up (24 column tiles) unsplit, its other weights split
model = llm.engine.runner.model
pairs = bik.mode_weights(model)
attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
took = {id(w) for w, _ in pairs}
assert id(attn.qkv_weight) in took and id(mlp.gate_up_weight) in took, [tuple(w.shape) for w, _ in pairs]
assert id(attn.q_proj.weight) not in took and id(mlp.gate_proj.weight) not in took  # views of a fused group's
assert id(model.output_weight()) in took
shapes = sorted(tuple(w.shape) for w, _ in pairs)
assert len(shapes) == len(set(shapes)) >= 4, shapes
# normed, roped: the tiles whose split sum ran with the norm, or with rotary and the cache write, after it
launched, normed, roped = [], [], []
real = bik.fixed_tile_matmul
def recording(x, weight, bias=None, out=None, tile=None, finish=None):
    tile = tile or bik.matmul_tile(*weight.shape, weight.dtype, weight.device, x.shape[0])
    into = {None: launched, "fixed_tile_matmul_add_rmsnorm": normed, "fixed_tile_matmul_rope": roped}[
        finish and finish.__qualname__.split(".")[0]]
    into.append((tuple(weight.shape), x.shape[0], tuple(sorted(tile.items()))))
    return real(x, weight, bias, out, tile, finish)
bik.fixed_tile_matmul = recording
fused = []  # the packed gate|up weight's SiLU x up kernel, at each of its tiles that does not split K
real_gate_up = bik.fixed_tile_gate_up
def recording_gate_up(x, weight, bias=None, tile=None):
    fused.append((tuple(weight.shape), tuple(sorted(tile.items()))))
    return real_gate_up(x, weight, bias, tile)
bik.fixed_tile_gate_up = recording_gate_up
ran = bik.warm_up(model, 700)
want = {(tuple(w.shape), tuple(sorted(bik.matmul_tile(*w.shape, w.dtype, w.device, r).items())))
        for w, _ in pairs for r in range(1, 701)}
assert ran == len(launched) + len(fused) + len(normed) + len(roped) and len(launched) == len(want) == len(
    {(s, t) for s, _, t in launched}), (ran, len(launched), len(fused), len(normed), len(roped), len(want))
summed = {(s, t) for s, t in want if bik.sums_to_norm(*s, torch.bfloat16, torch.device("cpu"))}
assert {(s, t) for s, _, t in normed} == summed and len(normed) == len(summed), (len(normed), len(summed))
assert summed, "no llama-tiny weight sums to its norm on 24 multiprocessors: the fused sum went unchecked"
rotated = {(s, t) for s, t in want if s == tuple(attn.qkv_weight.shape) and dict(t)["SPLIT_K"] > 1
           and not dict(t)["SERIAL"]}
assert {(s, t) for s, _, t in roped} == rotated and len(roped) == len(rotated), (len(roped), len(rotated))
assert rotated, "llama-tiny's qkv never goes through the workspace on 24 multiprocessors: the fused rotary went unchecked"
assert {(s, t) for s, _, t in launched} == want
assert set(fused) == {(s, t) for s, t in want if s == tuple(mlp.gate_up_weight.shape) and dict(t)["SPLIT_K"] == 1}
assert fused, "llama-tiny's gate|up has no unsplit tile on 24 multiprocessors: the fused kernel went unchecked"
kinds = {"flat" if dict(t)["FLAT"] else "grouped" if dict(t)["GROUPED"] and dict(t)["GROUP"] > 1 else "workspace"
         for _, _, t in launched if dict(t)["SPLIT_K"] > 1}
# on 24 SMs llama-tiny's weights meet every way of adding splits: the workspace a split, a program a group of
# them (its down: 6 splits in groups of 2), all of them in one loop
assert kinds == {"grouped", "workspace", "flat"}, kinds
print("ok", ran)
"""


@pytest.mark.slow  # ~2.5 min of interpreted matmuls (the LM head at 128 rows, qkv at 577)
def test_the_modes_warm_up_runs_every_tile_of_every_weight_in_interpreter():
    assert run_interpreted(WARM_UP, timeout=600).strip().startswith("ok")


def test_the_engine_on_the_cuda_ops_in_interpreter():
    assert run_interpreted(ENGINE, timeout=600).strip().endswith("ok")

GATE_UP = ROWWISE_DOT + r"""
import torch
import torch.nn.functional as F
from server.model.batch_invariant_kernels import fixed_tile_gate_up, fixed_tile_matmul
from server.model.fused_ops import TritonOps
g = torch.Generator().manual_seed(1)
I, K = 40, 80  # 40 columns of gate and of up: the last column tile masked
unsplit = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=3, SPLIT_K=1)
for bias in (False, True):
    w = torch.randn(2 * I, K, generator=g)
    b = torch.randn(2 * I, generator=g) if bias else None
    x = torch.randn(K, generator=g)
    # one launch: the matmul's bits, then SiLU x up's (the two launches it replaces), a row alone or among others
    alone = fixed_tile_gate_up(x[None], w, b, tile=unsplit)[0]
    gu = fixed_tile_matmul(x[None], w, b, tile=unsplit)
    assert torch.equal(alone, TritonOps.silu_mul_packed(gu)[0]), bias
    ref = x @ w.t() + (b if bias else 0)
    torch.testing.assert_close(alone, F.silu(ref[:I]) * ref[I:], rtol=1e-5, atol=1e-5)
    for rows in (3, 70):
        for at in sorted({0, rows // 2, rows - 1}):
            batch = torch.randn(rows, K, generator=g)
            batch[at] = x
            assert torch.equal(fixed_tile_gate_up(batch, w, b, tile=unsplit)[at], alone), (bias, rows, at)
    # a split K stays the matmul and SiLU x up, two launches, with the same bits
    split = dict(unsplit, SPLIT_K=2)
    assert torch.equal(fixed_tile_gate_up(x[None], w, b, tile=split)[0],
                       TritonOps.silu_mul_packed(fixed_tile_matmul(x[None], w, b, tile=split))[0])
print("ok")
"""


# Weight tiles loaded ahead of a chained program's wait (AHEAD): the split matmul's partials and gate|up's output
# with 1-4 (1-2) steps' tiles loaded first are bit for bit those loaded in the loop, a split's masked K tail
# included (K 200 in 3 splits of 5 steps of 16: the last split's last steps past K), fp32 and bf16.
AHEAD = BF16_DOT + ROWWISE_DOT + r"""
import torch
import triton
from server.model.batch_invariant_kernels import _fixed_tile_gate_up, _fixed_tile_matmul
g = torch.Generator().manual_seed(3)
tile = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=3)
for dtype in (torch.float32, torch.bfloat16):
    M, N, K, splits = 5, 40, 200, 3
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    chunk = triton.cdiv(triton.cdiv(K, 16), splits) * 16
    grid = (triton.cdiv(N, 32) * splits * triton.cdiv(M, 64),)

    def partials(ahead):
        parts = torch.full((splits, M, N), float("nan"))
        _fixed_tile_matmul[grid](x, w, w, parts, M, N, x.stride(0), w.stride(0), N, K=K, SPLIT_K=splits,
                                 K_CHUNK=chunk, HAS_BIAS=False, IEEE=dtype == torch.float32, SERIAL=False,
                                 FLAT=False, GDC=False, AHEAD=ahead, **tile)
        return parts

    loop = partials(0)
    for ahead in (1, 2, 3, 4):
        assert torch.equal(partials(ahead), loop), (dtype, ahead)
    I = 40
    wg = torch.randn(2 * I, K, generator=g).to(dtype)

    def gate_up(ahead):
        out = torch.empty(M, I, dtype=dtype)
        _fixed_tile_gate_up[(triton.cdiv(I, 32) * triton.cdiv(M, 64),)](
            x, wg, wg, out, M, I, x.stride(0), wg.stride(0), out.stride(0), K=K, HAS_BIAS=False,
            IEEE=dtype == torch.float32, GDC=False, AHEAD=ahead, **tile)
        return out

    plain = gate_up(0)
    for ahead in (1, 2):
        assert torch.equal(gate_up(ahead), plain), (dtype, "gate_up", ahead)
print("ok")
"""


def test_weights_loaded_ahead_of_the_wait_give_the_same_bits_in_interpreter():
    assert run_interpreted(AHEAD).strip().endswith("ok")


def test_fixed_tile_gate_up_is_the_matmul_then_silu_times_up_in_interpreter():
    assert run_interpreted(GATE_UP).strip().endswith("ok")


NORM = ROWWISE_DOT + r"""
import torch
import server.model.batch_invariant_kernels as bik
from server.model.batch_invariant_kernels import (fixed_tile_matmul, fixed_tile_matmul_add_rmsnorm, matmul_tile,
                                                  split_order, sums_to_norm)
from server.model.fused_ops import TritonOps
g = torch.Generator().manual_seed(2)
N, K, eps = 96, 512, 1e-6
dtype, device = torch.float32, torch.device("cpu")
assert sums_to_norm(N, K, dtype, device) and not sums_to_norm(N, 64, dtype, device)  # 64: one split, unsplit
splits, group = split_order(N, K, 64, 32, 4)
assert matmul_tile(N, K, dtype, device, 1)["SPLIT_K"] == splits > 1 and group > 1, (splits, group)
tile = matmul_tile(N, K, dtype, device, 130)
bik.WORKSPACE_BYTES = splits * N * 4 * 64  # launches of 64 rows at most: 130 rows take three
w, nw = torch.randn(N, K, generator=g), torch.rand(N, generator=g) + 0.5
for bias in (None, torch.randn(N, generator=g)):
    x, r = torch.randn(K, generator=g), torch.randn(N, generator=g)
    alone, alone_r = fixed_tile_matmul_add_rmsnorm(x[None], w, bias, r[None], nw, eps)
    for rows in (1, 5, 70, 130):
        for at in sorted({0, rows // 2, rows - 1}):
            batch, res = torch.randn(rows, K, generator=g), torch.randn(rows, N, generator=g)
            batch[at], res[at] = x, r
            out, rout = fixed_tile_matmul_add_rmsnorm(batch, w, bias, res, nw, eps)
            # the two launches it replaces, bit for bit, and a row's bits whatever the batch
            want, want_r = TritonOps.add_rmsnorm(fixed_tile_matmul(batch, w, bias), res, nw, eps)
            assert torch.equal(out, want) and torch.equal(rout, want_r), (rows, at)
            assert torch.equal(out[at], alone[0]) and torch.equal(rout[at], alone_r[0]), (rows, at)
    ref = x @ w.t() + (0 if bias is None else bias) + r
    torch.testing.assert_close(alone_r[0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone[0], nw * ref * torch.rsqrt(ref.pow(2).mean() + eps), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_a_split_sum_the_residual_add_and_the_norm_are_one_launch_in_interpreter():
    """fixed_tile_matmul_add_rmsnorm (the mode's o_proj and down with the norm after them): the matmul's split sum,
    the residual add and RMSNorm in one launch give the bits of the matmul then add_rmsnorm, at 1-130 rows (in
    several workspace launches), with and without a bias, a row's bits the same alone or among others."""
    assert run_interpreted(NORM).strip().endswith("ok")


ROPE = BF16_DOT + ROWWISE_DOT + r"""
import types
import torch
import server.model.batch_invariant_kernels as bik
from server.model.batch_invariant_kernels import fixed_tile_matmul, fixed_tile_matmul_rope, matmul_plan
from server.model.fused_ops import TritonOps
from server.model.ops import TorchOps, heads_then_rope, split_qkv
g = torch.Generator().manual_seed(3)
H, KVH, D, K, BS = 4, 2, 16, 1024, 4
N = (H + 2 * KVH) * D
dtype, device = getattr(torch, DTYPE), torch.device("cpu")
tol = 1e-4 if dtype == torch.float32 else 3e-2
plan = matmul_plan(1, N, K, dtype, device)
assert plan.through_workspace and plan.group > 1 and matmul_plan(130, N, K, dtype, device).through_workspace, plan
bik.WORKSPACE_BYTES = plan.splits * N * 4 * 64  # launches of 64 rows at most: 130 rows take three
def rand(*shape):
    return torch.randn(*shape, generator=g).to(dtype)
class Norm:  # Qwen3's q_norm and k_norm
    def __init__(self):
        self.weight, self.eps = (torch.rand(D, generator=g) + 0.5).to(dtype), 1e-6
def layer(norms):
    cache = torch.zeros(2, 40, BS, KVH, D, dtype=dtype)  # k | v, blocks, slots a block, heads, D
    return types.SimpleNamespace(num_heads=H, num_kv_heads=KVH, head_dim=D, k_cache=cache[0], v_cache=cache[1],
                                 q_norm=norms[0], k_norm=norms[1]), cache
w = rand(N, K) / K ** 0.5
for bias in (None, rand(N)):
    # (Qwen3's head norms in fp32 only: the interpreter multiplies a bf16 weight's bits as integers, in either kernel)
    for norms in ((None, None), (Norm(), Norm())) if dtype == torch.float32 else ((None, None),):
        for rows in (1, 130) if dtype == torch.float32 else (1, 3, 130):
            x = rand(rows, K)
            angles = torch.randint(0, 100, (rows, 1), generator=g) * 0.1 + torch.arange(D)
            cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
            slots = torch.randperm(40 * BS, generator=g)[:rows]
            (fused, fused_cache), (apart, apart_cache) = layer(norms), layer(norms)
            got = fixed_tile_matmul_rope(x, w, bias, fused, cos, sin, slots)
            # the two launches it replaces, bit for bit: the split sum, then rotary and the cache write
            want = heads_then_rope(TritonOps, apart, split_qkv(apart, fixed_tile_matmul(x, w, bias)), cos, sin, slots)
            case = (bias is None, norms[0] is None, rows)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), case
            assert torch.equal(fused_cache, apart_cache) and fused_cache.abs().sum() > 0, case
            product = (x.float() @ w.float().t() + (0 if bias is None else bias.float())).to(dtype)
            ref = heads_then_rope(TorchOps, apart, split_qkv(apart, product), cos, sin, slots)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
print("ok")
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_qkv_split_sum_rotary_and_the_cache_write_are_one_launch_in_interpreter(dtype):
    """fixed_tile_matmul_rope (the mode's q|k|v at rows whose tile goes through the workspace): the split sum, rotary
    (with Qwen3's head norms, fp32, and without) and the K/V cache write in one launch give the bits of the split sum then
    rope_and_cache, at 1-130 rows (several workspace launches; bf16's 130 rows on 128-row tiles, a program a group of
    splits), with and without bias; close to the unfused torch reference."""
    assert run_interpreted(f"DTYPE = {dtype!r}\n" + ROPE, timeout=600).strip().endswith("ok")


WIRING = r"""
import tempfile
from server import LLM, SamplingParams
from server.model import batch_invariant_kernels as bik
from testkit.models import model_folder
bik._processors = lambda device: 24  # llama-tiny's o_proj and down then always split: they sum to their norm
llm = LLM(model=str(model_folder("llama-tiny", tempfile.mkdtemp())), device="cpu", load_format="dummy",
          batch_invariant=True, kv_cache_memory="16MiB", max_model_len=64, max_num_batched_tokens=16)
model = llm.engine.runner.model
from server.model.ops import norm_then_qkv
folded, roped = [], []  # the matmuls whose split sum ran with the norm, with rotary and the cache write
real_norm, real_rope = bik.fixed_tile_matmul_add_rmsnorm, bik.fixed_tile_matmul_rope
def recording_norm(x, weight, *rest):
    folded.append(tuple(weight.shape))
    return real_norm(x, weight, *rest)
def recording_rope(x, weight, bias, attn, *rest):
    roped.append((tuple(weight.shape), x.shape[0]))
    return real_rope(x, weight, bias, attn, *rest)
bik.fixed_tile_matmul_add_rmsnorm, bik.fixed_tile_matmul_rope = recording_norm, recording_rope
class Unfolded(bik.BatchInvariantTritonOps):  # every split sum its own launch
    linear_to_norm = bik.BatchInvariantTritonOps.linear
    @classmethod
    def norm_qkv(cls, attn, norm, x, residual):
        return norm_then_qkv(cls, attn, norm, x, residual)
params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=2, ignore_eos=True)
runs = []
for ops in (bik.BatchInvariantTritonOps, Unfolded):
    model.ops = ops
    out = llm.generate([[5, 6, 7, 8, 9]], params)[0].outputs[0]
    runs.append((out.token_ids, [[(t, lp.logprob) for t, lp in sorted(d.items())] for d in out.logprobs]))
layer = model.model.layers[0]
# every layer's o_proj and down, at the prefill and at the decode step, through the one launch
assert set(folded) == {tuple(layer.self_attn.o_proj.weight.shape), tuple(layer.mlp.down_proj.weight.shape)}, folded
assert len(folded) == 2 * 2 * len(model.model.layers), len(folded)
# every layer's q|k|v at the prefill (5 tokens) and the decode step, through the one launch with the rotary
assert roped == [(tuple(layer.self_attn.qkv_weight.shape), t) for t in (5, 1) for _ in model.model.layers], roped
assert runs[0] == runs[1], runs
print("ok")
"""


@pytest.mark.slow  # ~3 min of an interpreted llama-tiny, twice
def test_the_layers_hand_o_proj_and_down_to_the_norm_in_interpreter():
    """Through the engine on the mode's CUDA ops (the interpreter, llama-tiny sized as on 24 SMs so q|k|v, o_proj and
    down split): every layer's o_proj and down reach the next norm as an Unsummed and run as one launch with it, its
    q|k|v's split sum runs with the rotary and the cache write, and the greedy tokens and log-probs are those of the
    layers with every split sum apart."""
    assert run_interpreted(WIRING, timeout=600).strip().endswith("ok")


@pytest.mark.parametrize("group", [1, 2])
def test_the_sum_with_the_norm_compiles_for_sm90_chained(group):
    """_sum_add_rmsnorm at the 1B's o_proj (8 partials of 2048 columns, in groups of 2 or of 1) as a decode step
    chains it on Hopper: it waits for the split matmul before touching memory and lets the next kernel launch."""
    from server.model.batch_invariant_kernels import _sum_add_rmsnorm
    from tests.interpreter import compile_for_sm90, ptxas_usage

    kernel = compile_for_sm90(_sum_add_rmsnorm, {"ws_ptr": "*fp32", "b_ptr": "*bf16", "r_ptr": "*bf16",
                                                 "w_ptr": "*bf16", "out_ptr": "*bf16", "rout_ptr": "*bf16",
                                                 "M": "i32", "N": "i32", "eps": "fp32"},
                              dict(SPLIT_K=8, BLOCK=2048, HAS_BIAS=False, HAS_RESIDUAL=True, GDC=True, GROUP=group))
    assert waits_before_memory(kernel.asm["ptx"])
    assert ptxas_usage(kernel)[1] == 0


def test_fixed_tile_matmul_rows_are_invariant_in_interpreter():
    assert run_interpreted(MATMUL).strip().endswith("ok")


def test_flat_serial_sum_is_the_serial_and_the_workspace_sum_in_interpreter():
    assert run_interpreted(FLAT_SERIAL).strip().endswith("ok")


def test_grouped_split_sums_are_one_order_through_either_program_layout_in_interpreter():
    assert run_interpreted(GROUPED).strip().endswith("ok")


def test_split_k_follows_the_weight_and_the_device_only():
    """The split count fills an H200 (132 multiprocessors) at one M tile where the column tiles do not, keeps
    every split a few BLOCK_K steps long, and is 1 where the columns alone fill it (no workspace)."""
    from server.model.batch_invariant_kernels import (
        MIN_SPLIT_STEPS,
        PROGRAMS_PER_SM,
        splits_for,
    )

    for N, K in ((3072, 2048), (2048, 2048), (2048, 8192), (6144, 4096), (4096, 4096), (4096, 14336)):
        s = splits_for(N, K, 64, 64, 132)
        assert s > 1 and K // 64 // s >= MIN_SPLIT_STEPS, (N, K, s)
        assert -(-N // 64) * s >= 132 or s == K // 64 // MIN_SPLIT_STEPS, (N, K, s)
        assert -(-N // 64) * s < PROGRAMS_PER_SM * 132 + -(-N // 64), (N, K, s)
    assert splits_for(128256, 2048, 128, 64, 132) == 1 and splits_for(16384, 2048, 64, 64, 132) == 1


def test_how_rows_are_spread_follows_the_rows_and_the_order_does_not(monkeypatch):
    """On 132 multiprocessors (an H100's or H200's): one row and 64 take 64-row tiles and the workspace; 256 rows
    take, on the split weights whose 128 x 128 tiles leave the GPU idle (the 1B's three, the 8B's o_proj and
    down), those tiles a program a group of splits (GROUPED); on the 8B's qkv 128-row tiles adding all its splits
    in one loop; on unsplit weights 128-row tiles, on Hopper 256 columns wide. What orders a row's sum (BLOCK_K,
    SPLIT_K, GROUP) is the same at every row count; the columns follow the rows on Hopper only (WIDE_COLUMNS, and
    the grouped tiles' 128)."""
    import torch

    from server.model import batch_invariant_kernels as bik

    monkeypatch.setattr(bik, "_processors", lambda device: 132)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    order = ("BLOCK_K", "SPLIT_K", "GROUP")
    # (N, K): BLOCK_M, FLAT, GROUPED, BLOCK_N at 256 rows on Hopper
    want_at_256 = {(3072, 2048): (128, False, True, 128), (2048, 8192): (128, False, True, 128),
                   (6144, 4096): (128, True, False, 64), (4096, 14336): (128, False, True, 128),
                   (128256, 2048): (128, False, False, 256), (16384, 2048): (128, False, False, 256),
                   (28672, 4096): (128, False, False, 256)}
    for hopper in (False, True):
        monkeypatch.setattr(bik, "_hopper", lambda device: hopper)
        for (N, K), (block_m, flat, grouped, block_n) in want_at_256.items():
            one, many = bik.matmul_tile(N, K, bf16, cpu, 1), bik.matmul_tile(N, K, bf16, cpu, 256)
            assert [one[k] for k in order] == [many[k] for k in order] == [bik.matmul_tile(N, K, bf16, cpu, 64)[k]
                                                                              for k in order]
            assert (many["BLOCK_M"], many["FLAT"], many["SERIAL"], many["GROUPED"]) == (block_m, flat, flat, grouped)
            assert many["BLOCK_N"] == (block_n if hopper else one["BLOCK_N"]), (N, K, hopper, many)
            assert one["BLOCK_N"] == bik.matmul_tile(N, K, bf16, cpu, 64)["BLOCK_N"] < 256, (N, K, one)
            assert (one["BLOCK_M"], one["SERIAL"], one["GROUPED"]) == (64, False, False), (N, K, one)
            assert not bik.matmul_tile(N, K, bf16, cpu, 64)["SERIAL"], (N, K)
            fp32 = bik.matmul_tile(N, K, torch.float32, cpu, 256)
            assert (fp32["BLOCK_M"], fp32["SERIAL"], fp32["GROUPED"], fp32["BLOCK_N"]) == (64, False, False,
                                                                                          one["BLOCK_N"]), (N, K, fp32)


def test_split_order_groups_the_splits_a_wave_of_tiles_wants():
    """(SPLIT_K, GROUP) on 132 multiprocessors for the 1B's and 8B's split weights: the count the nearest multiple
    of groups_for's (2048 columns: 4 groups, 4096: 2, 3072: 2, 6144: 1) to splits_for's, whole BLOCK_K steps a
    split (what fixed_tile_matmul cuts K into), GROUP dividing it; 1 where the tiles alone fill the GPU."""
    from server.model.batch_invariant_kernels import groups_for, split_order

    assert [groups_for(n, 132) for n in (2048, 3072, 4096, 6144)] == [4, 2, 2, 1]
    want = {(3072, 2048): (6, 3), (2048, 2048): (8, 2), (2048, 8192): (8, 2), (6144, 4096): (3, 1),
            (4096, 4096): (6, 3), (4096, 14336): (6, 3), (128256, 2048): (1, 1), (16384, 2048): (1, 1)}
    for (N, K), pair in want.items():
        splits, group = split_order(N, K, 64, 64, 132)
        assert (splits, group) == pair, (N, K, splits, group)
        steps = -(-K // 64)
        assert splits == -(-steps // -(-steps // splits)) and splits % group == 0, (N, K)


def test_per_token_attention_is_the_same_in_decode_and_prefill_in_interpreter():
    assert run_interpreted(ATTENTION).strip().endswith("ok")


@pytest.mark.parametrize("serial", [False, True])
def test_split_k_matmul_compiles_for_sm90_without_a_gpu(serial):
    """The 8B qkv's tile at 256 rows (128-row tiles on 8 warps, K split 4 ways), through the workspace and with the
    splits added in each program, through the compiler to an sm_90 cubin; serially, the three additions of the
    partials stay additions (with one BLOCK_K step a split the compiler folds them into the MMAs' accumulator,
    another rounding: fixed_tile_matmul never runs such a split serially). Both chained by dependent launch, as
    the mode launches them on Hopper: each waits for the kernel before it and lets the next launch."""
    from server.model.batch_invariant_kernels import _fixed_tile_matmul, _sum_splits
    from tests.interpreter import compile_for_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32" if not serial else "*bf16",
           **{p: "i32" for p in ("M", "N", "stride_x", "stride_w", "stride_o")}}
    kernel = compile_for_sm90(_fixed_tile_matmul, sig, dict(K=4096, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4,
                                                            K_CHUNK=1024, HAS_BIAS=False, IEEE=False, SERIAL=serial,
                                                            GDC=True, GROUPED=1),
                              num_warps=8, num_stages=4)
    chained = [kernel]
    if serial:  # the partials added as _sum_splits adds them: 3 adds, none folded into an MMA's accumulator
        assert kernel.asm["ttgir"].count("arith.addf") == 3
    else:  # through the workspace: the sum launches before the matmul ends and waits for it
        chained.append(compile_for_sm90(_sum_splits, {"ws_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16",
                                                      "M": "i32", "N": "i32", "stride_o": "i32"},
                                        dict(SPLIT_K=4, BLOCK=512, HAS_BIAS=False, GDC=True, GROUP=1)))
    for k in chained:
        assert waits_before_memory(k.asm["ptx"])


@pytest.mark.parametrize("flat", [False, True])
def test_serial_matmul_pipelines_on_sm90_without_a_gpu(flat):
    """The 8B qkv's tile at 256 rows (K split 4 ways, added in each program), compiled as the JIT compiles it for
    the mode's tensors (pointers, N and strides multiples of 16: the loads become asynchronous copies). SERIAL
    is 4 pipelined loops, one a split, and 3 additions; FLAT is ONE pipelined loop whose MMA stays asynchronous
    (one left in flight at the end of an iteration; the wait for all of them only in the branch that folds a
    split's partial into the total, the one addition)."""
    from server.model.batch_invariant_kernels import _fixed_tile_matmul
    from tests.interpreter import compile_for_sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
           **{p: "i32" for p in ("M", "N", "stride_x", "stride_w", "stride_o")}}
    kernel = compile_for_sm90(_fixed_tile_matmul, sig, dict(K=4096, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, SPLIT_K=4,
                                                            K_CHUNK=1024, HAS_BIAS=False, IEEE=False, SERIAL=True,
                                                            FLAT=flat, GDC=True, GROUPED=1),
                              divisible=("x_ptr", "w_ptr", "b_ptr", "out_ptr", "N", "stride_x", "stride_w", "stride_o"),
                              num_warps=8, num_stages=4)
    ttgir = kernel.asm["ttgir"]
    loops, additions = (1, 1) if flat else (4, 3)
    assert ttgir.count("scf.for") == loops and ttgir.count("arith.addf") == additions
    assert "ttg.async_copy_global_to_local" in ttgir and ttgir.count("pendings = 1") == loops
    if flat:
        loop = ttgir[ttgir.index("scf.for"):]
        assert loop.index("scf.if") < loop.index("pendings = 0") < loop.index("arith.addf")


@pytest.mark.parametrize("block_m, warps", [(128, 8), (64, 4)])
def test_grouped_matmul_pipelines_on_sm90_without_spills(block_m, warps):
    """A program a group (GROUPED) at the 1B down's 256-row candidates (K 8192 in 9 splits of 15 steps, groups of
    3; 128 columns, 4 stages): its group's splits in ONE pipelined loop as FLAT's (the asynchronous MMA left in
    flight, one addition, in the branch that folds a split), no spills, waiting for the kernel before it; the
    workspace's sum in groups of one chained likewise."""
    from server.model.batch_invariant_kernels import _fixed_tile_matmul, _sum_splits
    from tests.interpreter import compile_for_sm90, ptxas_usage

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32",
           **{p: "i32" for p in ("M", "N", "stride_x", "stride_w", "stride_o")}}
    kernel = compile_for_sm90(_fixed_tile_matmul, sig, dict(K=8192, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64,
                                                            SPLIT_K=9, K_CHUNK=960, HAS_BIAS=False, IEEE=False,
                                                            SERIAL=False, FLAT=False, GDC=True, GROUPED=3),
                              divisible=("x_ptr", "w_ptr", "b_ptr", "out_ptr", "N", "stride_x", "stride_w", "stride_o"),
                              num_warps=warps, num_stages=4)
    ttgir = kernel.asm["ttgir"]
    assert ttgir.count("scf.for") == 1 and ttgir.count("arith.addf") == 1
    assert "ttg.async_copy_global_to_local" in ttgir and ttgir.count("pendings = 1") == 1
    registers, spills = ptxas_usage(kernel)
    assert spills == 0 and registers <= 255, (registers, spills)
    folded = compile_for_sm90(_sum_splits, {"ws_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32",
                                            "N": "i32", "stride_o": "i32"},
                              dict(SPLIT_K=3, BLOCK=512, HAS_BIAS=False, GDC=True, GROUP=1))
    for k in (kernel, folded):
        assert waits_before_memory(k.asm["ptx"])


@pytest.mark.parametrize("block_m, block_n, warps, stages", [(64, 64, 4, 4), (128, 128, 8, 3)])
def test_gate_up_kernel_compiles_for_sm90_without_spills(block_m, block_n, warps, stages):
    """_fixed_tile_gate_up at the 8B's K as the mode launches it on Hopper: the 1B's one-row tile (64 x 64) and the
    8B's halved (64 x 64), and the 256-row tile halved (128 x 128 of gate and of up: two accumulators where the matmul
    alone has one of 128 x 256, on 8 warps, 3 stages); ptxas keeps both in registers (207 a thread against the
    matmul's 184 on 2026-12-05), and the kernel waits for the one before it before touching memory."""
    from server.model.batch_invariant_kernels import _fixed_tile_gate_up
    from tests.interpreter import compile_for_sm90, ptxas_usage

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
           **{p: "i32" for p in ("M", "I", "stride_x", "stride_w", "stride_o")}}
    kernel = compile_for_sm90(_fixed_tile_gate_up, sig, dict(K=4096, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                                                            HAS_BIAS=False, IEEE=False, GDC=True),
                              divisible=("x_ptr", "w_ptr", "b_ptr", "out_ptr", "I", "stride_x", "stride_w", "stride_o"),
                              num_warps=warps, num_stages=stages)
    registers, spills = ptxas_usage(kernel)
    assert spills == 0 and registers <= 255, (registers, spills)
    assert waits_before_memory(kernel.asm["ptx"])


def _wgmmas(ptx: str) -> list[str]:
    """A kernel's warpgroup MMAs: the instruction and its scale-d operand (1: it adds the accumulator, 0: it does not),
    as a literal or the value of the predicate register that carries it."""
    lines = [line.strip() for line in ptx.splitlines()]
    preds = dict(re.findall(r"mov\.pred\s+(%p\d+), (-?\d+);", "\n".join(lines)))
    out = []
    for line in (line for line in lines if line.startswith("wgmma.mma_async")):
        scale_d = line[line.index("}") + 1:].split(",")[3].strip()
        out.append(f"{line.split()[0]} scale-d {preds.get(scale_d, scale_d)}")
    return out


@pytest.mark.parametrize("case", ["qkv", "o_proj", "lm_head", "gate_up"])
def test_chained_one_row_tiles_load_weights_ahead_of_the_wait_on_sm90(case):
    """The 1B's one-row tiles as the mode launches them on Hopper with AHEAD (steps_ahead: 4 steps of a 64-column
    weight, 2 of a 128-column one or of gate and up): the weight tiles' loads come before griddepcontrol.wait, every
    other global access after it; every MMA is the same instruction as the loop's, adding its accumulator (the
    steps out of the loop start from a zero the compiler cannot see, as the loop does); no spills."""
    from server.model import batch_invariant_kernels as bik
    from tests.interpreter import compile_for_sm90, ptxas_usage

    n = "I" if case == "gate_up" else "N"
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32" if case in ("qkv", "o_proj") else "*bf16",
           **{p: "i32" for p in ("M", n, "stride_x", "stride_w", "stride_o")}}
    constexprs = dict(K=2048, BLOCK_M=64, BLOCK_N=128 if case == "lm_head" else 64, BLOCK_K=64, HAS_BIAS=False,
                      IEEE=False, GDC=True)
    splits, chunk = {"qkv": (6, 384), "o_proj": (8, 256), "lm_head": (1, 2048), "gate_up": (1, 2048)}[case]
    if case != "gate_up":
        constexprs.update(SPLIT_K=splits, K_CHUNK=chunk, SERIAL=False, FLAT=False, GROUPED=1)
    fn = bik._fixed_tile_gate_up if case == "gate_up" else bik._fixed_tile_matmul
    tile = {"BLOCK_M": 64, "BLOCK_N": constexprs["BLOCK_N"], "BLOCK_K": 64, "num_warps": 4}
    ahead = bik.steps_ahead(tile, chunk, 2, tiles_a_step=2 if case == "gate_up" else 1)
    assert ahead == {"qkv": 4, "o_proj": 4, "lm_head": 2, "gate_up": 2}[case]
    plain, early = (compile_for_sm90(fn, sig, {**constexprs, "AHEAD": a}, num_warps=4, num_stages=4,
                                     divisible=("x_ptr", "w_ptr", "b_ptr", "out_ptr", n, "stride_x", "stride_w",
                                                "stride_o"))
                    for a in (0, ahead))
    lines = [line.strip() for line in early.asm["ptx"].splitlines()]
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    global_access = re.compile(r"^(@!?%p\d+\s+)?(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")
    before = [line for line in lines[:wait] if global_access.match(line)]
    assert before and all(re.match(r"^(@!?%p\d+\s+)?ld\.global", line) for line in before), before[:4]
    mmas, loop = _wgmmas(early.asm["ptx"]), _wgmmas(plain.asm["ptx"])
    assert set(mmas) == set(loop) and all(m.endswith("scale-d -1") for m in mmas), (set(mmas), set(loop))
    assert ptxas_usage(early)[1] == 0


def test_the_modes_per_row_kernels_chain_on_sm90_without_a_gpu():
    """RMSNorm and SiLU x up as the mode launches them on Hopper (GDC): each waits in-kernel for the kernel
    before it (griddepcontrol.wait) and lets the next one launch; without GDC, neither instruction."""
    from server.model.fused_ops import _add_rmsnorm, _silu_mul_packed
    from tests.interpreter import compile_for_sm90

    for gdc in (True, False):
        norm = compile_for_sm90(_add_rmsnorm, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                               "rout_ptr": "*bf16", "n_cols": "i32", "eps": "fp32"},
                                dict(HAS_RESIDUAL=True, BLOCK=2048, GDC=gdc))
        silu = compile_for_sm90(_silu_mul_packed, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32"},
                                dict(BLOCK=1024, GDC=gdc))
        for k in (norm, silu):
            assert waits_before_memory(k.asm["ptx"]) == gdc
