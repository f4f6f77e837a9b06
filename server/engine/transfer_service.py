"""The engine process's end of weight transfers: the receiver writes the model's tensors, so it lives
where the model lives, and the API process only forwards the routes' bodies as commands.

start, update and finish run on the engine thread (ENGINE commands: no command-thread hop, and the
engine is not stepping while a transfer session may write), for the moment they decide what the
weights are worth (SleepController, server/engine/sleep_controller.py). Everything that blocks (rendezvous, receives,
copies, releasing IPC mappings) runs on one transfer thread, in order; a receive hands its result
back to the engine thread (`defer`), which closes the write and answers. So an update costs two
thread hand-offs (engine -> transfer -> engine), not eight, and no step runs on half-written weights.
init and SGLang's update_from_tensor block as a whole and run on a command thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable

from server.engine.core import EngineCore
from server.model.finite import FiniteCheck, nonfinite_message
from server.model.loader import receiver_names
from server.wire.errors import EngineUnavailableError, InvalidRequestError, NonFiniteWeightsError
from server.weight_transfer import safe_pickle
from server.weight_transfer.config import WeightTransferConfig
from server.weight_transfer.receiver import TransferFailedError, TransferRequestError, Update, WeightReceiver

log = logging.getLogger("sleepserve.weights")

OnEngine = Callable[[Callable[[EngineCore], Any]], Any]
Defer = Callable[[Callable[[], None]], None]


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
    """Owns the receiver and the one thread that blocks on transfers.

    Tensor parallel: every rank is a member of the trainer's group (rank_offset + its rank) and
    receives every broadcast, keeping its slices (receiver.py). The workers' receivers are driven
    from here over the ranks' pipe (parallel/worker.py `wt_*` commands), each at the same time as
    rank 0's own call, because a group's rendezvous and its broadcasts need every member at once."""

    def __init__(self, config: WeightTransferConfig, core: EngineCore, on_engine: OnEngine, defer: Defer):
        self.config = config
        self.core = core
        self.on_engine = on_engine   # from a command thread: run on the engine thread, wait for it
        self.defer = defer           # from the transfer thread: run on the engine thread, do not wait
        self.receiver = WeightReceiver(config, core.model, core.device, *receiver_names(core.model),
                                       finite_check=partial(FiniteCheck, core.config.check_weights_finite))
        self.workers = getattr(core.runner, "workers", None)  # parallel/executor.Workers at TP > 1
        self._thread = _Worker()
        self.packed_default: bool | None = None   # init_info.packed of the last init
        # While a write is in flight: finishes that arrived meanwhile, run once it ends (engine thread).
        self._after_write: list[Callable[[BaseException | None], None]] | None = None
        self._checked: tuple[tuple, list] | None = None  # the last announcement that passed, and its metas

    def _on_ranks(self, op: str, local: Callable[[], Any], args: Callable[[int], Any] | None = None
                  ) -> dict[int, Any]:
        """local() here (rank 0) and the command on every worker at once; each rank's result or the
        exception it raised."""
        if self.workers is None:
            try:
                return {0: local()}
            except Exception as e:
                return {0: e}
        per_rank = {r: args(r) if args is not None else None for r in self.workers.conns}
        return self.workers.run(op, None, local, args=per_rank)

    @staticmethod
    def _first_error(outcomes: dict[int, Any]) -> BaseException | None:
        return next((v for v in outcomes.values() if isinstance(v, BaseException)), None)

    def shutdown(self) -> None:
        # Not joined: a receive may be blocked on a trainer for up to timeout_s, and shutting down
        # must not wait for it (the thread is a daemon). The workers' receivers end with them.
        self._thread.submit(self.receiver.close)
        self._thread.stop()

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             packed: bool | None = None) -> dict:
        if rank_offset >= world_size:
            raise InvalidRequestError(f"rank_offset {rank_offset} must be below world_size {world_size} (the trainer "
                                      "is rank 0, this server joins at rank_offset)", "init_info.rank_offset")
        if self.config.distributed and master_port == 0:
            raise InvalidRequestError("master_port is required for the nccl/gloo backends", "init_info.master_port")
        ranks = self.core.config.tensor_parallel_size
        if rank_offset + ranks > world_size:
            raise InvalidRequestError(f"world_size {world_size} has no room for this server's {ranks} ranks from "
                                      f"rank_offset {rank_offset} (the trainer is rank 0; GET /get_world_size)",
                                      "init_info.world_size")

        def join() -> dict:
            outcomes = self._on_ranks(
                "wt_init", lambda: self.receiver.init(master_address, master_port, rank_offset, world_size),
                lambda r: (self.config, master_address, master_port, rank_offset + r, world_size))
            error = self._first_error(outcomes)
            if error is not None:
                self._on_ranks("wt_close", self.receiver.close)  # no rank stays in a half-made group
                raise error
            return {**outcomes[0], "ranks": [rank_offset + r for r in sorted(outcomes)]} if self.workers else outcomes[0]

        try:
            report = self._thread.run(join)
        except TransferFailedError as e:
            raise InvalidRequestError(str(e), "init_info", "weight_transfer_init_failed") from None
        self.packed_default = packed
        return report

    def _receive_all(self, update: Update) -> set[str]:
        """Every rank receives the update at once; a failure on any rank fails it with every name
        any rank wrote (the engine marks the weights invalid if there are any)."""
        outcomes = self._on_ranks("wt_receive", lambda: self.receiver.receive(update), lambda r: update)
        loaded: set[str] = set()
        failed: list[str] = []
        nonfinite: list[str] = []
        for rank, value in sorted(outcomes.items()):
            if isinstance(value, TransferFailedError):
                loaded |= value.loaded
                nonfinite += value.nonfinite
                failed.append(f"rank {rank}: {value}" if self.workers else str(value))
            elif isinstance(value, BaseException):
                raise value
            elif isinstance(value, dict):  # a worker's answer (parallel/worker.py op_wt_receive)
                loaded |= set(value["loaded"])
                nonfinite += value.get("nonfinite", [])
                if value.get("error"):
                    failed.append(f"rank {rank}: {value['error']}")
            else:
                loaded |= value
        if nonfinite:  # every rank received every tensor: the names, once, say it all
            names = tuple(dict.fromkeys(nonfinite))
            raise TransferFailedError(nonfinite_message(names), loaded, names)
        if failed:
            raise TransferFailedError("; ".join(failed), loaded)
        return loaded

    def _check(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> list:
        """The receiver's check, remembered for the announcement it passed: a trainer announces the same
        names, dtypes and shapes every step (291 tensors of an 8B model: 0.55 ms to check on the CI host,
        0.02 ms to compare). The model's parameters never change shape, so a passed check stays passed."""
        key = (tuple(names), tuple(dtype_names), tuple(map(tuple, shapes)))
        if self._checked is not None and self._checked[0] == key:
            return self._checked[1]
        metas = self.receiver.check(names, dtype_names, shapes)
        self._checked = (key, metas)
        return metas

    def _update(self, info: dict) -> Update:
        metas = self._check(info["names"], info["dtype_names"], info["shapes"])
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

    def update(self, info: dict) -> Future:
        """Engine thread: check, stop stepping, hand the receive to the transfer thread. The returned
        future is resolved on the engine thread once the write is closed there (the command's reply);
        once the write has begun it is closed whatever happens to the HTTP request that asked."""
        key = info.get("sleepserve_ready_key")
        clock = {"engine_in": time.time()}  # wall-clock times of the update's stages (the bench's breakdown)
        try:
            update = self._update(info)
            if info.get("sleepserve_start_session"):  # one round trip less for our sender: start, in this call
                self.core.open_weight_session()
            self.core.begin_weight_write()
        except TransferRequestError as e:
            self._thread.submit(self.receiver.signal, key, f"error: {e}")
            raise _request_error(e) from None
        except Exception as e:
            self._thread.submit(self.receiver.signal, key, f"error: {e}")
            raise
        done: Future = Future()
        self._after_write = []
        self._thread.submit(self._receive, update, done, clock)
        return done

    def _receive(self, update: Update, done: Future, clock: dict[str, float]) -> None:
        """Transfer thread: tell our sender to go, receive, hand the outcome to the engine thread."""
        t0 = time.perf_counter()
        try:
            clock["transfer_in"] = time.time()
            self.receiver.signal(update.ready_key, "ok")
            loaded = self._receive_all(update)
            clock["landed"] = time.time()
        except TransferFailedError as e:
            log.error("%s", e)
            if e.nonfinite:  # the trainer's weights are the problem, not the transfer: 400, as a disk load's
                error: BaseException = NonFiniteWeightsError(str(e), e.nonfinite)
            else:
                error = EngineUnavailableError(f"{e}; the weights are marked invalid until a complete update"
                                               if e.loaded else f"{e}; no weight was changed",
                                               code="weight_transfer_failed")
            landed = e.loaded
            self.defer(lambda: self._written(done, landed, error, None))
            return
        except BaseException as e:
            failure = e  # `e` is unbound when the except block ends, before the deferred call runs
            self.defer(lambda: self._written(done, set(), failure, None))
            return
        seconds = time.perf_counter() - t0
        report = {"tensors": len(loaded), "bytes": update.nbytes, "seconds": seconds,
                  "gb_per_s": update.nbytes / seconds / 1e9 if seconds > 0 else None,
                  "timings": self.receiver.last_stats, "clock": clock}
        self.defer(lambda: self._written(done, loaded, None, report))

    def _written(self, done: Future, loaded: set[str], error: BaseException | None, report: dict | None) -> None:
        """Engine thread: close the write, answer the update, then run the finishes that waited for it."""
        waiting, self._after_write = self._after_write or [], None
        if report is not None:
            report["clock"]["closing"] = time.time()
        answer: Any = report
        try:
            if self.core.end_weight_write(loaded, failed=error is not None) is not None:
                answer = self._release(report)  # a one-call session (no start) ended with it
        except BaseException as e:  # a bug: still answer everyone
            error = error or e
        if error is not None:
            done.set_exception(error)
        elif isinstance(answer, Future):  # IPC: once the mapping is closed
            answer.add_done_callback(lambda f: _copy_outcome(f, done))
        else:
            done.set_result(answer)
        for fn in waiting:
            fn(error)

    def start(self) -> dict:
        """Engine thread."""
        return self.core.open_weight_session()

    def finish(self, weight_version: str | None) -> dict | Future:
        """Engine thread. A finish that arrives while an update is being received (a sender that posts
        it as soon as the server said it receives) runs right after that update's write closes; if
        the update failed it fails too and the session stays open (as if it had never been sent)."""
        if self._after_write is None:
            return self._finish(weight_version)
        waited: Future = Future()

        def after(error: BaseException | None) -> None:
            if error is not None:
                waited.set_exception(EngineUnavailableError(
                    f"the update this finish waited for failed ({error}); the session is not finished",
                    code="weight_transfer_failed"))
                return
            try:
                result = self._finish(weight_version)
            except BaseException as e:
                waited.set_exception(e)
                return
            if isinstance(result, Future):
                result.add_done_callback(lambda f: _copy_outcome(f, waited))
            else:
                waited.set_result(result)
        self._after_write.append(after)
        return waited

    def _finish(self, weight_version: str | None) -> dict | Future:
        report = self.core.finish_weight_session(weight_version)
        return self._release(report)

    def _release(self, report: dict | None = None) -> Any:
        """Free what the update held. IPC: the trainer's mapping goes before we answer (its memory is
        the trainer's): the answer is a future resolved on the engine thread once the transfer thread
        has closed it. nccl / gloo: only our bucket buffers' cached memory, freed after the answer (a
        cudaFree waits for the device; the transfer thread runs it before anything queued later)."""
        if self.config.distributed:
            self._thread.submit(lambda: self._on_ranks("wt_finish", self.receiver.finish))
            return report
        released: Future = Future()

        def run() -> None:
            try:
                self.receiver.finish()
            except BaseException as e:
                failure = e  # `e` is unbound when the except block ends
                self.defer(lambda: released.set_exception(failure))
            else:
                self.defer(lambda: released.set_result(report))
        self._thread.submit(run)
        return released

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


def _copy_outcome(src: Future, dst: Future) -> None:
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())
