"""Batch-invariant arithmetic (--batch-invariant): every reduction a token's result depends on runs in an
order fixed by the model's shapes alone, never by how many tokens share the step, where the token sits in
the batch, or whether it is prefilled, decoded or read back through the prefix cache.

The three places a reduction's order can follow the batch, and what this mode does instead:
- GEMMs: a BLAS picks its kernel from the number of rows (MKL: one row is a GEMV, 2-3 rows another kernel,
  4 and more a third; each sums over K in its own order). Here every matmul runs on blocks of exactly
  GEMM_ROWS rows (the last one zero-padded), so each row meets one kernel with one shape: a row's result
  depends on its own values only (tests/model/test_batch_invariant_ops.py checks it for every row position).
- Attention: the default path runs SDPA per prefill span (its keys and tiling follow the span) and a
  batched masked SDPA for decodes (its key length follows the batch's longest context). Here every query
  token, decode or prefill, attends over the paged cache in splits of KV_SPLIT keys, each split a fixed-shape
  matmul, the splits combined one after the other in key order; a padded split is an exact no-op.
- Elementwise ops whose vectorized and scalar forms differ (SiLU on x86: the vector body and the
  remainder of a loop round differently, and which elements land in the remainder follows the tensor's
  size): SiLU is written as x / (1 + exp(-x)), whose every step rounds the same in both forms.
RMSNorm (a row's sum over its own columns), rotary (elementwise) and log-softmax (per row) are per-row
already; the tests check them too.
Sparse (mixture-of-experts) layers: the router's logits and each expert's rows (the tokens the batch sent
it, a count that follows the batch) go through the same fixed-row matmul; a token's softmax and top-k are
its own row's, and its experts' outputs are added in expert order.
"""
from __future__ import annotations

import torch

from server.model.attention import AttentionContext
from server.model.moe import moe_torch
from server.model.ops import TorchOps, norm_then_gate_up_act, norm_then_qkv, split_qkv

# Rows of every GEMM call: 16 rows cost the CPU about what 1 row does (the weights' reads dominate) and
# keep a 512-token prefill to 32 calls per matmul.
GEMM_ROWS = 16
# Keys per attention split (at least one KV block): the split's scores are one [group, D] x [D, KV_SPLIT]
# matmul per token and KV head.
KV_SPLIT = 64


def fixed_rows_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N], computed GEMM_ROWS rows at a time, the last block
    zero-padded: row i's result depends on row i only (and on nothing of M)."""
    x = x.contiguous()
    M, N = x.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    wt = weight.t()
    full = M - M % GEMM_ROWS
    for lo in range(0, full, GEMM_ROWS):
        torch.mm(x[lo:lo + GEMM_ROWS], wt, out=out[lo:lo + GEMM_ROWS])
    if full < M:
        block = x.new_zeros((GEMM_ROWS, x.shape[1]))
        block[:M - full] = x[full:]
        out[full:] = torch.mm(block, wt)[:M - full]
    if bias is not None:
        out += bias
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), as exp, add and divide: each rounds identically in a vector body and its remainder
    (torch's fused silu does not on x86, so an element's result followed its place in the tensor)."""
    return x / (1 + torch.exp(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), for the reason silu is written out."""
    return 1 / (1 + torch.exp(-x))


