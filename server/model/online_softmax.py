"""FlashAttention's online softmax over one tile of keys: the step the decode and prefill kernels share."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(q, k, v, m, l, acc, scale, tok, pos, MASKED: tl.constexpr, BASE2: tl.constexpr,
                        IEEE: tl.constexpr):
    """One key tile (k, v) into each query row's running max `m`, sum `l` and output `acc`. MASKED: key tok[j]
    is seen only by the rows at positions pos >= tok[j] (causal). BASE2: `scale` carries log2(e) and the
    exponentials are base 2. IEEE: fp32 dots in full precision."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if MASKED:
        s = tl.where(tok[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    if BASE2:
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
    else:
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc
