"""The rendezvous of vLLM's weight-transfer group: a TCP store that the trainer (rank 0) hosts.

vLLM's trainer helpers bind master_address:master_port, host a torch TCPStore there (libuv off)
and publish the NCCL unique id under `broadcast_from/0/0` as a pickle of its 128 bytes (older
vLLM: of its ctypes struct). The inference workers join the store as clients at
rank_offset + their rank, read the id, and all call ncclCommInitRank. The gloo backend (CPU)
uses the same store for gloo's own rendezvous instead of a unique id.

Our sender also reads one key per update that the server sets before it receives
(`sleepserve/ready/<token>`: "ok" or the error), so a rejected update never leaves the trainer
blocked in a broadcast nobody joins. Trainers that do not know the key are unaffected.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from server.weight_transfer import safe_pickle

UNIQUE_ID_KEY = "broadcast_from/0/0"
READY_PREFIX = "sleepserve/ready/"


def host_store(address: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's side: listen on address:port and serve the store. Returns once every rank joined
    (so the others must be asked to join first: post the init before calling this)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen()
        store = dist.TCPStore(address, port, world_size, True, timedelta(seconds=timeout_s), use_libuv=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        try:
            sock.close()
        except OSError:  # the store already closed the listening socket
            pass
        raise
    sock.detach()  # the store owns the listening socket now
    return store


def join_store(address: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A worker's side: connect to the trainer's store (waits for it up to timeout_s)."""
    return dist.TCPStore(address, port, world_size, False, timedelta(seconds=timeout_s), use_libuv=False)


def read_unique_id(store: dist.TCPStore) -> bytes:
    """The NCCL unique id rank 0 published, as 128 raw bytes, whichever way vLLM pickled it."""
    obj: Any = safe_pickle.loads(store.get(UNIQUE_ID_KEY))
    if isinstance(obj, safe_pickle.NcclUniqueId):
        obj = bytes(obj)
    if not isinstance(obj, (bytes, bytearray)) or len(obj) != 128:
        raise ValueError("the NCCL unique id in the rendezvous store is not 128 bytes")
    return bytes(obj)


def publish_unique_id(store: dist.TCPStore, unique_id: bytes) -> None:
    import pickle
    store.set(UNIQUE_ID_KEY, pickle.dumps(unique_id))


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
