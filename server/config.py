"""Engine configuration: one dataclass, filled from the CLI, the environment or Python."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device or dtype is resolved: the API process never needs it
    import torch

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


def profiler_dir() -> Path | None:
    """Where traces go, when profiling is enabled (VLLM_TORCH_PROFILER_DIR, as vLLM reads it); else None."""
    value = os.environ.get(PROFILER_DIR_ENV, "").strip()
    return Path(value) if value else None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int | None) -> int | None:
    """'8GiB', '512M', '1073741824' -> bytes (binary units)."""
    if text is None or isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 4GiB, 512MiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


# --dtype's names, by the torch dtype each stands for.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}


@dataclass
class EngineConfig:
    model: str | None = None                  # folder, .gguf file, or None for the embedded default
    device: str = "auto"                      # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                       # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes for the KV cache; default: CPU 1 GiB, GPU from utilization
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"                 # auto | dummy (random weights for the model's config)
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True
    enforce_eager: bool = False               # no CUDA graphs
    # Mixture-of-experts models: every step writes the experts each token was routed to into a device
    # buffer; requests that ask (return_routed_experts) get them with their output (docs/moe.md).
    enable_return_routed_experts: bool = False
    # Launch step t+1 before step t's tokens reach the host, and do t's host work while t+1 runs
    # (server/engine/core.py); on by default: batch 1 1.24x and batch 64 1.36-1.55x faster on an H200, the
    # same tokens. At TP > 1 rank 0 broadcasts each step's sampled tokens to the workers (parallel/runner.py).
    async_scheduling: bool = True
    # A streaming request's outputs every N steps (its first tokens and its end at once), not every step: N
    # tokens a chunk, so the API process frames, writes and wakes for N times fewer chunks; its own cost per
    # chunk is mostly the socket write (docs/measurements.md, "What misses its target"). SGLang's --stream-interval; 1: every token.
    stream_interval: int = 1
    seed: int = 0
    # Every reduction in a fixed order, whatever the batch (server/model/batch_invariant.py): a request's
    # tokens and log-probs are bitwise the same alone or among others, and re-scored as a prompt.
    # None: from VLLM_BATCH_INVARIANT (vLLM's switch), off when unset.
    batch_invariant: bool | None = None
    # Ranks of tensor parallelism: rank 0 runs in the engine's process, the others in worker processes
    # it starts (server/engine/parallel/), one GPU each (gloo on CPU).
    tensor_parallel_size: int = 1
    # What the model's all-reduces run on with tensor parallelism on CUDA: nccl, symm (one-shot on
    # symmetric memory for decode-sized messages, NCCL for larger ones; server/engine/parallel/symm.py)
    # or auto (symm where its start-up probe passes). CPU: always gloo.
    tp_all_reduce: str = "auto"
    # How the ranks start: spawn (rank 0 starts the workers on this machine) or torchrun (torchrun
    # started every rank, on one host or several; server/engine/parallel/launch.py).
    tp_launch: str = "spawn"
    # At TP > 1, a level-1/2 sleep destroys every rank's device communicator (NCCL, ~840 MiB per H200 rank
    # outside the pool) and the decode graphs that captured it; the wake that leaves nothing asleep creates
    # a new one and re-captures the graphs (server/engine/parallel/comm_cycle.py). Off: the wake then costs
    # a communicator start and a graph capture per bucket (an 8B TP=2 wake took 2.5-3.6 s vs 0.3 s, H200).
    tp_release_comm_on_sleep: bool = False
    # At TP > 1 where the NCCL in use has ncclCommSuspend (>= 2.29.7; SLEEPSERVE_NCCL_SO names another
    # libnccl than torch's): auto, a sleep suspends every rank's communicator (its device memory goes, its
    # virtual addresses and the graphs that captured it stay) and the wake resumes it; off, as without it.
    tp_comm_suspend: str = "auto"
    offload_dir: str | None = None            # CPU backend: where offloaded tags are written while asleep
    # Allocate the host backups of level 1 at start-up, in the background: on | off | auto (on where
    # backups are kept between cycles (CUDA) and take at most half of the host memory free at start-up).
    prepare_backups: str = "auto"
    # After a sleep that discarded the KV cache, a wake maps this much of it before it returns and
    # the rest in the background (growing chunks); 0 maps it all before the wake returns.
    kv_wake_chunk: int | str | None = "2GiB"
    # Requests that arrive while paused or asleep (server/api/hold.py): held until the engine can
    # serve, bounded in number and in seconds; or, with "reject", refused at once with 503.
    # Every weight update checks on the device that what landed is finite (NaN/Inf refused with 400, the
    # weights then invalid until a good update: server/model/finite.py); one read of each tensor.
    check_weights_finite: bool = True
    while_asleep: str = "hold"                # hold | reject
    max_held_requests: int = 1024
    held_request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.batch_invariant is None:
            flag = os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower()
            self.batch_invariant = flag in ("1", "true", "yes", "on")
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.kv_wake_chunk = parse_size(self.kv_wake_chunk)
        if self.kv_wake_chunk is None or self.kv_wake_chunk < 0:
            raise ValueError(f"kv_wake_chunk must be a size of 0 or more, got {self.kv_wake_chunk!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 1], got {self.gpu_memory_utilization}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}")
        if self.prepare_backups not in ("auto", "on", "off"):
            raise ValueError(f"prepare_backups must be auto, on or off, got {self.prepare_backups!r}")
        if self.while_asleep not in ("hold", "reject"):
            raise ValueError(f"while_asleep must be hold or reject, got {self.while_asleep!r}")
        if self.max_held_requests < 0:
            raise ValueError(f"max_held_requests must be at least 0, got {self.max_held_requests}")
        if not self.held_request_timeout > 0:
            raise ValueError(f"held_request_timeout must be above 0 seconds, got {self.held_request_timeout}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be from 1 to 64, got {self.tensor_parallel_size}")
        if self.tp_all_reduce not in ("auto", "nccl", "symm"):
            raise ValueError(f"tp_all_reduce must be auto, nccl or symm, got {self.tp_all_reduce!r}")
        if self.tp_comm_suspend not in ("auto", "off"):
            raise ValueError(f"tp_comm_suspend must be auto or off, got {self.tp_comm_suspend!r}")
        if self.tp_launch not in ("spawn", "torchrun"):
            raise ValueError(f"tp_launch must be spawn or torchrun, got {self.tp_launch!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.batch_invariant and self.tp_all_reduce == "symm":
            raise ValueError("--batch-invariant sums the tensor-parallel ranks' parts in rank order (an all-gather "
                             "and a sum), which --tp-all-reduce symm would replace: drop one of the two flags")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but this machine has no usable CUDA device")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        return dev

    def torch_dtype(self, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPES[self.dtype])
        if device.type == "cpu":
            return torch.float32  # bf16 matmuls are slow on most CPUs
        return torch.float16 if checkpoint_dtype in ("float16", "fp16") else torch.bfloat16

    def batched_tokens(self, device: torch.device) -> int:
        return self.max_num_batched_tokens or (512 if device.type == "cpu" else 8192)
