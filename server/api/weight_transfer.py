"""Weight-transfer routes (dev mode, admin key): vLLM's API and SGLang-style aliases.

vLLM: POST /init_weight_transfer_engine, /start_weight_update, /update_weights {"update_info"}
(admin.py hands that body here; {"path"} stays a disk load), /finish_weight_update.
SGLang-style: /init_weights_update_group, /update_weights_from_distributed, /update_weights_from_tensor,
/update_weights_from_disk, /release_memory_occupation, /resume_memory_occupation, /get_weight_version.

Everything that blocks (rendezvous, receives, copies) runs on one transfer thread; the engine's
weight_session functions bracket each write on the engine thread, so no step ever runs on
half-written weights and the event loop stays free (/health answers during a transfer).
"""
from __future__ import annotations

import asyncio
import logging
import time
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from fastapi import APIRouter, Depends, Request
from pydantic import Field, ValidationError

from server.api.auth import require_admin_key
from server.api.body import describe_validation_error, parse_body, read_json
from server.api.disk_weights import load_from_disk
from server.api.errors import APIError
from server.api.schemas import RequestBody
from server.engine import weight_session
from server.weight_transfer import safe_pickle
from server.weight_transfer.config import WeightTransferConfig
from server.weight_transfer.receiver import TransferFailedError, TransferRequestError, Update, WeightReceiver

log = logging.getLogger("sleepserve.weights")
router = APIRouter(dependencies=[Depends(require_admin_key)], tags=["weight transfer"])


# -- bodies ------------------------------------------------------------------------------------