def token_layout(ctx: AttentionContext, num_tokens: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query token's block table and context length (its position + 1), decodes first then each
    prefill span's tokens: ([T, W] int64 block ids, NULL_BLOCK-padded, W a multiple of `multiple`; [T] lengths).
    Sizes come from the host's shapes (no device sync); built once per step and kept on the context."""
    cached = getattr(ctx, "_token_layout", None)
    if cached is not None:
        return cached
    nd = ctx.num_decode_tokens
    device = ctx.slot_mapping.device
    lens = [ctx.context_lens[:nd].long()]
    tables = [ctx.block_tables[:nd].long()]
    for span in ctx.prefills:
        first = span.context_len - span.q_len + 1
        lens.append(torch.arange(first, span.context_len + 1, device=device))
        tables.append(span.block_table.long().reshape(1, -1).expand(span.q_len, -1))
    width = max([t.shape[1] for t in tables if t.shape[0]], default=1)
    width = -(-width // multiple) * multiple
    table = torch.zeros((num_tokens, width), dtype=torch.long, device=device)  # NULL_BLOCK pads
    at = 0
    for t in tables:
        table[at:at + t.shape[0], :t.shape[1]] = t
        at += t.shape[0]
    layout = (table, torch.cat(lens))
    ctx._token_layout = layout  # type: ignore[attr-defined]
    return layout


def split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float, split: int = KV_SPLIT) -> torch.Tensor:
    """q [T, H, D]; token t attends to the first lens[t] keys of its table [T, W], in splits of `split`
    keys taken in order: each split's scores and weighted values are fixed-shape matmuls, and the splits
    fold into a running max, sum and output (online softmax). A token skips the splits past its context,
    so its arithmetic is the same whatever else the step holds."""
    T, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    per_split = split // bs
    qg = q.reshape(T, KVH, G, D).float()
    m = torch.full((T, KVH, G), float("-inf"), device=q.device)
    l = torch.zeros((T, KVH, G), device=q.device)
    acc = torch.zeros((T, KVH, G, D), device=q.device)
    offsets = torch.arange(split, device=q.device)
    nsplits = -(-int(lens.max()) // split) if T else 0
    for j in range(nsplits):
        rows = torch.nonzero(lens > j * split).squeeze(1)  # the tokens whose context reaches this split
        blocks = tables[rows, j * per_split:(j + 1) * per_split]
        n = rows.shape[0]
        k = k_cache[blocks].reshape(n, split, KVH, D).float()
        v = v_cache[blocks].reshape(n, split, KVH, D).float()
        valid = (j * split + offsets)[None, :] < lens[rows][:, None]                # [n, split]
        # unwritten slots may hold anything (NaN included): masked by select, never by arithmetic
        # Contiguous operands: a BLAS call's layout (transposed or not) follows the strides, which a
        # permuted view of one token has other than a permuted view of many.
        v = torch.where(valid[:, :, None, None], v, 0.0).permute(0, 2, 1, 3).contiguous()  # [n, KVH, split, D]
        s = torch.matmul(qg[rows], k.permute(0, 2, 3, 1).contiguous()) * scale        # [n, KVH, G, split]
        s = torch.where(valid[:, None, None, :], s, float("-inf"))
        m_j = s.amax(-1)
        p = torch.exp(s - m_j[..., None])
        l_j, acc_j = p.sum(-1), torch.matmul(p, v)
        m_old = m[rows]
        m_new = torch.maximum(m_old, m_j)
        alpha, beta = torch.exp(m_old - m_new), torch.exp(m_j - m_new)
        m[rows] = m_new
        l[rows] = l[rows] * alpha + l_j * beta
        acc[rows] = acc[rows] * alpha[..., None] + acc_j * beta[..., None]
    return (acc / l[..., None]).reshape(T, H, D).to(q.dtype)


def attend_per_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, ctx: AttentionContext, scale: float) -> torch.Tensor:
    """attention.attend's contract (the new K/V are in the cache already), every token read back from the cache."""
    split = max(KV_SPLIT, k_cache.shape[1])
    tables, lens = token_layout(ctx, q.shape[0], split // k_cache.shape[1])
    return split_attention(q, k_cache, v_cache, tables, lens, scale, split)


class InvariantProjections:
    """The projections of a batch-invariant ops set, each one call of `cls.matmul`, a matmul whose rows never
    depend on how many there are: the CPU ops (fixed_rows_mm) and the CUDA ops (fixed_tile_matmul) share them.
    Mixed in before the ops set it changes (TorchOps, TritonOps), whose silu_mul_packed and kernels it uses."""

    batch_invariant = True
    matmul = staticmethod(fixed_rows_mm)

    @classmethod
    def qkv(cls, attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One GEMM over the q|k|v weights side by side (the loader lays them out so): a third of the calls."""
        return split_qkv(attn, cls.matmul(x, attn.qkv_weight, attn.qkv_bias))

    @classmethod
    def gate_up_act(cls, mlp, x: torch.Tensor) -> torch.Tensor:
        return cls.silu_mul_packed(cls.matmul(x, mlp.gate_up_weight, mlp.gate_up_bias))

    @classmethod
    def norm_qkv(cls, attn, norm, x: torch.Tensor, residual: torch.Tensor | None):
        return norm_then_qkv(cls, attn, norm, x, residual)

    @classmethod
    def norm_gate_up_act(cls, mlp, norm, x: torch.Tensor, residual: torch.Tensor):
        return norm_then_gate_up_act(cls, mlp, norm, x, residual)

    @classmethod
    def linear(cls, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return cls.matmul(x, module.weight, module.bias)

    linear_to_norm = linear  # ops.py; BatchInvariantTritonOps defers its split sums to the norm

    @classmethod
    def lm_head(cls, hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return cls.matmul(hidden, weight, None, out)

    @classmethod
    def project(cls, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A router's logits, a shared expert's down and gate (moe.py)."""
        return cls.matmul(x, weight)


class BatchInvariantTorchOps(InvariantProjections, TorchOps):
    """TorchOps with every reduction's order fixed independently of the batch (the CPU path of the mode)."""

    name = "torch-batch-invariant"

    @staticmethod
    def silu_mul_packed(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return silu(gate) * up

    attend = staticmethod(attend_per_token)
    sigmoid = staticmethod(sigmoid)

    @classmethod
    def moe(cls, x: torch.Tensor, block) -> torch.Tensor:
        """Hugging Face's sparse layer with this set's matmul and SiLU: an expert's rows are the tokens the
        batch sent it, and each row's bits are its own (fixed_rows_mm); a token's experts are added in id order."""
        return moe_torch(x, block, cls.project, cls.silu_mul_packed)


def ordered_all_reduce(comm, x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks as rank 0 + rank 1 + ... in that order, on every rank: an all-gather, then a
    sum whose order does not follow the message's size (a ring or tree all-reduce splits the message in
    chunks whose reduction order does). Written into x."""
    parts = comm.all_gather(x)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    x.copy_(total)
    return x
