"""GET /server_info (dev mode): the resolved configuration, in our shape and in vLLM's.

Our fields stay at the top level, where they always were. Beside them, vLLM's three keys:
`vllm_config` (its VllmConfig sections, with the values this server runs with), `vllm_env` (the
VLLM_* and SLEEPSERVE_* variables this process sees, keys and tokens left out) and `system_env`.
TRL's VLLMClient reads `vllm_config` (GET /server_info?config_format=json), and `init_communicator`
refuses to start unless `vllm_config["weight_transfer_config"]` is set. `config_format=text` (vLLM's
default) gives `vllm_config` as one string, as vLLM prints it.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, is_dataclass
from typing import Any, Literal

from fastapi import Request

from server import __version__

ConfigFormat = Literal["text", "json"]
# What the log-probs are: log_softmax of the logits before temperature and top-k/top-p (vLLM's
# default, raw_logprobs); TRL warns that its importance-sampling correction wants processed ones.
LOGPROBS_MODE = "raw_logprobs"
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def server_info(request: Request, config_format: ConfigFormat) -> dict[str, Any]:
    engine = request.app.state.engine
    info = engine.info
    settings = request.app.state.settings
    transfer = transfer_config(request)
    vllm = vllm_config(request, transfer)
    return {
        "version": __version__,
        "model": {"served_model_name": info.served_model_name, "path": info.model_path,
                  "model_type": info.model_type, "dtype": info.dtype,
                  "max_model_len": info.max_model_len, "vocab_size": info.vocab_size},
        "device": info.device,
        "engine_config": asdict(info.config),
        "batch_invariant": bool(info.config.batch_invariant),
        "kv_cache": {"num_blocks": info.kv_plan.num_blocks - 1, "block_size": info.kv_plan.block_size,
                     "bytes": info.kv_plan.bytes, "capacity_tokens": info.kv_plan.capacity_tokens},
        "processes": {"api_pid": os.getpid(), "engine_pid": info.pid,
                      "api_server_count": settings.api_server_count},
        "server": {"host": settings.host, "port": settings.port, "dev_mode": settings.dev_mode,
                   "api_key_set": settings.api_key is not None,
                   "admin_api_key_set": settings.effective_admin_key is not None,
                   "log_level": settings.log_level},
        "world_size": info.config.tensor_parallel_size,
        "tensor_parallel": {"size": info.config.tensor_parallel_size, "ranks": info.ranks},
        "weight_transfer_config": transfer,
        "weight_version": engine.state.weight_version,
        "vllm_config": vllm if config_format == "json" else _as_text(vllm),
        "vllm_env": _env(),
        "system_env": _system(),
    }


def transfer_config(request: Request) -> dict[str, Any] | None:
    """--weight-transfer-config as resolved; null when the server was started without one."""
    config = getattr(request.app.state, "weight_transfer", None)
    if config is None:
        return None
    return asdict(config) if is_dataclass(config) else dict(vars(config))


def vllm_config(request: Request, transfer: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's VllmConfig sections, filled with what this server runs: the keys its clients read."""
    info = request.app.state.engine.info
    config, plan = info.config, info.kv_plan
    return {
        "model_config": {"model": info.model_path, "served_model_name": info.served_model_name,
                         "model_type": info.model_type, "dtype": info.dtype, "max_model_len": info.max_model_len,
                         "vocab_size": info.vocab_size, "seed": config.seed, "logprobs_mode": LOGPROBS_MODE,
                         "enforce_eager": config.enforce_eager, "enable_sleep_mode": config.enable_sleep_mode},
        "cache_config": {"block_size": plan.block_size, "num_gpu_blocks": plan.usable_blocks,
                         "kv_cache_size_tokens": plan.capacity_tokens,
                         "kv_cache_max_concurrency": plan.capacity_tokens / info.max_model_len,
                         "gpu_memory_utilization": config.gpu_memory_utilization,
                         "enable_prefix_caching": config.enable_prefix_caching, "cache_dtype": "auto"},
        "parallel_config": {"tensor_parallel_size": config.tensor_parallel_size, "pipeline_parallel_size": 1,
                            "data_parallel_size": 1, "world_size": config.tensor_parallel_size},
        "scheduler_config": {"max_num_seqs": config.max_num_seqs,
                             "max_num_batched_tokens": config.max_num_batched_tokens,
                             "async_scheduling": config.async_scheduling},
        "device_config": {"device": info.device_type},
        "load_config": {"load_format": config.load_format},
        "lora_config": None,
        "weight_transfer_config": transfer,
    }


def _as_text(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def _env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("VLLM_", "SLEEPSERVE_")) and not any(w in k for w in _SECRET_WORDS)}


def _system() -> dict[str, Any]:
    # Read from the installed metadata: the API process never imports torch for this.
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version: str | None = version("torch")
    except PackageNotFoundError:
        torch_version = None
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch": torch_version}
