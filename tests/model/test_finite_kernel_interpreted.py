"""The fused copy-and-check kernel of model/finite.py under Triton's CPU interpreter: one launch copies every
element of several tensors and flags exactly those holding NaN, +Inf or -Inf wherever it sits (first, last,
past a program's blocks, in a tensor smaller than one program), in each dtype, and among 260 tensors."""
from __future__ import annotations

import pytest

from tests.interpreter import run_interpreted

pytest.importorskip("triton")

CHECK = r"""
import torch
from server.model import finite

per = finite.COPY_BLOCK * finite.COPY_ITERS

def flagged(sources):
    group = [(str(i), torch.full_like(s, 7), s) for i, s in enumerate(sources)]
    flags = finite.copy_and_flag(group, torch.zeros(len(group), dtype=torch.int32))
    for _, d, s in group:
        assert ((d == s) | (d.isnan() & s.isnan())).all(), "the copy lost bytes"
    return flags.tolist()

# Sizes: two programs with the second masked, one program's worth exactly, less than a block, one element.
sizes = (per + 37, per, 100, 1)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    good = [(torch.randn(n) * 100).to(dtype) for n in sizes]
    assert flagged(good) == [0] * len(sizes), dtype
    assert flagged(good[:1]) == [0], dtype
    for k, n in enumerate(sizes):
        for at in sorted({0, n // 2, n - 1}):
            for value in (float("nan"), float("inf"), float("-inf")):
                bad = [t.clone() for t in good]
                bad[k][at] = value
                assert flagged(bad) == [int(i == k) for i in range(len(sizes))], (dtype, k, at, value)
    big = [torch.full((n,), torch.finfo(dtype).max, dtype=dtype) for n in sizes]  # the largest finite value
    assert flagged(big) == [0] * len(sizes), dtype
# 260 small tensors in one launch: the binary search's longest variant (more than 256 tensors).
many = [torch.randn(int(n)) for n in torch.randint(1, 50, (260,))]
for k in (0, 137, 259):
    many[k][-1] = float("nan")
assert flagged(many) == [int(i in (0, 137, 259)) for i in range(260)]
print("ok")
"""


def test_copy_and_flag_copies_and_flags_in_interpreter():
    assert "ok" in run_interpreted(CHECK)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("steps", [4, 16])
def test_copy_and_flag_compiles_for_sm90_without_a_gpu(dtype, steps):
    """The addresses loaded from the table and cast to typed pointers, the binary search and the flag's store
    through the compiler to an sm_90 cubin (the interpreter takes an address for a pointer without asking), the
    copy in 16-byte loads and stores (without the alignment hint and the unmasked path it compiled to 2 bytes)."""
    import triton.language as tl

    from server.model.finite import COPY_BLOCK, COPY_ITERS
    from server.model.finite_kernel import copy_and_flag_kernel
    from tests.interpreter import compile_for_sm90

    kernel = compile_for_sm90(copy_and_flag_kernel, {"table": "*i64", "n_tensors": "i32"},
                              dict(DTYPE={"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype],
                                   BLOCK=COPY_BLOCK, ITERS=COPY_ITERS, SEARCH_STEPS=steps))
    ptx = kernel.asm["ptx"]  # the unmasked programs' copy: 16 bytes a thread, as a plain copy_ moves them
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "the copy is not vectorized"
