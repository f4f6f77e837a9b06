"""The ranks' groups: a control group for the server's life and the device communicator the model's
collectives run on.

A TCP store hosted by rank 0 outlives everything. The control group (torch.distributed's default
group, gloo, CPU tensors) carries the rare agreements (how many KV blocks every rank holds; whether
every rank re-created its communicator): it holds no device memory. The device communicator (comm.py:
raw NCCL on CUDA, a second gloo group on CPU) holds memory outside the pool (NCCL: ~840 MiB per H200
rank). By default it stays up while the ranks sleep, because the decode graphs captured its
collectives; with --tp-release-comm-on-sleep a sleep takes it down (down()) and the wake creates a new
generation of it (up(), comm_cycle.py). On CUDA the small all-reduces may instead run one-shot on
symmetric memory (symm.py, --tp-all-reduce), with NCCL beside it for the rest. CPU runs the same path
as CUDA.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from server.config import EngineConfig
from server.engine.parallel.comm import DeviceComm, GlooComm, NcclGroupComm
from server.model.config import ModelConfig
from server.model.shard import TensorParallel

log = logging.getLogger("sleepserve.engine")

# A collective waits this long for a slow rank (loading 8B on one rank while the others wait in the
# KV-block agreement takes tens of seconds); a dead rank is noticed at once by the worker monitor.
TIMEOUT = timedelta(seconds=600)


class Group:
    def __init__(self, port: int, rank: int, world: int, device: torch.device, tp: TensorParallel,
                 host: str = "127.0.0.1"):
        self.rank, self.world, self.device, self.tp = rank, world, device, tp
        # Rank 0 hosts the store (port 0: the system picks one, the workers get it at start).
        self.store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=TIMEOUT,
                                   wait_for_workers=False)
        self.port = self.store.port
        self.comm: DeviceComm | None = None
        self.generation = -1  # of the device communicator: each up() makes the next one, on every rank alike
        self.options: dict = {}

    def start(self, all_reduce: str = "nccl", symm_bytes: int = 0, released_on_sleep: bool = False) -> None:
        """Join the control group and create the device communicator (every rank at once).
        all_reduce (CUDA only): nccl, symm (one-shot on symmetric memory up to symm_bytes, NCCL
        beyond; NCCL alone, logged, when the probe fails) or auto (NCCL: on the H200s symm gained nothing
        at batch 1 and lost at batch 64 inside the model, 2026-11-30, though alone it is 2x faster)."""
        dist.init_process_group("gloo", store=dist.PrefixStore("control", self.store), rank=self.rank,
                                world_size=self.world, timeout=TIMEOUT)
        if self.device.type == "cuda":
            # NCCL's NVLS algorithms use NVLink multicast, which this server never turns on.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            if released_on_sleep:
                # Buffers NCCL registers while graphs capture its collectives outlive the communicator's
                # destruction: with registration each release/re-create cycle grew every rank by
                # 136 MiB and gave back 76-212 MiB; without it, 620 MiB back and no growth (2xH200,
                # NCCL 2.28.9, 8B TP=2, 2026-11-30). Read by NCCL at its first communicator.
                os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
        elif all_reduce == "symm" and self.rank == 0:
            log.info("--tp-all-reduce symm is for CUDA; on CPU the all-reduces run on gloo")
        self.options = {"all_reduce": all_reduce, "symm_bytes": symm_bytes}
        self.up()

    def up(self) -> None:
        """Create the next generation of the device communicator: every rank at once (a collective), with
        the same options as the first. Each generation's NCCL unique id has its own key in the store."""
        self.generation += 1
        all_reduce, symm_bytes = self.options["all_reduce"], self.options["symm_bytes"]
        if self.device.type == "cuda":
            comm: DeviceComm = NcclGroupComm(self.store, f"nccl-{self.generation}", self.rank, self.world, self.device)
            if all_reduce == "symm" and symm_bytes > 0:
                from server.engine.parallel.symm import try_symm

                device = self.cuda_device()
                with torch.cuda.device(device):  # rank 0 sets its device only later (build_rank)
                    symm = try_symm(comm, self.rank, self.world, device, symm_bytes,
                                    required=all_reduce == "symm")
                if symm is not None:
                    comm = symm
        else:
            comm = GlooComm()
        self.comm = comm
        self.tp.comm = comm

    def cuda_device(self) -> torch.device:
        """This rank's device with its index ("cuda" alone is the current device)."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index)

    @property
    def all_reduce_name(self) -> str:
        """What the model's all-reduces run on (GET /server_info, per rank)."""
        return getattr(self.comm, "name", "none")

    def state(self) -> dict:
        """This rank's communicator: its generation (a new one after every re-creation), what it runs
        on ("none" while released) and whether it is suspended (its device memory given back)."""
        return {"rank": self.rank, "generation": self.generation, "all_reduce": self.all_reduce_name,
                "suspended": bool(getattr(self.comm, "suspended", False))}

    @property
    def suspendable(self) -> bool:
        return bool(getattr(self.comm, "suspendable", False))

    def suspend(self) -> float:
        """For a sleep: the communicator's device memory goes (NCCL >= 2.29.7), the communicator and the
        decode graphs that captured its collectives stay. Returns the milliseconds it took."""
        t0 = time.perf_counter()
        if self.suspendable and not self.comm.suspended:
            self.comm.suspend()
        return (time.perf_counter() - t0) * 1e3

    def resume(self) -> float:
        """After the wake that leaves nothing asleep (a no-op where this rank is not suspended)."""
        t0 = time.perf_counter()
        if self.suspendable and self.comm.suspended:
            self.comm.resume()
        return (time.perf_counter() - t0) * 1e3

    def down(self) -> None:
        """Release the device communicator (at close, or for a sleep with --tp-release-comm-on-sleep); a
        collective after this raises until the next up(). The graphs that captured its collectives must be
        gone first (worker.drop_graphs)."""
        if self.comm is not None:
            self.tp.comm = None
            comm, self.comm = self.comm, None
            comm.close()

    def abort(self) -> None:
        """A rank died (called from its monitor thread): unblock this rank's collectives on it."""
        comm = self.comm
        if comm is not None:
            comm.abort()

    @staticmethod
    def agree(ok: bool) -> bool:
        """True when every rank says ok (over the control group: gloo, CPU tensors, no device memory)."""
        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def close(self) -> None:
        self.down()
        if dist.is_initialized():
            dist.destroy_process_group()


def comm_options(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> dict:
    """Group.start's arguments from the configuration: the symmetric buffer holds the largest
    decode batch's rows (max_num_seqs x hidden, in the model's dtype)."""
    from server.engine.parallel.symm import buffer_bytes

    if device.type != "cuda":
        return {"all_reduce": config.tp_all_reduce}
    itemsize = config.torch_dtype(device, model_config.torch_dtype).itemsize
    return {"all_reduce": config.tp_all_reduce, "released_on_sleep": config.tp_release_comm_on_sleep,
            "symm_bytes": buffer_bytes(config.tensor_parallel_size, config.max_num_seqs, model_config.hidden_size,
                                       itemsize)}
