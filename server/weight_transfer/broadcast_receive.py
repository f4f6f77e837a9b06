"""The server's receive of a distributed update (nccl, gloo): straight into the parameters where the
bytes line up, through a reused bucket buffer where they do not, with no host wait per bucket.

On CUDA the host only enqueues; the streams keep the order:

    NCCL stream   bcast 0 ──> bcast 1 ──> [slot 0 free?] bcast 2 ──> ...
    copy stream      └─[bcast 0 done?] unpack 0 ─┘  └─[bcast 1 done?] unpack 1 ...

- A bucket whose parameters lie back to back in one storage, in the announced order and dtypes
  (protocol.region: e.g. a fused q|k|v block sent as q, k, v), is broadcast into them: no buffer,
  no unpack. So is every tensor of an unpacked update (one broadcast per tensor) whose parameter
  is contiguous and of the sent dtype.
- Any other bucket lands in one of `slots` buffers (allocated once per update, each at its first
  use) and is copied into the parameters on a copy stream while the next bucket arrives; the next
  broadcast into the same slot waits for that copy (an event), not the host.
- Every name is put in `loaded` before its first byte can land, so a transfer that breaks off is
  never taken for "nothing changed" (the engine then marks the weights invalid).
- The host then waits for the events in order (each within timeout_s, NCCL's async errors checked:
  a trainer that died ends in an abort, not a hang).
gloo is synchronous: the same loop, each broadcast complete when it returns.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from server.weight_transfer.group import TransferGroup
from server.weight_transfer.protocol import TensorMeta, plan_buckets, region, unpack
from server.weight_transfer.unchecked_copy import UncheckedCopy


@dataclass
class ReceiveStats:
    direct: int = 0             # buckets (unpacked: tensors) broadcast straight into parameters
    staged: int = 0             # buckets (tensors) received into a buffer, then copied
    enqueue_s: float = 0.0      # host: enqueueing every receive and copy (gloo: the whole receive)
    wait_s: float = 0.0         # host: waiting for the last bytes after that
    alloc_s: float = 0.0        # host: allocating the slot buffers
    unpack_gpu_s: float = 0.0   # device time of the unpack copies (CUDA events; 0 on CPU)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


class BroadcastReceive:
    """One update's receive. `targets` are the model's parameters by name."""

    def __init__(self, group: TransferGroup, targets: dict[str, torch.Tensor], device: torch.device, slots: int = 2,
                 sharded: dict[str, tuple[torch.Tensor, Any]] | None = None,
                 check: Any = None):
        """check: what the receive copies through (unchecked_copy.py's interface; the engine's is
        model/finite.py FiniteCheck; None: UncheckedCopy). Staged tensors are copied
        through it (the copy checks them in the same pass); a tensor broadcast straight into its parameter
        is added to it on the group's stream, after its broadcast."""
        self.group = group
        self.check = check if check is not None else UncheckedCopy()
        self.targets = targets
        # Tensor parallel: parameters this rank holds a slice of (parameter, Shard). They always land
        # in a buffer (the whole tensor arrives) and their slice is copied out of it.
        self.sharded = sharded or {}
        self.device = device
        self.slots = max(1, slots)
        self.cuda = group.stream is not None
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.stats = ReceiveStats()
        self._pending: list[Any] = []   # events (CUDA) to wait for, in order
        self._keep: list[torch.Tensor] = []  # buffers in use by enqueued work
        self._timed: list[tuple[Any, Any]] = []

    def run(self, metas: list[TensorMeta], packed: bool, bucket_bytes: int, loaded: set[str]) -> ReceiveStats:
        t0 = time.perf_counter()
        if packed:
            self._packed(metas, bucket_bytes, loaded)
        else:
            self._per_tensor(metas, loaded)
        if self.cuda:
            self._pending.append(self._mark(self.group.stream))
            self._pending.append(self._mark(self.copy_stream))
        t1 = time.perf_counter()
        for token in self._pending:
            self.group.wait_for(token)
        self.stats.enqueue_s, self.stats.wait_s = t1 - t0, time.perf_counter() - t1
        self.stats.unpack_gpu_s = sum(a.elapsed_time(b) for a, b in self._timed) / 1e3
        self._keep.clear()
        return self.stats

    def drain(self, timeout_s: float = 30.0) -> None:
        """After an abort: let whatever was enqueued finish (aborted NCCL kernels return), so no copy
        of this update can land after the next one started. Bounded: an abort must not hang here."""
        if not self.cuda:
            return
        marks = [self._mark(self.group.stream), self._mark(self.copy_stream)]
        deadline = time.monotonic() + timeout_s
        while not all(m.query() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._keep.clear()

    # -- the two layouts -------------------------------------------------------------------------

    def _per_tensor(self, metas: list[TensorMeta], loaded: set[str]) -> None:
        for m in metas:
            target = self.targets.get(m.name)
            if target is not None and target.dtype == m.dtype and target.is_contiguous() and target.numel():
                loaded.add(m.name)
                self._pending.append(self.group.broadcast(target.detach()))
                self.stats.direct += 1
                self._landed([m.name])
                continue
            buf = torch.empty(m.shape, dtype=m.dtype, device=self.device)
            self._keep.append(buf)  # until the broadcast into it is done, even when it is dropped
            self._pending.append(self.group.broadcast(buf))
            self.stats.staged += 1
            # Another dtype (cast on copy) or this rank's slice; lm_head of a tied model is dropped.
            if self.writes(m.name):
                loaded.add(m.name)
                with self._on(self.group.stream):  # after the broadcast, in its stream's order
                    self._copy([(m.name, buf)])

    def _packed(self, metas: list[TensorMeta], bucket_bytes: int, loaded: set[str]) -> None:
        buckets = [[metas[i] for i in r] for r in plan_buckets([m.nbytes for m in metas], bucket_bytes)]
        direct = [self._direct(b) for b in buckets]
        staged_sizes = [sum(m.nbytes for m in b) for b, d in zip(buckets, direct) if d is None]
        size = max(staged_sizes, default=0)
        # Allocated at first use: the second slot's allocation overlaps the first bucket's transfer.
        slots: list[torch.Tensor | None] = [None] * min(self.slots, len(staged_sizes))
        free: list[Any] = [None] * len(slots)  # per slot: the event after its last unpack
        n = 0
        for bucket, view in zip(buckets, direct):
            if view is not None:
                loaded.update(m.name for m in bucket)
                self._pending.append(self.group.broadcast(view))
                self.stats.direct += 1
                self._landed([m.name for m in bucket])
                continue
            s = n % len(slots)
            n += 1
            if slots[s] is None:
                t0 = time.perf_counter()
                slots[s] = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._keep.append(slots[s])
                self.stats.alloc_s += time.perf_counter() - t0
            buf = slots[s][:sum(m.nbytes for m in bucket)]
            if free[s] is not None:
                self.group.stream.wait_event(free[s])  # the copy out of this slot is done
            token = self.group.broadcast(buf)
            loaded.update(m.name for m in bucket if self.writes(m.name))
            self.stats.staged += 1
            if not self.cuda:
                self._copy(unpack(buf, bucket))
                continue
            self.copy_stream.wait_event(token)
            with torch.cuda.stream(self.copy_stream):
                start = self._mark(self.copy_stream, timing=True)
                self._copy(unpack(buf, bucket))
                free[s] = self._mark(self.copy_stream, timing=True)
            self._timed.append((start, free[s]))
            self._pending.append(token)

    def _direct(self, bucket: list[TensorMeta]) -> torch.Tensor | None:
        """The parameters' own bytes, when they are exactly this bucket's layout."""
        params = []
        for m in bucket:
            target = self.targets.get(m.name)
            if target is None or target.dtype != m.dtype:
                return None
            params.append(target.detach())
        return region(params)

    def writes(self, name: str) -> bool:
        return name in self.targets or name in self.sharded

    def _copy(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self.check.copy_many([(name, self.targets[name], tensor) for name, tensor in pairs
                                  if name in self.targets])
            for name, tensor in pairs:
                if name not in self.targets and name in self.sharded:
                    param, shard = self.sharded[name]
                    shard.place(param, shard.take(tensor))
                    self.check.add(name, param)

    def _landed(self, names: list[str]) -> None:
        """Broadcast straight into their parameters: checked after the broadcast, on its stream."""
        with self._on(self.group.stream):
            for name in names:
                self.check.add(name, self.targets[name])

    # -- streams -----------------------------------------------------------------------------------

    def _mark(self, stream: Any, timing: bool = False) -> Any:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    @contextlib.contextmanager
    def _on(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield
