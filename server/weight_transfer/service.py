"""The engine process's end of weight transfers: the receiver writes the model's tensors, so it lives
where the model lives, and the API process only forwards the routes' bodies as commands.

Everything that blocks (rendezvous, receives, copies) runs on one transfer thread, in order; the
engine's weight_session functions bracket each write on the engine thread (`on_engine`), so no step
ever runs on half-written weights. These methods themselves run on a command thread of the engine
process (server/engine/process.py), never on the engine thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from server.engine import weight_session
from server.engine.core import EngineCore
from server.engine.errors import EngineUnavailableError, InvalidRequestError
from server.weight_transfer import safe_pickle
from server.weight_transfer.config import WeightTransferConfig
from server.weight_transfer.receiver import TransferFailedError, TransferRequestError, Update, WeightReceiver

log = logging.getLogger("sleepserve.weights")

OnEngine = Callable[[Callable[[EngineCore], Any]], Any]


class _Worker:
    """One daemon thread that runs submitted calls in order (transfers are one at a time)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="sleepserve-weights", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._calls.put((fut, fn, args))
        return fut

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.submit(fn, *args).result()

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fut, fn, args = call
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)


def _request_error(e: TransferRequestError) -> InvalidRequestError:
    return InvalidRequestError(str(e), e.param, "weight_mismatch")


class WeightTransferService:
    """Owns the receiver and the one thread that blocks on transfers."""

    def __init__(self, config: WeightTransferConfig, core: EngineCore, on_engine: OnEngine):
        if core.config.tensor_parallel_size > 1:
            raise ValueError("--weight-transfer-config does not work with --tensor-parallel-size above 1 yet; "
                             "load new weights from disk with POST /update_weights {\"path\": ...}")
        self.config = config
        self.core = core
        self.on_engine = on_engine
        self.receiver = WeightReceiver(config, core.model, core.device)
        self._thread = _Worker()
        self.packed_default: bool | None = None   # init_info.packed of the last init

    def shutdown(self) -> None:
        # Not joined: a receive may be blocked on a trainer for up to timeout_s, and shutting down
        # must not wait for it (the thread is a daemon).
        self._thread.submit(self.receiver.close)
        self._thread.stop()

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             packed: bool | None = None) -> dict:
        if rank_offset >= world_size:
            raise InvalidRequestError(f"rank_offset {rank_offset} must be below world_size {world_size} (the trainer "
                                      "is rank 0, this server joins at rank_offset)", "init_info.rank_offset")
        if self.config.distributed and master_port == 0:
            raise InvalidRequestError("master_port is required for the nccl/gloo backends", "init_info.master_port")
        try:
            report = self._thread.run(self.receiver.init, master_address, master_port, rank_offset, world_size)
        except TransferFailedError as e:
            raise InvalidRequestError(str(e), "init_info", "weight_transfer_init_failed") from None
        self.packed_default = packed
        return report

    def _update(self, info: dict) -> Update:
        metas = self.receiver.check(info["names"], info["dtype_names"], info["shapes"])
        handles = info.get("ipc_handles")
        if info.get("ipc_handles_pickled") is not None:
            if handles is not None:
                raise TransferRequestError("send ipc_handles or ipc_handles_pickled, not both")
            try:
                handles = safe_pickle.loads_b64(info["ipc_handles_pickled"])
            except safe_pickle.UnsafePickleError as e:
                raise TransferRequestError(f"ipc_handles_pickled: {e}", "update_info.ipc_handles_pickled") from None
        packed = info.get("packed")
        if self.config.distributed:
            packed = packed if packed is not None else bool(self.packed_default)
        elif packed is None:
            packed = not isinstance(handles, list)
        update = Update(metas=metas, packed=packed,
                        bucket_bytes=info.get("packed_buffer_size_bytes") or self.config.packed_buffer_size_bytes,
                        handles=handles, tensor_sizes=info.get("tensor_sizes"),
                        ready_key=info.get("sleepserve_ready_key"))
        self.receiver.check_handles(update)
        return update

    def update(self, info: dict) -> dict:
        """Check, stop stepping, receive on the transfer thread, record what landed. Once the write
        has begun it is closed on the engine whatever happens to the HTTP request that asked."""
        key = info.get("sleepserve_ready_key")
        try:
            update = self._update(info)
            self.on_engine(weight_session.begin_write)
        except TransferRequestError as e:
            self._thread.run(self.receiver.signal, key, f"error: {e}")
            raise _request_error(e) from None
        except Exception as e:
            self._thread.run(self.receiver.signal, key, f"error: {e}")
            raise
        t0 = time.perf_counter()
        try:
            self._thread.run(self.receiver.signal, update.ready_key, "ok")
            loaded = self._thread.run(self.receiver.receive, update)
        except TransferFailedError as e:
            landed = e.loaded
            self.on_engine(lambda core: weight_session.end_write(core, landed, failed=True))
            log.error("%s", e)
            raise EngineUnavailableError(f"{e}; the weights are marked invalid until a complete update" if e.loaded
                                         else f"{e}; no weight was changed", code="weight_transfer_failed") from None
        except BaseException:
            self.on_engine(lambda core: weight_session.end_write(core, set(), failed=True))
            raise
        seconds = time.perf_counter() - t0
        finished = self.on_engine(lambda core: weight_session.end_write(core, loaded, failed=False))
        if finished is not None:
            self._release()
        return {"tensors": len(loaded), "bytes": update.nbytes, "seconds": seconds,
                "gb_per_s": update.nbytes / seconds / 1e9 if seconds > 0 else None,
                "timings": self.receiver.last_stats}

    def start(self) -> dict:
        return self.on_engine(weight_session.start)

    def finish(self, weight_version: str | None) -> dict:
        report = self.on_engine(lambda core: weight_session.finish(core, weight_version))
        self._release()
        return report

    def _release(self) -> None:
        """Free what the update held. IPC: the trainer's mapping goes before we answer (its memory is
        the trainer's). nccl / gloo: only our bucket buffers' cached memory, freed after the answer
        (a cudaFree waits for the device; the transfer thread runs it before anything queued later)."""
        if self.config.distributed:
            self._thread.submit(self.receiver.finish)
        else:
            self._thread.run(self.receiver.finish)

    def update_from_tensor(self, serialized: str, weight_version: str | None) -> dict:
        """SGLang's /update_weights_from_tensor: a base64 pickle of [(name, tensor), ...] whose tensors
        are CUDA IPC-shared; read with the restricted unpickler (here, where a CUDA context may exist),
        checked, copied in, released before the answer."""
        try:
            named = safe_pickle.loads_b64(serialized)
            named = list(named.items()) if isinstance(named, dict) else list(named)
            names = [str(n) for n, _ in named]
            tensors = [t for _, t in named]
        except (safe_pickle.UnsafePickleError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"serialized_named_tensors[0]: {e}", "serialized_named_tensors") from None
        try:
            self.receiver.check(names, [str(t.dtype) for t in tensors], [list(t.shape) for t in tensors])
        except TransferRequestError as e:
            raise InvalidRequestError(str(e), "serialized_named_tensors", "weight_mismatch") from None
        report = self.on_engine(lambda core: core.update_weights(named_tensors=named, weight_version=weight_version))
        named.clear()  # drop the IPC mappings before answering
        del tensors
        return report
