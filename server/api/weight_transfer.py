"""Weight-transfer routes (dev mode, admin key): vLLM's API and SGLang-style aliases.

vLLM: POST /init_weight_transfer_engine, /start_weight_update, /update_weights {"update_info"}
(admin.py hands that body here; {"path"} stays a disk load), /finish_weight_update.
SGLang-style: /init_weights_update_group, /update_weights_from_distributed, /update_weights_from_tensor,
/update_weights_from_disk, /release_memory_occupation, /resume_memory_occupation, /get_weight_version.

The receiver runs in the engine process (server/engine/transfer_service.py): it writes the model's
tensors, and CUDA IPC handles can only be opened where the CUDA context is. These routes parse the
bodies and forward them as engine commands; the event loop stays free (/health answers during a
transfer).
"""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field, ValidationError

from server.api.auth import require_admin_key
from server.api.body import parse_body, read_json
from server.api.validation import describe_validation_error
from server.api.disk_weights import load_from_disk
from server.api.errors import APIError
from server.api.schemas import RequestBody

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
    # Ours (WeightSender's): open the session first, as POST /start_weight_update would, in this call.
    sleepserve_start_session: bool = False


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


# -- the engine's transfer commands -------------------------------------------------------------

def service(request: Request) -> Any:
    """The engine client, once we know this server has a weight-transfer backend (its config)."""
    if getattr(request.app.state, "weight_transfer", None) is None:
        raise APIError(400, "this server has no weight-transfer engine; start it with --weight-transfer-config "
                            "'{\"backend\": \"nccl\"}' (or ipc; gloo / shm on CPU)", None,
                       "weight_transfer_not_configured")
    return request.app.state.engine


async def _init(request: Request, info: InitInfo) -> dict:
    return await service(request).transfer_init(info.master_address, info.master_port, info.rank_offset,
                                                 info.world_size, info.packed)


async def _update(request: Request, info: UpdateInfo) -> dict:
    """Checked, received and written in the engine process; the engine finishes the write even if
    this client goes away."""
    engine = service(request)
    api_in = time.time()
    report = await engine.transfer_update(info.model_dump())
    state = engine.state
    if "clock" in report:  # wall-clock times of the update's stages, for bench/weight_transfer.py
        report["clock"].update(api_in=api_in, api_out=time.time())
    return {**report, "weights_valid": state.weights_valid, "weight_version": state.weight_version,
            "state": state.as_dict()}


async def _finish(request: Request, weight_version: str | None) -> dict:
    engine = service(request)
    report = await engine.transfer_finish(weight_version)
    return {**report, "state": engine.state.as_dict()}


async def update_weights_from_body(request: Request, data: dict) -> dict:
    """POST /update_weights with vLLM's {"update_info": ...} (admin.py routes {"path"} bodies to disk)."""
    service(request)
    try:
        body = UpdateRequest.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation_error(e.errors(include_url=False))
        raise APIError(400, message, param) from None
    return await _update(request, body.update_info)


# -- vLLM's routes -------------------------------------------------------------------------------

@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
    body = await parse_body(request, InitRequest, allow_empty=True)
    return await _init(request, body.init_info)


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict[str, Any]:
    await read_json(request, allow_empty=True)  # vLLM's {"is_checkpoint_format": true} changes nothing here
    report = await service(request).transfer_start()
    return {**report, "state": request.app.state.engine.state.as_dict()}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict[str, Any]:
    body = await parse_body(request, FinishRequest, allow_empty=True)
    return await _finish(request, body.weight_version)


# -- SGLang-style routes: the same calls under SGLang's names and fields --------------------------

def _sgl(ok: bool, message: str, **extra: Any) -> dict[str, Any]:
    return {"success": ok, "message": message, **extra}


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> dict[str, Any]:
    body = await parse_body(request, SglInitGroup)
    service(request)
    backend = request.app.state.weight_transfer.backend
    if body.backend not in (backend, "nccl" if backend == "gloo" else backend):
        raise APIError(400, f"this server's weight-transfer backend is {backend!r}, not {body.backend!r}", "backend")
    report = await _init(request, InitInfo(master_address=body.master_address, master_port=body.master_port,
                                           rank_offset=body.rank_offset, world_size=body.world_size))
    return _sgl(True, f"joined {body.group_name} as rank {body.rank_offset}", **report)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
    body = await parse_body(request, SglUpdateDistributed)
    await service(request).transfer_start()
    report = await _update(request, UpdateInfo(names=body.names, dtype_names=body.dtypes, shapes=body.shapes,
                                               packed=False))
    report = {**report, **await _finish(request, body.weight_version)}
    return _sgl(True, f"updated {report['tensors']} tensors", **report)


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> dict[str, Any]:
    """One base64 pickle per rank of [(name, tensor), ...] whose tensors are CUDA IPC-shared (torch's
    reduction); read with the restricted unpickler, copied in, released before the answer."""
    body = await parse_body(request, SglUpdateTensor)
    # The engine checks the device first (CPU: 400), then that a transfer backend is configured.
    report = await request.app.state.engine.update_from_tensor(body.serialized_named_tensors[0],
                                                               body.weight_version)
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

