"""The server's end of a weight transfer: check what is announced, receive, copy in place.

Everything here blocks (rendezvous, broadcasts, copies) and runs on the transfer thread, never on
the event loop or the engine thread; the route brackets it with the engine's begin/end calls so
no step runs on half-written weights. Names, dtypes and shapes are checked against the model
before the first byte moves. Tensors are copied into the existing parameters (the pool's
memory): addresses, and so CUDA graphs, stay valid; fused q|k|v and gate|up blocks are filled
through their per-projection views, which keep the checkpoint's names. The nccl/gloo receive itself
(in place where the bytes line up, else through reused buffers on a copy stream) is
broadcast_receive.py.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from server.weight_transfer import handles, rendezvous
from server.weight_transfer.broadcast_receive import BroadcastReceive
from server.weight_transfer.config import WeightTransferConfig
from server.weight_transfer.group import TransferGroup, open_group
from server.weight_transfer.protocol import DTYPES, TensorMeta, view_at
from server.weight_transfer.unchecked_copy import UncheckedCopy

log = logging.getLogger("sleepserve.weights")


class TransferRequestError(ValueError):
    """The announced update does not fit (HTTP 400); nothing was received or written."""

    def __init__(self, message: str, param: str = "update_info"):
        super().__init__(message)
        self.param = param


class TransferFailedError(RuntimeError):
    """The transfer broke after it started (a trainer that died, a timeout), or (`nonfinite`: the names)
    it landed tensors holding NaN or Inf. `loaded` says which tensors were already overwritten; the
    engine marks the weights invalid if any were."""

    def __init__(self, message: str, loaded: set[str], nonfinite: tuple[str, ...] = ()):
        super().__init__(message)
        self.loaded = loaded
        self.nonfinite = nonfinite


@dataclass
class Update:
    metas: list[TensorMeta]
    packed: bool
    bucket_bytes: int
    handles: Any = None               # ipc/shm: one handle (packed) or a list (one per tensor)
    tensor_sizes: list[int] | None = None
    ready_key: str | None = None      # our sender's handshake key in the rendezvous store

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)


class WeightReceiver:
    def __init__(self, config: WeightTransferConfig, model: nn.Module, device: torch.device,
                 targets: dict[str, torch.Tensor] | None = None,
                 units: Callable[[Iterable[str]], set[str]] | None = None,
                 finite_check: Callable[[], Any] = UncheckedCopy):
        """targets: every name a trainer may send -> the tensor it lands in (default: the parameters; the
        engine passes model/loader.checkpoint_targets: a sparse layer's per-expert names are views of its
        stacked experts). units: the names a write counts as (loader.unit_names: a stacked expert tensor
        counts as the experts it holds). finite_check: makes the check every received tensor is copied
        through (unchecked_copy.py's interface; the engine injects model/finite.py FiniteCheck, disabled by
        --no-check-weights-finite)."""
        config.check_device(device.type)
        self.config = config
        self.device = device
        self.finite_check = finite_check
        params = targets if targets is not None else dict(model.named_parameters())
        self.units = units or set
        # Tensor parallel: the trainer sends whole tensors to every rank; a rank keeps its slice of
        # each split one (`sharded`: its parameter and Shard) and the whole of the rest (`targets`).
        tp = getattr(model, "tp", None)
        shards = {n: s for n in params if tp is not None and (s := tp.shard(n)) is not None}
        self.sharded: dict[str, tuple[torch.Tensor, Any]] = {n: (params[n], s) for n, s in shards.items()}
        self.targets: dict[str, torch.Tensor] = {n: p for n, p in params.items() if n not in shards}
        if self.sharded and config.backend in ("ipc", "shm"):
            raise ValueError(f"the {config.backend} weight-transfer backend does not work with --tensor-parallel-size "
                             "above 1 (each rank needs its slices); use nccl (gloo on CPU)")
        # A tied model has no lm_head of its own; trainers still send lm_head.weight: skip it.
        self.skipped = {"lm_head.weight"} if getattr(model, "lm_head", 0) is None else set()
        self.group: TransferGroup | None = None
        self.store: Any = None
        self.importer = handles.CudaImporter(device) if config.backend == "ipc" else None
        self._receiving: BroadcastReceive | None = None
        self._check: Any = None  # the receive in progress's FiniteCheck
        self.last_stats: dict = {}   # the last receive's timings (broadcast_receive.ReceiveStats)

    # -- checks (before any byte) ----------------------------------------------------------------

    def check(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> list[TensorMeta]:
        if not (len(names) == len(dtype_names) == len(shapes)):
            raise TransferRequestError(f"names, dtype_names and shapes must be as long as each other; got "
                                       f"{len(names)}, {len(dtype_names)} and {len(shapes)}")
        problems: list[str] = []
        metas: list[TensorMeta] = []
        seen: set[str] = set()
        for name, dt, shape in zip(names, dtype_names, shapes):
            if name in seen:
                problems.append(f"{name!r} is sent twice")
            seen.add(name)
            dtype = DTYPES.get(str(dt).removeprefix("torch."))
            if dtype is None:
                problems.append(f"{name}: dtype {dt!r} is not a floating-point dtype name "
                                f"({', '.join(sorted(set(DTYPES) - {'half', 'float', 'double'}))})")
                continue
            shape_t = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape_t):
                problems.append(f"{name}: shape {list(shape_t)} has a negative size")
                continue
            metas.append(TensorMeta(name, dtype, shape_t))
            expected = self.full_shape(name)
            if expected is None:
                if name not in self.skipped:
                    problems.append(f"unexpected tensor {name!r} (not a parameter of the served model)")
            elif expected != shape_t:
                problems.append(f"{name}: shape {list(shape_t)} but the model has {list(expected)}")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise TransferRequestError("the weights do not fit the served model: " + "; ".join(problems[:8]) + more)
        return metas

    def full_shape(self, name: str) -> tuple[int, ...] | None:
        """The whole tensor's shape (what the trainer sends), or None for a name the model lacks."""
        if name in self.targets:
            return tuple(self.targets[name].shape)
        if name in self.sharded:
            param, shard = self.sharded[name]
            return shard.full_shape(tuple(param.shape))
        return None

    def check_handles(self, update: Update) -> None:
        if self.config.distributed:
            if self.group is None:
                raise TransferRequestError("no weight-transfer group: POST /init_weight_transfer_engine first",
                                           param="init_info")
            return
        if update.handles is None:
            raise TransferRequestError(f"the {self.config.backend} backend needs ipc_handles (or ipc_handles_pickled)",
                                       param="update_info.ipc_handles")
        if update.packed:
            if update.tensor_sizes is None:
                raise TransferRequestError("a packed IPC update needs tensor_sizes", "update_info.tensor_sizes")
            want = [m.nbytes for m in update.metas]
            if list(update.tensor_sizes) != want:
                raise TransferRequestError(f"tensor_sizes {list(update.tensor_sizes)[:8]} do not match the dtypes and "
                                           f"shapes announced ({want[:8]} bytes)", "update_info.tensor_sizes")
        elif not isinstance(update.handles, list) or len(update.handles) != len(update.metas):
            raise TransferRequestError("an unpacked IPC update needs one handle per tensor", "update_info.ipc_handles")
        try:
            if self.importer is None:
                handles.shm_path(update.handles, update.nbytes)
            else:
                for h in update.handles if isinstance(update.handles, list) else [update.handles]:
                    self.importer.check(h)
        except handles.HandleError as e:
            raise TransferRequestError(str(e), "update_info.ipc_handles") from None

    # -- the group (nccl / gloo) ------------------------------------------------------------------

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> dict:
        """Join the trainer's group. Blocks until the trainer is there (up to timeout_s)."""
        self.close()
        if not self.config.distributed:
            return {"backend": self.config.backend}
        t0 = time.perf_counter()
        try:
            store = rendezvous.join_store(master_address, master_port, world_size, self.config.timeout_s)
            with self._on_device():
                self.group = open_group(self.config.backend, store, rank_offset, world_size, self.device,
                                        self.config.timeout_s)
        except Exception as e:
            raise TransferFailedError(f"could not join the weight-transfer group at {master_address}:{master_port} "
                                      f"as rank {rank_offset} of {world_size}: {e}", set()) from None
        self.store = store
        log.info("joined the %s weight-transfer group at %s:%d as rank %d of %d in %.2f s", self.config.backend,
                 master_address, master_port, rank_offset, world_size, time.perf_counter() - t0)
        return {"backend": self.config.backend, "rank": rank_offset, "world_size": world_size}

    def signal(self, key: str | None, message: str) -> None:
        """Tell our sender whether to start broadcasting (see rendezvous.py)."""
        if key and self.store is not None:
            try:
                self.store.set(rendezvous.READY_PREFIX + key, message)
            except Exception as e:  # the trainer is gone; the receive will say so
                log.warning("could not signal the trainer: %s", e)

    # -- receiving -------------------------------------------------------------------------------

    def receive(self, update: Update) -> set[str]:
        """Move the bytes and copy them into the parameters. Returns the names written; `last_stats`
        says where the time went."""
        loaded: set[str] = set()
        self.last_stats = {}
        self._check = self.finite_check()
        try:
            with self._on_device():
                self._receive(update, loaded)
            t0 = time.perf_counter()
        except Exception as e:
            self._check = None
            if self.config.distributed:
                self.close(abort=True)  # a broken group cannot be reused: the trainer must init again
                if self._receiving is not None:
                    self._receiving.drain()
                    self._receiving = None
            raise TransferFailedError(f"the weight transfer failed after {len(loaded)} of {len(update.metas)} "
                                      f"tensors: {type(e).__name__}: {e}", self.units(loaded)) from e
        self._check_finite(loaded)
        self.last_stats["verdict_s"] = time.perf_counter() - t0
        return self.units(loaded)

    def _check_finite(self, loaded: set[str]) -> None:
        """After every byte landed: one host read of every tensor's verdict."""
        check, self._check = self._check, None
        with self._on_device():
            bad = check.bad()
        if bad:
            raise TransferFailedError(f"NaN or Inf in {', '.join(bad)}", self.units(loaded), tuple(bad))

    def _on_device(self) -> Any:
        """This thread's current CUDA device must be the model's (IPC rebuilds and streams use it)."""
        import contextlib
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _receive(self, update: Update, loaded: set[str]) -> None:
        if self.config.distributed:
            self._receive_broadcast(update, loaded)
        else:
            self._receive_handles(update, loaded)
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            torch.cuda.synchronize(self.device)
            self.last_stats["sync_s"] = time.perf_counter() - t0

    def _copy(self, pairs: list[tuple[str, torch.Tensor]], loaded: set[str]) -> None:
        """Into their parameters, through the receive's check (the copy checks what it copies)."""
        triples = [(name, self.targets[name], tensor) for name, tensor in pairs if name in self.targets]
        with torch.no_grad():
            self._check.copy_many(triples)
        loaded.update(name for name, _, _ in triples)

    def _receive_broadcast(self, update: Update, loaded: set[str]) -> None:
        assert self.group is not None
        self._receiving = BroadcastReceive(self.group, self.targets, self.device, self.config.packed_num_buffers,
                                           sharded=self.sharded, check=self._check)
        stats = self._receiving.run(update.metas, update.packed, update.bucket_bytes, loaded)
        self._receiving = None
        self.last_stats = stats.as_dict()

    def _receive_handles(self, update: Update, loaded: set[str]) -> None:
        """The bucket's handle opened, its tensors copied into the parameters (through the check): last_stats has
        the host's seconds of each (open_s, copy_s: the copies queued; the device's wait is _receive's sync_s)."""
        if update.packed:
            nbytes = update.nbytes
            t0 = time.perf_counter()
            if self.importer is not None:
                bucket = self.importer.open(update.handles)
                if bucket.numel() * bucket.element_size() < nbytes:
                    raise handles.HandleError(f"the IPC buffer holds {bucket.numel()} bytes, fewer than {nbytes}")
                bucket = bucket.view(-1).view(torch.uint8)[:nbytes]
            else:
                bucket = handles.open_shm(update.handles, nbytes)
            t1 = time.perf_counter()
            with torch.no_grad():
                loaded.update(self._check.copy_packed(bucket, update.metas, self.targets, view_at))
            self.last_stats.update(open_s=t1 - t0, copy_s=time.perf_counter() - t1)
            del bucket  # a shm mapping goes now; a CUDA one when the update finishes
            return
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        assert self.importer is not None
        for m, handle in zip(update.metas, update.handles):
            args = self.importer.check(handle)
            args[6] = self.device.index or 0
            tensor = rebuild_cuda_tensor(*args)
            if tensor.dtype != m.dtype or tuple(tensor.shape) != m.shape:
                raise handles.HandleError(f"{m.name}: the handle holds {tensor.dtype} {list(tensor.shape)}, "
                                          f"not the announced {m.dtype} {list(m.shape)}")
            self._copy([(m.name, tensor)], loaded)
            torch.cuda.synchronize(self.device)
            del tensor

    def finish(self) -> None:
        """The update is over: drop the last IPC mapping and the bucket memory torch cached."""
        if self.importer is not None:
            self.importer.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self, abort: bool = False) -> None:
        if self.group is not None:
            try:
                self.group.close(abort=abort)
            except Exception as e:
                log.warning("closing the weight-transfer group: %s", e)
        self.group, self.store = None, None
        if self.importer is not None:
            self.importer.close()
