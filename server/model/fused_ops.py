"""Fused kernels for CUDA: residual add + RMSNorm, rotary + KV-cache write, SiLU * up, and one GEMM
for q/k/v and one for gate/up (over weights the loader lays out side by side). For a few rows (a small
decode batch) the norm, the matmul and SiLU × up are one small_gemm launch each (small_gemm.py), chained
with the rotary and attention kernels by programmatic dependent launch.

Each replaces several PyTorch kernels (TorchOps in ops.py is the reference). Arithmetic is done in
fp32 and rounded once; the residual sum is rounded to the model dtype before the norm reads it,
as in Hugging Face's layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from server.model.decode_kernel import triton_decode_attention
from server.model.prefill_kernel import triton_prefill_attention
from server.model.kv_layout import check_kernel_views
from server.model.launch import chain_in, gdc_launch
from server.model.fused_moe import moe as fused_moe
from server.model.ops import heads_then_rope, norm_then_gate_up_act, norm_then_qkv, split_qkv
from server.model.small_gemm import chained, small_gemm, small_rows


@triton.jit
def _add_rmsnorm(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, n_cols, eps,
                 HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    chain_in(GDC)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    _add_rmsnorm_row(x, r_ptr + row * n_cols, w_ptr, out_ptr + row * n_cols, rout_ptr + row * n_cols, cols, mask,
                     n_cols, eps, HAS_RESIDUAL)


@triton.jit
def _add_rmsnorm_row(x, r_row, w_ptr, out_row, rout_row, cols, mask, n_cols, eps, HAS_RESIDUAL: tl.constexpr):
    """One row x (the model's dtype, at columns cols of the rows r_row, out_row, rout_row point to): x + residual
    rounded (written to rout), then its mean square, the normed row rounded, times w, to out. _add_rmsnorm's body,
    and the batch-invariant mode's after its split sum (batch_invariant_kernels._sum_add_rmsnorm): one arithmetic."""
    if HAS_RESIDUAL:
        x = x + tl.load(r_row + cols, mask=mask, other=0.0)
        tl.store(rout_row + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    normed = (h * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_row + cols, w * normed, mask=mask)


@triton.jit
def _head_rmsnorm(a, b, w_ptr, d, eps, HALF: tl.constexpr, dtype: tl.constexpr):
    """Qwen3's RMSNorm of each head, a row of a | b (its two halves, fp32 from the model's dtype), rounded as
    _add_rmsnorm rounds a row: the normed value in the model's dtype, times the weight in it; back in fp32."""
    inv = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
    wa = tl.load(w_ptr + d)[None, :]
    wb = tl.load(w_ptr + HALF + d)[None, :]
    return ((wa * (a * inv[:, None]).to(dtype)).to(tl.float32),
            (wb * (b * inv[:, None]).to(dtype)).to(tl.float32))


@triton.jit
def _rotate_heads(a, b, a_ptr, ok, c1, c2, s1, s2, w_ptr, eps, d, HALF: tl.constexpr, QK_NORM: tl.constexpr):
    """A token's heads, a | b [heads, HALF] each in fp32 (from the model's dtype, a_ptr's): each head RMS-normed
    first where QK_NORM (weights w), rotated, rounded and stored at a_ptr (b at a_ptr + HALF) where `ok`;
    returns the two rotated halves in the model's dtype."""
    dtype = a_ptr.dtype.element_ty
    if QK_NORM:
        a, b = _head_rmsnorm(a, b, w_ptr, d, eps, HALF, dtype)
    ra = (a * c1[None, :] - b * s1[None, :]).to(dtype)
    rb = (b * c2[None, :] + a * s2[None, :]).to(dtype)
    tl.store(a_ptr, ra, mask=ok)
    tl.store(a_ptr + HALF, rb, mask=ok)
    return ra, rb


@triton.jit
def _cos_sin(cos_row, sin_row, d, HALF: tl.constexpr):
    """A token's rotation, fp32: (cos of the first half, of the second, sin of the first, of the second)."""
    return (tl.load(cos_row + d).to(tl.float32), tl.load(cos_row + HALF + d).to(tl.float32),
            tl.load(sin_row + d).to(tl.float32), tl.load(sin_row + HALF + d).to(tl.float32))


@triton.jit
def _cache_row(kc_ptr, vc_ptr, slot_ptr, ka, kb, va, vb, h, d, ok, stride_cb, stride_cs, stride_ch,
               HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """A token's k (ka | kb) and v (va | vb) heads written to the caches at its slot. The caches are strided views of
    the block-major cache (kv_layout.py): the slot's block times the block stride (which spans every layer; 64-bit),
    plus its offset in the block."""
    slot = tl.load(slot_ptr).to(tl.int64)
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(kc_ptr + row, ka, mask=ok)
    tl.store(kc_ptr + row + HALF, kb, mask=ok)
    tl.store(vc_ptr + row, va, mask=ok)
    tl.store(vc_ptr + row + HALF, vb, mask=ok)


@triton.jit
def _rope_and_cache(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr, q_eps, k_eps,
                    n_heads, n_kv_heads, stride_qt, stride_kt, stride_vt, stride_ct,
                    stride_cb, stride_cs, stride_ch,
                    HALF: tl.constexpr, HEADS_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr,
                    GDC: tl.constexpr):
    """Program t: token t's q and k heads rotated in place (QK_NORM: each head RMS-normed first, Qwen3's
    q_norm and k_norm, weights qw and kw), its rotated k and its v written to the cache at its slot."""
    chain_in(GDC)
    t = tl.program_id(0)
    d = tl.arange(0, HALF)
    h = tl.arange(0, HEADS_P2)
    c1, c2, s1, s2 = _cos_sin(cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, d, HALF)
    qm = (h < n_heads)[:, None]
    qa_ptr = q_ptr + t * stride_qt + h[:, None] * (2 * HALF) + d[None, :]
    qa = tl.load(qa_ptr, mask=qm, other=0.0).to(tl.float32)
    qb = tl.load(qa_ptr + HALF, mask=qm, other=0.0).to(tl.float32)
    _rotate_heads(qa, qb, qa_ptr, qm, c1, c2, s1, s2, qw_ptr, q_eps, d, HALF, QK_NORM)
    km = (h < n_kv_heads)[:, None]
    ka_ptr = k_ptr + t * stride_kt + h[:, None] * (2 * HALF) + d[None, :]
    ka = tl.load(ka_ptr, mask=km, other=0.0).to(tl.float32)
    kb = tl.load(ka_ptr + HALF, mask=km, other=0.0).to(tl.float32)
    ra, rb = _rotate_heads(ka, kb, ka_ptr, km, c1, c2, s1, s2, kw_ptr, k_eps, d, HALF, QK_NORM)
    va_ptr = v_ptr + t * stride_vt + h[:, None] * (2 * HALF) + d[None, :]
    _cache_row(kc_ptr, vc_ptr, slot_ptr + t, ra, rb, tl.load(va_ptr, mask=km, other=0.0),
               tl.load(va_ptr + HALF, mask=km, other=0.0), h, d, km, stride_cb, stride_cs, stride_ch, HALF, BLOCK_SIZE)


@triton.jit
def _silu_mul_packed(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, GDC: tl.constexpr):
    chain_in(GDC)
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < inter
    g = tl.load(gu_ptr + row * 2 * inter + i, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + i, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out_ptr + row * inter + i, silu * u, mask=mask)


class TritonOps:
    """The CUDA path's kernels, fused where a step gains (TorchOps, ops.py, is the reference they match)."""
    name = "triton"
    batch_invariant = False

    @staticmethod
    def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float, gdc: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """gdc: chained by dependent launch (launch.py; default: as a few rows' chain is, small_gemm.chained)."""
        if gdc is None:
            gdc = chained(x)
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty_like(x)
        rout = torch.empty_like(x) if residual is not None else x
        if rows:
            _add_rmsnorm[(rows,)](x, residual if residual is not None else x, weight, out, rout, cols, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
                                  num_warps=4 if cols <= 4096 else 8, **gdc_launch(gdc))
        return out, rout

    @staticmethod
    def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, norms=None,
                       gdc: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch: Qwen3's per-head norms (norms: q_norm, k_norm) in it too, where a separate norm launch
        each cost a step two more of a layer's chained kernels. gdc: chained by dependent launch (default: as a
        few rows' chain is, small_gemm.chained)."""
        T, H, D = q.shape
        KVH = k.shape[1]
        check_kernel_views(k_cache, v_cache)
        if T:
            qw, kw, q_eps, k_eps = ((norms[0].weight, norms[1].weight, norms[0].eps, norms[1].eps)
                                    if norms is not None else (cos, cos, 0.0, 0.0))
            _rope_and_cache[(T,)](q, k, v, cos, sin, k_cache, v_cache, slots, qw, kw, q_eps, k_eps, H, KVH,
                                  q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
                                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                  HALF=D // 2, HEADS_P2=triton.next_power_of_2(max(H, KVH)),
                                  BLOCK_SIZE=k_cache.shape[1], QK_NORM=norms is not None, num_warps=4,
                                  **gdc_launch(chained(q) if gdc is None else gdc))
        return q, k

    @staticmethod
    def qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One GEMM over the q|k|v weights (laid out contiguously by the loader), split by views."""
        return split_qkv(attn, F.linear(x, attn.qkv_weight, attn.qkv_bias))

    @staticmethod
    def norm_qkv(attn, norm, x: torch.Tensor, residual: torch.Tensor | None):
        """The layer's input norm and q|k|v: one small_gemm launch for a few rows."""
        if not small_rows(x):
            return norm_then_qkv(TritonOps, attn, norm, x, residual)
        out, rsum = small_gemm(x, attn.qkv_weight, attn.qkv_bias, residual=residual, norm_weight=norm.weight,
                               eps=norm.eps, gdc=chained(x))
        return split_qkv(attn, out), x if rsum is None else rsum

    @staticmethod
    def qkv_heads(attn, qkv, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor):
        """ops.py; rotary, Qwen3's head norms and the cache write in one launch (rope_and_cache)."""
        return heads_then_rope(TritonOps, attn, qkv, cos, sin, slots)

    @staticmethod
    def gate_up_act(mlp, x: torch.Tensor) -> torch.Tensor:
        return TritonOps.silu_mul_packed(F.linear(x, mlp.gate_up_weight, mlp.gate_up_bias))

    @staticmethod
    def norm_gate_up_act(mlp, norm, x: torch.Tensor, residual: torch.Tensor):
        """The post-attention norm, gate|up and SiLU × up: one small_gemm launch for a few rows."""
        if not small_rows(x):
            return norm_then_gate_up_act(TritonOps, mlp, norm, x, residual)
        return small_gemm(x, mlp.gate_up_weight, mlp.gate_up_bias, residual=residual, norm_weight=norm.weight,
                          eps=norm.eps, silu=True, gdc=chained(x))

    @staticmethod
    def linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """o_proj and down_proj (one device)."""
        if not small_rows(x):
            return module(x)
        return small_gemm(x, module.weight, module.bias, gdc=chained(x))[0]

    linear_to_norm = linear  # ops.py

    project = staticmethod(F.linear)  # a router, a shared expert's down and gate (ops.py)
    sigmoid = staticmethod(torch.sigmoid)

    @staticmethod
    def lm_head(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if not small_rows(hidden):
            return torch.mm(hidden, weight.t(), out=out)
        return small_gemm(hidden, weight, out=out, gdc=chained(hidden))[0]

    @staticmethod
    def silu_mul_packed(gate_up: torch.Tensor, gdc: bool = False) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        BLOCK = 1024
        if rows:
            _silu_mul_packed[(rows, triton.cdiv(inter, BLOCK))](gate_up, out, inter, BLOCK=BLOCK, num_warps=4,
                                                                **gdc_launch(gdc))
        return out

    @staticmethod
    def decode_attention(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return triton_decode_attention(q, *args, **kwargs, gdc=chained(q))

    prefill_attention = staticmethod(triton_prefill_attention)  # every span of the step in one launch
    # The sparse MLP (fused_moe.py): routing and grouping in one to four kernels, the experts in three; no host sync.
    moe = staticmethod(fused_moe)
