"""Tensor parallelism under torchrun (`--tp-launch torchrun`): how a rank learns its place from the
environment torchrun sets, and where the ranks meet.

The server never spawns the workers then: torchrun starts one `python -m server serve ...` per rank
on every host; RANK 0 serves the API (its engine process is rank 0 of the group) and every other RANK
joins it as a worker (worker.py, the same code as a spawned worker). The launch is chosen by a flag,
not guessed from the environment, because a trainer run under torchrun that starts a server as a
subprocess hands it RANK and WORLD_SIZE too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

KEY_ENV = "SLEEPSERVE_TP_KEY"    # the shared secret every host sets: a worker that knows it may join
PORT_ENV = "SLEEPSERVE_TP_PORT"  # rank 0's listener for the workers (default MASTER_PORT + 1)
_NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunPlace:
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    port: int   # rank 0's listener
    key: bytes

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.port}"


def torchrun_place(tensor_parallel_size: int, env: dict[str, str] | None = None) -> TorchrunPlace:
    """This process's place from torchrun's variables; ValueError naming what is missing or wrong."""
    env = dict(os.environ) if env is None else env
    missing = [name for name in _NEEDED if not env.get(name)]
    if missing:
        raise ValueError(f"--tp-launch torchrun: {', '.join(missing)} not set; start the server with "
                         "`torchrun --nnodes M --nproc-per-node K ... -m server serve ...`")
    try:
        rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        local_world = int(env.get("LOCAL_WORLD_SIZE") or world)
        port = int(env.get(PORT_ENV) or int(env["MASTER_PORT"]) + 1)
    except ValueError as e:
        raise ValueError(f"--tp-launch torchrun: a torchrun variable is not a number ({e})") from None
    if world != tensor_parallel_size:
        raise ValueError(f"--tp-launch torchrun: torchrun started {world} processes (WORLD_SIZE) but "
                         f"--tensor-parallel-size is {tensor_parallel_size}; they must be equal")
    if world < 2:
        raise ValueError("--tp-launch torchrun needs --tensor-parallel-size 2 or more")
    if not 0 < port < 65536:
        raise ValueError(f"--tp-launch torchrun: port {port} for rank 0's listener is out of range ({PORT_ENV})")
    key = env.get(KEY_ENV, "")
    if len(key) < 16:
        raise ValueError(f"--tp-launch torchrun: set {KEY_ENV} to the same secret of at least 16 characters on "
                         "every host (it authenticates the workers that join rank 0; anyone who has it can "
                         "run code in the server)")
    return TorchrunPlace(rank, world, local_rank, local_world, env["MASTER_ADDR"], port, key.encode())
