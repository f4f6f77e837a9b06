"""Weights that are not numbers are never served: every tensor an update writes is checked on the device.

A trainer's diverged step sends NaN or Inf; served, it gives empty texts and NaN log-probs with
`weights_valid: true`. Each landed tensor gets one reduction, queued on the device after the copy:
its minimum and maximum in one pass (torch.aminmax), which are finite exactly when every element is
(NaN propagates through both, +Inf is the maximum, -Inf the minimum). Exact, in the tensor's own dtype
(a sum could overflow on finite values), and with no temporary the size of the tensor, as
`isfinite(t).all()` would make (a 0.5 GiB bool mask for an 8B model's embedding); on the CPU it runs
at twice a float32 sum's time where a float64 sum took 20x. The results stay on the device until
`bad`, which reads them all in one host sync, once, before the update is declared complete
(bench/finite_check.py measures the cost).

Where an update copies tensors device to device (an IPC or staged NCCL receive), `copy_many` does the copies
and the check in one pass (a Triton kernel that flags NaN/Inf while it copies), one launch for a received
bucket's tensors of a dtype: the check reads nothing the copy does not. Run as a second pass after an 8B IPC
push it was 18-23% of the push (12 ms of ~65); fused but launched per tensor, 11.6% (the host's launches). The
kernel's flags live in pinned host memory the device writes through its mapping (HostFlags), so the verdicts are
read once the device is done, with no device work of their own: read from a device buffer (a compare, a concat and
a copy back, each bucket) they were 1.9 ms of the 4.6 the check added to the 8B push (H200, 2026-12-06).
A received IPC bucket is copied by address (copy_packed): the kernel reads each tensor where it lies in the
bucket, with no view made of it, and a server with the check off launches the same kernel without the check.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from server.wire.errors import NonFiniteWeightsError

__all__ = ["FiniteCheck", "NonFiniteWeightsError", "nonfinite_message"]


def nonfinite_message(names: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"the update holds NaN or Inf in {shown}; nothing is served from these weights: they are invalid "
            "(503 weights_invalid) until a good update (a diverged training step? check the trainer's loss)")


class FiniteCheck:
    """Collects one device-side verdict per landed tensor; `bad` syncs once and names the bad ones.

    A disabled check copies and checks nothing: the receives always copy through one (no branch there)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        # Per dtype (torch.stack wants one): the names, and each one's minimum and maximum in turn.
        self._groups: dict[torch.dtype, tuple[list[str], list[torch.Tensor]]] = {}
        # Tensors checked while copied: their names, the device, and the int32 flags they set (nonzero: not
        # finite), in HOST_FLAGS.
        self._flagged: list[tuple[list[str], torch.device, torch.Tensor]] = []

    @torch.no_grad()
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """After `tensor` landed, in its stream's order (the current stream: where the copy was queued)."""
        if self.enabled and tensor.numel():
            names, values = self._groups.setdefault(tensor.dtype, ([], []))
            names.append(name)
            values.extend(torch.aminmax(tensor.detach()))

    def copy(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copy_many([(name, dst, src)])

    @torch.no_grad()
    def copy_many(self, triples: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """dst.copy_(src) for each (name, dst, src), and the check of what landed. On CUDA, the tensors of one
        16- or 32-bit float dtype (contiguous, same shape, same device) are copied and checked by one launch:
        a received bucket's ~20 tensors cost one launch, not ~20 (the host's launches, not the device's
        bytes, were the check's cost on the 8B IPC push). Any other pair: the copy, then `add`."""
        fused: dict[tuple[torch.dtype, torch.device], list[tuple[str, int, int, int]]] = {}
        for name, dst, src in triples:
            if self.enabled and _fusable(dst, src):
                fused.setdefault((dst.dtype, dst.device), []).append((name, src.data_ptr(), dst.data_ptr(),
                                                                      dst.numel()))
            else:
                dst.copy_(src, non_blocking=True)
                self.add(name, dst)
        for (dtype, device), entries in fused.items():
            self._launch(entries, dtype, device)

    @torch.no_grad()
    def copy_packed(self, bucket: torch.Tensor, metas, targets: dict[str, torch.Tensor], view,
                    fuse: bool | None = None) -> list[str]:
        """The tensors a packed uint8 bucket carries (metas: name, dtype, shape, nbytes, back to back) copied into
        targets[name] (the names not in targets skipped) and checked; returns the names written. view(bucket,
        offset, meta): a tensor's view (the receive's protocol.view_at; the model does not import it). On CUDA
        (fuse: whether to, by default where the bucket is) the copy kernel reads the bucket at each tensor's
        address: no view is made of it (unpack's views, ~10 us of host time each, made a received 8B bucket's
        kernel start ~0.2 ms after the plain copies would have). A disabled check launches the same kernel
        without the check, so the two differ by the check alone. Any other tensor: its view, through copy_many."""
        fuse = bucket.is_cuda if fuse is None else fuse
        base, offset = bucket.data_ptr(), 0
        fused: dict[torch.dtype, list[tuple[str, int, int, int]]] = {}
        others = []
        for m in metas:
            dst = targets.get(m.name)
            src = base + offset
            if dst is not None:
                if fuse and dst.device == bucket.device and _fits_kernel(dst, m.dtype, m.shape, src):
                    fused.setdefault(m.dtype, []).append((m.name, src, dst.data_ptr(), dst.numel()))
                else:
                    others.append((m.name, dst, view(bucket, offset, m)))
            offset += m.nbytes
        for dtype, entries in fused.items():
            self._launch(entries, dtype, bucket.device)
        self.copy_many(others)
        return [name for entries in fused.values() for name, _, _, _ in entries] + [name for name, _, _ in others]

    def _launch(self, entries: list[tuple[str, int, int, int]], dtype: torch.dtype, device: torch.device) -> None:
        """launch_copy of (name, source address, destination address, elements) entries of one dtype and device,
        MAX_TENSORS_PER_LAUNCH a launch; checked (flags from HOST_FLAGS, read by `bad`) when the check is on."""
        for i in range(0, len(entries), MAX_TENSORS_PER_LAUNCH):
            group = entries[i:i + MAX_TENSORS_PER_LAUNCH]
            flags = HOST_FLAGS.take(len(group)) if self.enabled else None
            launch_copy(group, dtype, device, flags)
            if flags is not None:
                self._flagged.append(([name for name, _, _, _ in group], device, flags))

    def bad(self) -> list[str]:
        """The names whose tensors hold NaN or Inf: one device->host read for all of them."""
        names, verdicts = [], []
        for group, values in self._groups.values():
            names += group
            verdicts.append(~torch.isfinite(torch.stack(values)).view(-1, 2).all(1))
        bad = []
        if verdicts:  # One read: the verdicts are on the model's device (a tensor elsewhere is moved there first).
            device = verdicts[0].device
            bad = [n for n, b in zip(names, torch.cat([v.to(device) for v in verdicts]).tolist()) if b]
        for device in {device for _, device, _ in self._flagged if device.type == "cuda"}:
            torch.cuda.synchronize(device)  # the kernels' stores to host memory are there once they finished
        for group, _, flags in self._flagged:
            bad += [n for n, flag in zip(group, flags.tolist()) if flag]
        self._groups, self._flagged = {}, []
        return bad

    def verify(self) -> None:
        bad = self.bad()
        if bad:
            raise NonFiniteWeightsError(nonfinite_message(bad), tuple(bad))


FLAGGED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class HostFlags:
    """int32 flags in pinned host memory, which the copy kernel writes through the device's mapping of it (one
    address for host and device: unified addressing); the host reads them once the device has finished.

    A ring, allocated once and never freed: a kernel still running when its check was dropped (a receive that
    failed half-way) writes into memory that is still the ring's, never into memory since given to something
    else. Slots are taken in turn and zeroed when taken; a late write lands in a slot taken again only after
    SIZE more tensors, and would then flag a finite tensor (a refused update), never pass a bad one."""

    SIZE = 1 << 17

    def __init__(self):
        self._lock = threading.Lock()
        self._ring: torch.Tensor | None = None
        self._next = 0

    def take(self, n: int) -> torch.Tensor:
        """n zeroed flags (n <= SIZE). Normal tensors wherever taken: the ring may be made, and slices taken,
        under inference mode (start-up's warm_up), and zeroed outside it (a receive)."""
        with self._lock, torch.inference_mode(False):
            if self._ring is None:
                # Pinned where a device writes it; plain memory on a host without one (the interpreter's tests).
                self._ring = torch.zeros(self.SIZE, dtype=torch.int32, pin_memory=torch.cuda.is_available())
            if self._next + n > self.SIZE:
                self._next = 0
            flags = self._ring[self._next:self._next + n]
            self._next += n
            return flags.zero_()


HOST_FLAGS = HostFlags()


def _fusable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copied and checked by the kernel: one CUDA device, src contiguous, and _fits_kernel."""
    return (dst.is_cuda and src.device == dst.device and src.is_contiguous()
            and _fits_kernel(dst, src.dtype, src.shape, src.data_ptr()))


def _fits_kernel(dst: torch.Tensor, dtype: torch.dtype, shape, src_ptr: int) -> bool:
    """Whether the kernel can copy a source of this dtype and shape at src_ptr into dst: a float dtype, dst's,
    dst's shape, dst contiguous and not empty, both addresses 16-byte aligned (the kernel's 16-byte loads
    assume it; a packed bucket's tensors are, when their sizes are whole 16 bytes)."""
    return (dst.dtype == dtype and dtype in FLAGGED_DTYPES and tuple(dst.shape) == tuple(shape)
            and dst.is_contiguous() and dst.numel() > 0 and src_ptr % 16 == 0 and dst.data_ptr() % 16 == 0)


def copy_and_flag(group: list[tuple[str, torch.Tensor, torch.Tensor]],
                  flags: torch.Tensor | None) -> torch.Tensor | None:
    """Queue dst <- src for every (name, dst, src) of one dtype and device on the current stream, in one launch;
    flags[i] (zeroed int32, on that device or in host memory it can write: HostFlags) becomes nonzero if the i-th
    source held NaN or Inf (without flags: the copy alone). Returns flags."""
    entries = [(name, src.data_ptr(), dst.data_ptr(), dst.numel()) for name, dst, src in group]
    launch_copy(entries, group[0][1].dtype, group[0][1].device, flags)
    return flags


def launch_copy(entries: list[tuple[str, int, int, int]], dtype: torch.dtype, device: torch.device,
                flags: torch.Tensor | None) -> None:
    """Queue, in one launch on the current stream, the copy of each (name, source address, destination address,
    elements) of one dtype, both addresses 16-byte aligned; with flags (zeroed int32, one a tensor) it also
    checks (flags[i] nonzero: the i-th source held NaN or Inf), without it only copies."""
    import triton.language as tl

    from server.model.finite_kernel import copy_and_flag_kernel

    per_program = COPY_BLOCK * COPY_ITERS
    firsts = [0]
    for _, _, _, numel in entries:
        firsts.append(firsts[-1] + (numel + per_program - 1) // per_program)
    flag_at = [flags.data_ptr() + 4 * i for i in range(len(entries))] if flags is not None else [0] * len(entries)
    table = torch.tensor([[src for _, src, _, _ in entries] + [0], [dst for _, _, dst, _ in entries] + [0],
                          [numel for _, _, _, numel in entries] + [0], firsts, flag_at + [0]], dtype=torch.int64)
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    steps = next(s for s in SEARCH_STEPS if len(entries) <= 1 << s)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # Triton's launch device
        # Pageable memory: the host's bytes are taken before the call returns, in the stream's order.
        table = table.to(device, non_blocking=True)
        copy_and_flag_kernel[(firsts[-1],)](table, len(entries), DTYPE=tl_dtype, BLOCK=COPY_BLOCK,
                                            ITERS=COPY_ITERS, SEARCH_STEPS=steps, CHECK=flags is not None,
                                            num_warps=4)


@torch.inference_mode()
def warm_up(device: torch.device, dtypes, check: bool = True) -> None:
    """Compile, at start-up, the receive copy's variants a weight update can meet for these dtypes (a launch of
    1 tensor, then one past each step count's reach but the last: each of SEARCH_STEPS), with the check or, for
    a server that turned it off, without, so the first update compiles nothing (Triton caches them on disk: a
    later start loads them). Each launch copies zeros and one NaN, last; checked, through host flags: the
    device's writes into host memory reach the host (HostFlags)."""
    counts = [1] + [(1 << steps) + 1 for steps in SEARCH_STEPS[:-1]]
    for dtype in (d for d in FLAGGED_DTYPES if d in set(dtypes)):
        for count in counts:
            src = torch.zeros(count * 8, dtype=dtype, device=device)
            src[-1] = float("nan")
            dst = torch.empty_like(src)
            group = [(str(i), dst[8 * i:8 * i + 8], src[8 * i:8 * i + 8]) for i in range(count)]
            flags = copy_and_flag(group, HOST_FLAGS.take(count) if check else None)
            torch.cuda.synchronize(device)
            if check:
                assert flags.tolist() == [0] * (count - 1) + [1], f"the host flags read {flags.tolist()}"
            else:
                assert dst[:-1].eq(0).all() and dst[-1].isnan(), "the copy kernel lost bytes"


# A launch's binary search runs one of these step counts (a compiled variant each): up to 2^16 tensors a launch.
SEARCH_STEPS = (4, 8, 16)
MAX_TENSORS_PER_LAUNCH = 1 << SEARCH_STEPS[-1]
# A program copies COPY_ITERS blocks of COPY_BLOCK elements (16-byte loads a thread at 16 bits).
COPY_BLOCK = 2048
COPY_ITERS = 4