class InitInfo(RequestBody):
    master_address: str = "127.0.0.1"
    master_port: int = Field(0, ge=0, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(2, ge=2)
    packed: bool | None = None


class InitRequest(RequestBody):
    init_info: InitInfo = Field(default_factory=InitInfo)


class UpdateInfo(RequestBody):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = Field(None, ge=1)
    packed_num_buffers: int | None = Field(None, ge=1)
    ipc_handles: Any = None
    ipc_handles_pickled: str | None = None
    tensor_sizes: list[int] | None = None
    sleepserve_ready_key: str | None = Field(None, max_length=200)


class UpdateRequest(RequestBody):
    update_info: UpdateInfo  # weight_version is set by /finish_weight_update


class FinishRequest(RequestBody):
    weight_version: str | None = None


class SglInitGroup(RequestBody):
    master_address: str
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(..., ge=1)
    world_size: int = Field(..., ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class SglUpdateDistributed(RequestBody):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None


class SglUpdateTensor(RequestBody):
    serialized_named_tensors: list[str] = Field(..., min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None


class SglUpdateDisk(RequestBody):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None


class SglMemory(RequestBody):
    tags: list[str] | None = None


# -- the service ---------------------------------------------------------------------------------

class _Worker:
    """One daemon thread that runs submitted calls in order (transfers are one at a time)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="sleepserve-weights", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._calls.put((fut, fn, args))
        return fut

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


class WeightTransferService:
    """Owns the receiver and the one thread that blocks on transfers."""

    def __init__(self, engine: Any, config: WeightTransferConfig):
        self.engine = engine
        self.config = config
        self.receiver = WeightReceiver(config, engine.core.model, engine.core.device)
        self._thread = _Worker()
        self.init_info: InitInfo | None = None

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._thread.submit(fn, *args))

    def shutdown(self) -> None:
        # Not joined: a receive may be blocked on a trainer for up to timeout_s, and shutting down
        # must not wait for it (the thread is a daemon).
        self._thread.submit(self.receiver.close)
        self._thread.stop()

    async def init(self, info: InitInfo) -> dict:
        if info.rank_offset >= info.world_size:
            raise APIError(400, f"rank_offset {info.rank_offset} must be below world_size {info.world_size} "
                                "(the trainer is rank 0, this server joins at rank_offset)", "init_info.rank_offset")
        if self.config.distributed and info.master_port == 0:
            raise APIError(400, "master_port is required for the nccl/gloo backends", "init_info.master_port")
        try:
            report = await self.off_loop(self.receiver.init, info.master_address, info.master_port,
                                         info.rank_offset, info.world_size)
        except TransferFailedError as e:
            raise APIError(400, str(e), "init_info", "weight_transfer_init_failed") from None
        self.init_info = info
        return report

    def _update(self, info: UpdateInfo) -> Update:
        metas = self.receiver.check(info.names, info.dtype_names, info.shapes)
        handles = info.ipc_handles
        if info.ipc_handles_pickled is not None:
            if handles is not None:
                raise TransferRequestError("send ipc_handles or ipc_handles_pickled, not both")
            try:
                handles = safe_pickle.loads_b64(info.ipc_handles_pickled)
            except safe_pickle.UnsafePickleError as e:
                raise TransferRequestError(f"ipc_handles_pickled: {e}", "update_info.ipc_handles_pickled") from None
        if self.config.distributed:
            packed = info.packed if info.packed is not None else bool(self.init_info and self.init_info.packed)
        else:
            packed = not isinstance(handles, list) if info.packed is None else info.packed
        update = Update(metas=metas, packed=packed,
                        bucket_bytes=info.packed_buffer_size_bytes or self.config.packed_buffer_size_bytes,
                        handles=handles, tensor_sizes=info.tensor_sizes, ready_key=info.sleepserve_ready_key)
        self.receiver.check_handles(update)
        return update

    async def update(self, info: UpdateInfo) -> dict:
        """Check, stop stepping, receive on the transfer thread, record what landed."""
        engine = self.engine
        try:
            update = self._update(info)
            await engine.call(weight_session.begin_write)
        except TransferRequestError as e:
            await self.off_loop(self.receiver.signal, info.sleepserve_ready_key, f"error: {e}")
            raise APIError(400, str(e), e.param, "weight_mismatch") from None
        except Exception as e:
            await self.off_loop(self.receiver.signal, info.sleepserve_ready_key, f"error: {e}")
            raise
        # From here on the write must be closed on the engine even if the client goes away.
        return await asyncio.shield(asyncio.ensure_future(self._write(update)))

    async def _write(self, update: Update) -> dict:
        t0 = time.perf_counter()
        try:
            await self.off_loop(self.receiver.signal, update.ready_key, "ok")
            loaded = await self.off_loop(self.receiver.receive, update)
        except TransferFailedError as e:
            await self.engine.call(lambda core: weight_session.end_write(core, e.loaded, failed=True))
            log.error("%s", e)
            raise APIError(503, f"{e}; the weights are marked invalid until a complete update" if e.loaded else
                           f"{e}; no weight was changed", "update_info", "weight_transfer_failed") from None
        except BaseException:
            await self.engine.call(lambda core: weight_session.end_write(core, set(), failed=True))
            raise
        seconds = time.perf_counter() - t0
        finished = await self.engine.call(lambda core: weight_session.end_write(core, loaded, failed=False))
        if finished is not None:
            await self.off_loop(self.receiver.finish)
        return {"tensors": len(loaded), "bytes": update.nbytes, "seconds": seconds,
                "gb_per_s": update.nbytes / seconds / 1e9 if seconds > 0 else None,
                "weights_valid": self.engine.state.weights_valid,
                "weight_version": self.engine.state.weight_version, "state": self.engine.state.as_dict()}

    async def start(self) -> dict:
        return await self.engine.call(weight_session.start)

    async def finish(self, weight_version: str | None) -> dict:
        report = await self.engine.call(lambda core: weight_session.finish(core, weight_version))
        await self.off_loop(self.receiver.finish)
        return {**report, "state": self.engine.state.as_dict()}


def service(request: Request) -> WeightTransferService:
    svc = getattr(request.app.state, "weight_transfer", None)
    if svc is None:
        raise APIError(400, "this server has no weight-transfer engine; start it with --weight-transfer-config "
                            "'{\"backend\": \"nccl\"}' (or ipc; gloo / shm on CPU)", None,
                       "weight_transfer_not_configured")
    return svc


async def update_weights_from_body(request: Request, data: dict) -> dict:
    """POST /update_weights with vLLM's {"update_info": ...} (admin.py routes {"path"} bodies to disk)."""
    svc = service(request)
    try:
        body = UpdateRequest.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation_error(e.errors(include_url=False))
        raise APIError(400, message, param) from None
    return await svc.update(body.update_info)


# -- vLLM's routes -------------------------------------------------------------------------------

@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
    body = await parse_body(request, InitRequest, allow_empty=True)
    return await service(request).init(body.init_info)


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict[str, Any]:
    await read_json(request, allow_empty=True)  # vLLM's {"is_checkpoint_format": true} changes nothing here
    return {**await service(request).start(), "state": request.app.state.engine.state.as_dict()}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict[str, Any]:
    body = await parse_body(request, FinishRequest, allow_empty=True)
    return await service(request).finish(body.weight_version)


# -- SGLang-style routes: the same calls under SGLang's names and fields --------------------------

def _sgl(ok: bool, message: str, **extra: Any) -> dict[str, Any]:
    return {"success": ok, "message": message, **extra}


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> dict[str, Any]:
    body = await parse_body(request, SglInitGroup)
    svc = service(request)
    if body.backend not in (svc.config.backend, "nccl" if svc.config.backend == "gloo" else svc.config.backend):
        raise APIError(400, f"this server's weight-transfer backend is {svc.config.backend!r}, not {body.backend!r}",
                       "backend")
    report = await svc.init(InitInfo(master_address=body.master_address, master_port=body.master_port,
                                     rank_offset=body.rank_offset, world_size=body.world_size))
    return _sgl(True, f"joined {body.group_name} as rank {body.rank_offset}", **report)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
    body = await parse_body(request, SglUpdateDistributed)
    svc = service(request)
    await svc.start()
    report = await svc.update(UpdateInfo(names=body.names, dtype_names=body.dtypes, shapes=body.shapes,
                                         packed=False))
    report = {**report, **await svc.finish(body.weight_version)}
    return _sgl(True, f"updated {report['tensors']} tensors", **report)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> dict[str, Any]:
    """One base64 pickle per rank of [(name, tensor), ...] whose tensors are CUDA IPC-shared (torch's
    reduction); read with the restricted unpickler, copied in, released before the answer."""
    body = await parse_body(request, SglUpdateTensor)
    engine = request.app.state.engine
    if engine.core.device.type != "cuda":
        raise APIError(400, "update_weights_from_tensor carries CUDA IPC tensors; on CPU use the shm backend "
                            "through /update_weights", "serialized_named_tensors")
    try:
        named = safe_pickle.loads_b64(body.serialized_named_tensors[0])
        named = list(named.items()) if isinstance(named, dict) else list(named)
        names = [str(n) for n, _ in named]
        tensors = [t for _, t in named]
    except (safe_pickle.UnsafePickleError, TypeError, ValueError) as e:
        raise APIError(400, f"serialized_named_tensors[0]: {e}", "serialized_named_tensors") from None
    svc = service(request)
    try:
        svc.receiver.check(names, [str(t.dtype) for t in tensors], [list(t.shape) for t in tensors])
    except TransferRequestError as e:
        raise APIError(400, str(e), "serialized_named_tensors", "weight_mismatch") from None
    report = await engine.call(lambda core: core.update_weights(named_tensors=named,
                                                                weight_version=body.weight_version))
    del named, tensors
    return _sgl(True, f"updated {report['tensors']} tensors", **report)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> dict[str, Any]:
    body = await parse_body(request, SglUpdateDisk)
    report = await load_from_disk(request, body.model_path, body.weight_version)
    return _sgl(True, f"loaded {report['tensors']} tensors from {body.model_path}", **report)


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request) -> dict[str, Any]:
    """SGLang releases without a CPU copy: that is sleep level 2 (weights come back by an update)."""
    body = await parse_body(request, SglMemory, allow_empty=True)
    engine = request.app.state.engine
    report = await engine.sleep(level=2, tags=body.tags, mode="abort")
    return _sgl(True, "released", **report.as_dict(), state=engine.state.as_dict())


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request) -> dict[str, Any]:
    body = await parse_body(request, SglMemory, allow_empty=True)
    engine = request.app.state.engine
    report = await engine.wake_up(body.tags)
    return _sgl(True, "resumed", **report.as_dict(), state=engine.state.as_dict())


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    return {"weight_version": request.app.state.engine.state.weight_version}

