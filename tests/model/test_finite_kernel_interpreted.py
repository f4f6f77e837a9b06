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


PACKED = r"""
import torch
from server.model.finite import FiniteCheck
from server.weight_transfer.protocol import TensorMeta, pack_into, view_at
from server.weight_transfer.unchecked_copy import UncheckedCopy

per = 2048 * 4
# A packed bucket as a sender writes it: bf16, fp16 and fp32 tensors of whole 16 bytes (read in place by the
# kernel; the first one's last program masked), a tensor the receiver does not hold (skipped), one whose target
# has another shape (copied as copy_ would), one of float64 (not the kernel's), then an odd bf16 count, an fp32
# after it misaligned even for a view (copied from a copy) and a bf16 one off 16 bytes (copied from its view).
specs = [("a", torch.bfloat16, (per + 40,)), ("b", torch.float32, (3, 4)), ("c", torch.bfloat16, (64, 8)),
         ("skipped", torch.bfloat16, (8,)), ("d", torch.float16, (per,)), ("wide", torch.float32, (4, 1)),
         ("f64", torch.float64, (2,)), ("e", torch.float32, (12,)), ("odd", torch.bfloat16, (3,)),
         ("misaligned", torch.float32, (7,)), ("g", torch.bfloat16, (5,))]
sources = {name: (torch.randn(shape) * 10).to(dtype) for name, dtype, shape in specs}
metas = [TensorMeta(name, dtype, shape) for name, dtype, shape in specs]
bucket = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8)
pack_into(bucket, [sources[m.name] for m in metas])
def targets():
    out = {name: torch.full(shape, 7, dtype=dtype) for name, dtype, shape in specs if name != "skipped"}
    out["wide"] = torch.full((4, 3), 7.0)  # broadcast from (4, 1), as copy_ does
    return out

want = targets()
assert sorted(UncheckedCopy().copy_packed(bucket, metas, want, view_at)) == sorted(want)
for enabled in (True, False):
    for bad in (None, "a", "misaligned", "d", "e", "g"):
        src = {k: v.clone() for k, v in sources.items()}
        if bad:
            src[bad].view(-1)[-1] = float("nan")
        pack_into(bucket, [src[m.name] for m in metas])
        expect = targets()
        UncheckedCopy().copy_packed(bucket, metas, expect, view_at)
        got, check = targets(), FiniteCheck(enabled)
        names = check.copy_packed(bucket, metas, got, view_at, fuse=True)
        assert sorted(names) == sorted(got), names
        for name in got:
            same = (got[name] == expect[name]) | (got[name].isnan() & expect[name].isnan())
            assert same.all(), (enabled, bad, name)
        assert check.bad() == ([bad] if enabled and bad else []), (enabled, bad)
print("ok")
"""


def test_packed_bucket_copies_in_place_as_views_would_in_interpreter():
    """FiniteCheck's copy of a packed bucket by addresses (a received IPC bucket's path on CUDA) writes what
    the views' copies write, checked or not, and flags exactly the bad tensor: a kernel-read one, a misaligned
    one copied from its view, or one in another dtype's launch."""
    assert "ok" in run_interpreted(PACKED)


@pytest.mark.parametrize("dtype,steps,check", [("bf16", 4, True), ("bf16", 16, True), ("fp16", 4, True),
                                               ("fp32", 16, True), ("bf16", 4, False), ("fp32", 16, False)])
def test_copy_and_flag_compiles_for_sm90_without_a_gpu(dtype, steps, check):
    """The addresses loaded from the table and cast to typed pointers, the binary search and the flag's store
    through the compiler to an sm_90 cubin (the interpreter takes an address for a pointer without asking), the
    copy in 16-byte loads and stores (without the alignment hint and the unmasked path it compiled to 2 bytes).
    Without the check (a server that turned it off): the same copy, and no compare or flag store left."""
    import triton.language as tl

    from server.model.finite import COPY_BLOCK, COPY_ITERS
    from server.model.finite_kernel import copy_and_flag_kernel
    from tests.interpreter import compile_for_sm90

    kernel = compile_for_sm90(copy_and_flag_kernel, {"table": "*i64", "n_tensors": "i32"},
                              dict(DTYPE={"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype],
                                   BLOCK=COPY_BLOCK, ITERS=COPY_ITERS, SEARCH_STEPS=steps, CHECK=check))
    ptx = kernel.asm["ptx"]  # the unmasked programs' copy: 16 bytes a thread, as a plain copy_ moves them
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "the copy is not vectorized"
    # The flag: a program's max over its lanes (a warp reduction, then across warps through shared memory).
    assert (("redux.sync.max" in ptx or "shfl.sync" in ptx) and "bar.sync" in ptx) == check
