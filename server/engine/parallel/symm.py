"""One- and two-shot all-reduces over CUDA symmetric memory, for the small all-reduces of decode steps.

A decode step of an 8B model at TP=2 all-reduces 65 times (after every o_proj and down_proj, and the
embedding), each a few KiB to 2 MiB (rows x hidden): latency-bound, where NCCL's protocol costs the
most. One-shot (torch.distributed._symmetric_memory): every rank holds one buffer that every other
rank has mapped (peer memory over NVLink, exchanged once at start); o_proj and down_proj write their
partial sums straight into it (TensorParallel.row_parallel; other inputs are copied in), the ranks
meet at a barrier on the buffer's signal pads, and each rank reads every rank's rows and sums them
itself, in rank order (so every rank gets the same bits). From 256 KiB the two-shot kernel instead
sums one slice per rank and gathers the slices. One kernel per all-reduce, captured by a CUDA graph
like any other, no host work on replay.

No NVLink multicast, ever: only peer loads and stores (one_shot_all_reduce_out and
two_shot_all_reduce_out, never the multimem ops), and the rendezvous runs with
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set when absent; with any other value the rendezvous would create
a multicast object, so NCCL is used instead).

Messages above the buffer (prefill chunks), dtypes the kernel lacks (float16) and odd alignments go
to NCCL, as does every all-gather. The buffer is allocated by torch's symmetric-memory allocator,
outside the pool: it stays mapped while the ranks sleep, like the communicator (max_num_seqs x hidden
x 2 bytes: 2 MiB for an 8B model at 256 sequences, plus a signal pad, rounded to the driver's 2 MiB
granularity).
"""
from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

log = logging.getLogger("sleepserve.engine")

# Largest message done one-shot, by world size: each rank reads (world - 1) times the message from
# its peers, so NCCL's ring wins earlier with more ranks.
ONE_SHOT_LIMIT = {2: 8 << 20, 4: 2 << 20}
ONE_SHOT_LIMIT_DEFAULT = 1 << 20
# From this size the two-shot kernel (reduce-scatter then all-gather through the same buffers: each
# rank reads 2 (world - 1) / world of the message instead of world - 1 times it) is used, where this
# torch has it. H200x2 in a graph, per op, rows of 4096 bf16: 1 row 7.1 / 7.0 us one-/two-shot, 8 rows
# 8.0 / 8.0, 64 rows 10.4 / 8.4, 256 rows 18.8 / 13.3 (NCCL 13.7, 15.3, 17.9, 34.3).
TWO_SHOT_FROM = 256 << 10
_TWO_SHOT_WORLDS = (2, 4, 8)  # the kernel's builds
_DTYPES = (torch.bfloat16, torch.float32)  # what the one-shot kernel is built for
_MULTICAST_OFF = "TORCH_SYMM_MEM_DISABLE_MULTICAST"


def buffer_bytes(world: int, max_rows: int, hidden: int, itemsize: int) -> int:
    """The symmetric buffer's size: the largest decode batch's rows (what the graphs capture), at
    most the one-shot limit, rounded up to 16 bytes (the kernel's vector width)."""
    n = min(max_rows * hidden * itemsize, ONE_SHOT_LIMIT.get(world, ONE_SHOT_LIMIT_DEFAULT))
    return -(-n // 16) * 16


class SymmComm:
    """A DeviceComm: one-shot all-reduce for messages up to the buffer's size, the NCCL
    communicator (`nccl`) for everything else."""

    name = "symm"
    device_bytes = 0  # device memory the buffer took on this rank (measured at start)

    def __init__(self, nccl, buf: torch.Tensor, handle, group_name: str):
        self.nccl = nccl
        self.buf = buf            # uint8, viewed as the message's dtype per call
        self.handle = handle      # the rendezvous' result: keeps the peers' mappings alive
        self.group_name = group_name
        self.limit = buf.numel()
        self.views: dict[torch.dtype, torch.Tensor] = {}
        self.one_shot = torch.ops.symm_mem.one_shot_all_reduce_out
        self.two_shot = getattr(torch.ops.symm_mem, "two_shot_all_reduce_out", None)
        world = dist.get_world_size()
        self.two_shot_from = TWO_SHOT_FROM if self.two_shot is not None and world in _TWO_SHOT_WORLDS else 1 << 62

    def fits(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        # The kernels move 16 bytes per load and store; two-shot checks its output's offset too.
        return (0 < n <= self.limit and n % 16 == 0 and x.dtype in _DTYPES and x.is_contiguous()
                and x.data_ptr() % 16 == 0 and x.storage_offset() * x.element_size() % 16 == 0)

    def _view(self, dtype: torch.dtype) -> torch.Tensor:
        view = self.views.get(dtype)
        if view is None:
            view = self.views[dtype] = self.buf.view(dtype)
        return view

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank makes the same choice: the same forward gives the same shapes on every rank.
        if not self.fits(x):
            return self.nccl.all_reduce(x)
        staged = self._view(x.dtype)[:x.numel()]
        staged.copy_(x.view(-1))
        self._reduce(staged, x.view(-1))
        return x

    def staging(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a row-parallel layer can write its partial sums directly (no copy into the buffer
        before the all-reduce): a [rows, cols] view of the buffer, or None when they would not fit."""
        n = rows * cols * dtype.itemsize
        if not 0 < n <= self.limit or n % 16 or dtype not in _DTYPES:
            return None
        return self._view(dtype)[:rows * cols].view(rows, cols)

    def reduce_staged(self, staged: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of what each wrote into staging(), as a new tensor."""
        out = torch.empty_like(staged)
        self._reduce(staged.view(-1), out.view(-1))
        return out

    def _reduce(self, staged: torch.Tensor, out: torch.Tensor) -> None:
        # Both kernels start with a barrier (every rank's rows are staged) and end with one (no rank
        # refills its buffer while a peer still reads it); the output is never in the buffer (peers
        # read this rank's buffer while it writes the output).
        if staged.numel() * staged.element_size() >= self.two_shot_from:
            self.two_shot(staged, "sum", self.group_name, out)
        else:
            self.one_shot(staged, "sum", self.group_name, out)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.nccl.all_gather(x)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return self.nccl.broadcast(x)

    @property
    def suspendable(self) -> bool:
        return self.nccl.suspendable

    @property
    def suspended(self) -> bool:
        return self.nccl.suspended

    def suspend(self) -> None:
        """The NCCL communicator's memory goes; the symmetric buffer (a few MiB) stays mapped."""
        self.nccl.suspend()

    def resume(self) -> None:
        self.nccl.resume()

    def memory(self) -> dict[str, int]:
        return self.nccl.memory()

    def close(self) -> None:
        self.nccl.close()  # synchronizes first: no kernel reads the buffer any more
        self.release()

    def release(self) -> None:
        """Drop the buffer and the peers' mappings (the NCCL communicator stays)."""
        self.views.clear()
        self.handle = None
        self.buf = None  # type: ignore[assignment]

    def abort(self) -> None:
        """A peer died: NCCL's kernels end; a one-shot kernel already waiting for the dead peer's
        signal cannot be ended (it spins on the GPU), so the engine process exits (process.py
        gives a failed step 10 s) rather than this rank waiting on it."""
        self.nccl.abort()


def _agree(ok: bool) -> bool:
    """True when every rank says ok (over the control group, gloo on CPU tensors)."""
    t = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _probe(comm: SymmComm, rank: int, world: int, device: torch.device) -> str | None:
    """A known sum through the one-shot path, at one row and at the whole buffer; None when right,
    else what was wrong. Small integers are exact in bfloat16."""
    limit = comm.limit // 2  # bfloat16 elements
    # One row (one-shot), the whole buffer (two-shot where used), an odd size in between.
    for n in sorted({min(limit, 4096), min(limit, 4096 * 37), limit}):
        pattern = torch.arange(n, device=device, dtype=torch.int64) % 7
        x = (pattern * (rank + 1)).to(torch.bfloat16)
        if not comm.fits(x):
            return f"a probe of {n} elements does not fit the one-shot path"
        comm.all_reduce(x)
        torch.cuda.synchronize(device)
        want = (pattern * (world * (world + 1) // 2)).to(torch.bfloat16)
        if not torch.equal(x, want):
            bad = int((x != want).sum())
            return f"the one-shot all-reduce of {n} elements gave {bad} wrong sums"
    return None


def try_symm(nccl, rank: int, world: int, device: torch.device, nbytes: int, required: bool) -> SymmComm | None:
    """Every rank at once (the steps are collectives over the control group): a symmetric buffer of
    nbytes, its rendezvous, a probe. A SymmComm on every rank, or None on every rank (logged: why)."""
    level = logging.WARNING if required else logging.INFO
    why = None
    flag = os.environ.get(_MULTICAST_OFF)
    if flag is None:
        os.environ[_MULTICAST_OFF] = "1"  # read by the rendezvous: no multicast object is created
    elif flag.strip().lower() not in ("1", "true", "yes", "on"):
        why = f"{_MULTICAST_OFF}={flag!r} would let the rendezvous create an NVLink multicast object"
    buf = handle = None
    group_name = ""
    if why is None:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018 (raises when this torch lacks it)
            try:
                symm_mem.set_backend("CUDA")  # peer mappings of cuMem allocations, not NVSHMEM or NCCL's
            except Exception as e:  # an older torch has one backend only
                log.debug("symmetric memory set_backend: %s", e)
            group_name = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None and not hasattr(enable, "__deprecated__"):
                enable(group_name)  # torch before the rendezvous read the group's store itself
            free0 = torch.cuda.mem_get_info(device)[0]
            buf = symm_mem._SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)
        except Exception as e:
            why = f"symmetric memory is unavailable: {type(e).__name__}: {e}"
    if not _agree(why is None):
        log.log(level, "tensor parallelism: all-reduce over NCCL (%s)", why or "another rank cannot use symmetric memory")
        return None
    try:
        t0 = time.perf_counter()
        handle = symm_mem.rendezvous(buf, group_name)
        comm = SymmComm(nccl, buf, handle, group_name)
        rendezvous_s = time.perf_counter() - t0
    except Exception as e:
        why, comm = f"the symmetric-memory rendezvous failed: {type(e).__name__}: {e}", None
    if not _agree(why is None):
        log.log(level, "tensor parallelism: all-reduce over NCCL (%s)", why or "another rank's rendezvous failed")
        return None
    try:
        why = _probe(comm, rank, world, device)
    except Exception as e:
        why = f"the one-shot probe failed: {type(e).__name__}: {e}"
    if not _agree(why is None):
        log.log(level, "tensor parallelism: all-reduce over NCCL (%s)", why or "another rank's probe failed")
        comm.release()
        return None
    torch.cuda.empty_cache()  # the probe's tensors: not kept by torch's cache outside the pool
    used = free0 - torch.cuda.mem_get_info(device)[0]
    comm.device_bytes = used
    if rank == 0:
        log.info("tensor parallelism: one-shot all-reduce on symmetric memory up to %d KiB per message (NCCL above); "
                 "its buffer holds %.1f MiB of device memory per rank outside the pool (rendezvous %.0f ms)",
                 nbytes >> 10, used / 2**20, rendezvous_s * 1e3)
    return comm
