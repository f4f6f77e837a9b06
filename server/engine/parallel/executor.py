"""Rank 0's side of tensor parallelism: it starts the worker processes (ranks 1..N-1), talks to each
over one pipe, hosts the group's store, and watches that every worker lives.

Everything the engine core asks goes through two facades built here, so the core has no tensor-
parallel branch: ParallelRunner (runner.py: each step's inputs to every rank, weights loaded on every
rank) and ParallelPool (pool.py: sleep and wake on every rank, all or nothing).
"""
from __future__ import annotations

import logging
import os
import multiprocessing as mp
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, Callable

import torch

from server.config import EngineConfig
from server.wire.errors import WorkerLostError
from server.engine.parallel.group import TIMEOUT, Group
from server.engine.parallel.steps import no_delay
from server.model.config import ModelConfig
from server.model.shard import TensorParallel

log = logging.getLogger("sleepserve.engine")

Outcome = Any  # a command's result on one rank, or the exception it raised there


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Spawned:
    """A worker that rank 0 started (--tp-launch spawn): its liveness is its child process's."""

    def __init__(self, rank: int, proc: subprocess.Popen):
        self.rank, self.proc = rank, proc

    def wait(self) -> str:
        """Block until the worker is gone; how it went."""
        return self.describe(self.proc.wait())

    def ended(self) -> bool:
        return self.proc.poll() is not None

    def describe(self, code: int | None = None) -> str:
        code = self.proc.returncode if code is None else code
        return f"tensor-parallel worker rank {self.rank} (pid {self.proc.pid}) {_describe_exit(code)}"

    def join(self, seconds: float) -> bool:
        try:
            self.proc.wait(seconds)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


class Remote:
    """A worker that torchrun started (--tp-launch torchrun), maybe on another host: rank 0 knows it
    only by a second connection that the worker opens and never writes to. Its end of file is the
    worker's end (the process exited, whatever killed it); TCP keepalive turns a host that vanished
    without closing the socket into the same end within about 25 s."""

    def __init__(self, rank: int, pid: int, host: str, alive: Connection):
        self.rank, self.pid, self.host, self.alive = rank, pid, host, alive
        self._gone = threading.Event()
        _keepalive(alive)

    def wait(self) -> str:
        try:
            while True:
                self.alive.recv()  # nothing is ever sent: this returns only when the connection ends
        except (EOFError, OSError):
            pass
        self._gone.set()
        return self.describe()

    def ended(self) -> bool:
        return self._gone.is_set()

    def describe(self, code: int | None = None) -> str:
        return (f"tensor-parallel worker rank {self.rank} (pid {self.pid} on {self.host}) closed its connection "
                "(its process ended or its host became unreachable)")

    def join(self, seconds: float) -> bool:
        return self._gone.wait(seconds)

    def kill(self) -> None:
        """Rank 0 cannot signal another host: ending the connection makes the worker exit (worker.py).
        shutdown, not only close: the monitor thread's recv holds the socket open past a close."""
        try:
            with socket.socket(fileno=os.dup(self.alive.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.alive.close()
        except OSError:
            pass


def _keepalive(conn: Connection) -> None:
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket, another descriptor
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Workers:
    """The worker processes of ranks 1..N-1 and rank 0's group membership.

    --tp-launch spawn: workers are new interpreters (`python -m server.engine.parallel.worker`), not
    multiprocessing children: nothing of the embedding program (its __main__, a notebook, pytest) is
    re-imported, and no CUDA context is ever forked. Each connects back to a loopback listener of rank 0
    with a random key. --tp-launch torchrun: torchrun started them (launch.py); rank 0 listens on every
    interface at MASTER_PORT + 1 and each worker joins with the key of SLEEPSERVE_TP_KEY, opening a
    second connection that says it lives. Everything after the joining is the same."""

    def __init__(self, config: EngineConfig, world: int, tp: TensorParallel):
        self.world = world
        from server.engine.rank import rank_device

        self.group = Group(0, 0, world, rank_device(config, 0), tp)
        self.conns: dict[int, Connection] = {}
        self.peers: dict[int, Spawned | Remote] = {}
        self.lost: WorkerLostError | None = None
        self.infos: list[dict] = []  # each worker's rank, pid and device, once it is ready
        self.listeners: list[Callable[[BaseException], None]] = []
        self.before_down: list[Callable[[], None]] = []  # run on rank 0 before its communicator goes
        self._closing = False
        self._exited = threading.Event()
        # One request-and-answer exchange at a time: the engine thread (sleep, wake, stats) and the
        # weight-transfer thread (a receive on every rank) both ask the workers, and each answer must
        # reach the thread that asked. Steps are sent without an answer and need no lock.
        self._exchange = threading.RLock()
        # The process key of rank 0: torch shares CPU tensors (weights sent to a worker) through
        # multiprocessing's resource sharer, which authenticates with it; every worker gets it.
        process_key = bytes(mp.current_process().authkey)
        level = logging.getLogger("sleepserve").getEffectiveLevel()
        if config.tp_launch == "torchrun":
            from server.engine.parallel.launch import torchrun_place

            place = torchrun_place(world)
            address, key = ("", place.port), place.key  # "": every interface, for workers on other hosts
            log.info("tensor parallelism under torchrun: waiting for %d workers on port %d", world - 1, place.port)
        else:
            address, key = ("127.0.0.1", 0), process_key
        alive: dict[int, tuple[Connection, int, str]] = {}
        try:
            listener = Listener(address, authkey=key)
        except OSError as e:
            raise ValueError(f"tensor parallelism cannot listen for its workers on port {address[1]}: {e} "
                             "(under torchrun: MASTER_PORT + 1, or SLEEPSERVE_TP_PORT)") from e
        with listener:
            if config.tp_launch == "spawn":
                self._spawn(world, listener, key)
            expected = (world - 1) * (2 if config.tp_launch == "torchrun" else 1)
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            while len(self.conns) + len(alive) < expected:
                conn = self._accept(listener, deadline, expected - len(self.conns) - len(alive))
                rank, role, pid, host = conn.recv()
                if not isinstance(rank, int) or not 0 < rank < world or rank in (alive if role == "alive" else self.conns):
                    conn.close()
                    self._kill_all()
                    raise ValueError(f"a tensor-parallel worker joined as rank {rank!r} ({role}); expected each of "
                                     f"1..{world - 1} once (is another server using this port?)")
                if role == "alive":
                    alive[rank] = (conn, pid, host)
                    continue
                conn.send((config, world, self.group.port, level, process_key))
                self.conns[rank] = conn
        for rank, (conn, pid, host) in alive.items():
            self.peers[rank] = Remote(rank, pid, host, conn)
        for rank, peer in self.peers.items():
            threading.Thread(target=self._watch, args=(rank, peer), name=f"sleepserve-tp{rank}-monitor",
                             daemon=True).start()

    def _spawn(self, world: int, listener: Listener, key: bytes) -> None:
        env = {**os.environ, "SLEEPSERVE_TP_KEY": key.hex(), "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[3]), *filter(None, [os.environ.get("PYTHONPATH")])])}
        # NVLink multicast stays off in the workers too (NCCL's NVLS, symmetric memory's
        # multicast object): the caller's values pass through, absent ones are set.
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        for rank in range(1, world):
            cmd = [sys.executable, "-m", "server.engine.parallel.worker", str(rank),
                   f"{listener.address[0]}:{listener.address[1]}"]
            self.peers[rank] = Spawned(rank, subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))

    def _accept(self, listener: Listener, deadline: float, missing: int) -> Connection:
        """The next worker's connection; a spawned worker that died before connecting fails the start
        at once, and so does a wait past the deadline (torchrun: a worker that never came)."""
        sock = listener._listener._socket  # type: ignore[attr-defined]
        sock.settimeout(0.5)
        while True:
            dead = [(r, p) for r, p in self.peers.items() if p.ended()]
            if dead:
                self._kill_all()
                raise ValueError(f"{dead[0][1].describe()} before it connected (its error is in the log above)")
            if time.monotonic() > deadline:
                self._kill_all()
                raise ValueError(f"{missing} tensor-parallel connection(s) never came in "
                                 f"{TIMEOUT.total_seconds():.0f} s")
            try:
                return no_delay(listener.accept())
            except (TimeoutError, socket.timeout):
                continue
            except mp.AuthenticationError as e:  # a stray client, or a worker with another key
                log.warning("a connection to the tensor-parallel listener was refused: %s", e)

    # -- liveness ----------------------------------------------------------------------------------

    def _watch(self, rank: int, peer: Spawned | Remote) -> None:
        how = peer.wait()
        self._exited.set()
        if self._closing or self.lost is not None:
            return
        self.lost = WorkerLostError(f"{how}; the {self.world} ranks cannot run without it")
        log.critical("%s: the engine stops", self.lost)
        # Rank 0 may be inside a collective that waits for the dead rank (during the start: the memory
        # plan's forward, a graph capture): end it so the error reaches rank 0's caller, not a hang.
        try:
            self.group.abort()
        except Exception:
            log.exception("aborting the device communicator failed")
        for fn in list(self.listeners):
            try:
                fn(self.lost)
            except Exception:
                log.exception("a worker-lost listener failed")

    def check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def explain(self, error: BaseException) -> BaseException:
        """A collective that failed because a rank died is reported as that rank's death."""
        self._exited.wait(1.0)
        for peer in self.peers.values():
            if peer.ended():
                return self.lost or WorkerLostError(peer.describe())
        return error

    # -- the channel -------------------------------------------------------------------------------

    def send_all(self, op: str, arg: Any = None, args: dict[int, Any] | None = None) -> None:
        """One message to every worker (`args`: a different argument per rank)."""
        self.check()
        for rank, conn in self.conns.items():
            try:
                conn.send((op, args[rank] if args is not None else arg))
            except (BrokenPipeError, ConnectionError, OSError) as e:
                raise self.explain(e) from e

    def send_one(self, rank: int, op: str, arg: Any = None) -> Any:
        """One command to one worker; its result, or its exception raised here."""
        self.check()
        with self._exchange:
            try:
                self.conns[rank].send((op, arg))
            except (BrokenPipeError, ConnectionError, OSError) as e:
                raise self.explain(e) from e
            value = self._recv(rank)
        if isinstance(value, BaseException):
            raise value
        return value

    def _recv(self, rank: int) -> Outcome:
        conn, peer = self.conns[rank], self.peers[rank]
        while not conn.poll(0.5):
            if peer.ended():
                raise self.explain(EOFError(f"rank {rank} closed its pipe"))
        try:
            status, value = conn.recv()
        except (EOFError, OSError) as e:
            raise self.explain(e) from e
        return value if status == "ok" else value if isinstance(value, BaseException) else RuntimeError(value)

    def run(self, op: str, arg: Any, local: Callable[[], Any], args: dict[int, Any] | None = None
            ) -> dict[int, Outcome]:
        """The command on every worker and `local()` on rank 0 at the same time (commands such as the
        group's rendezvous need every rank at once). Returns each rank's result or exception; raises
        only when a worker is lost."""
        with self._exchange:
            self.send_all(op, arg, args)
            outcomes: dict[int, Outcome] = {}
            try:
                outcomes[0] = local()
            except Exception as e:
                outcomes[0] = e
            for rank in self.conns:
                outcomes[rank] = self._recv(rank)
            return outcomes

    def run_all(self, op: str, arg: Any, local: Callable[[], Any], args: dict[int, Any] | None = None) -> Any:
        """run(), raising the first rank's error; returns rank 0's result."""
        outcomes = self.run(op, arg, local, args)
        for rank, value in outcomes.items():
            if isinstance(value, BaseException):
                if rank:
                    log.error("rank %d failed %s: %s", rank, op, value)
                raise value
        return outcomes[0]

    def wait_ready(self) -> list[dict]:
        infos = []
        for rank in self.conns:
            value = self._recv(rank)
            if isinstance(value, BaseException):
                raise ValueError(str(value))
            infos.append(value)
        return infos

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (each frees its pool and leaves the group), then leave the group."""
        if self._closing:
            return
        self._closing = True
        for conn in self.conns.values():
            try:
                conn.send(("close", None))
            except OSError:
                pass
        self.run_before_down()
        # Every rank releases its device communicator at the same time (NCCL's teardown may wait for
        # its peers), then the workers exit; nothing here waits without a limit.
        _bounded(self.group.down, "releasing the device communicator")
        for peer in self.peers.values():
            if not peer.join(30):
                log.warning("%s: it did not exit 30 s after close", peer.describe())
                peer.kill()
        for conn in self.conns.values():
            conn.close()
        for peer in self.peers.values():
            if isinstance(peer, Remote):
                peer.kill()
        _bounded(self.group.close, "leaving the control group")

    def run_before_down(self) -> None:
        """Rank 0's teardown that must precede the communicator's (its decode graphs: worker.drop_graphs
        says why), once; ParallelPool.close runs it before rank 0's pool goes, close() again (no-op)."""
        hooks, self.before_down = self.before_down, []
        for fn in hooks:
            try:
                fn()
            except Exception:
                log.exception("tearing down before the communicator failed")

    def _kill_all(self) -> None:
        self._closing = True
        for peer in self.peers.values():
            peer.kill()


def _bounded(fn: Callable[[], None], what: str, seconds: float = 15.0) -> None:
    """fn() on a daemon thread, waited for at most `seconds`: a teardown that hangs on a peer (a dead
    rank, a collective teardown) is logged and left behind instead of hanging close()."""
    def run() -> None:
        try:
            fn()
        except Exception:  # a group whose peers died may fail to tear down cleanly
            log.debug("%s failed", what, exc_info=True)

    t = threading.Thread(target=run, name="sleepserve-tp-teardown", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        log.warning("%s did not finish in %.0f s; the process goes on without it", what, seconds)


def check_layout(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuse a size the model or the machine cannot take, before any process starts."""
    world = config.tensor_parallel_size
    for rank in range(world):
        TensorParallel(model_config, rank, world)  # raises ValueError naming the problem
    device = config.torch_device()
    if device.type == "cuda":
        first = device.index or 0
        local = world  # GPUs this machine needs: under torchrun, its own ranks' (LOCAL_WORLD_SIZE)
        if config.tp_launch == "torchrun":
            from server.engine.parallel.launch import torchrun_place

            local = torchrun_place(world).local_world
        if first + local > torch.cuda.device_count():
            raise ValueError(f"--tensor-parallel-size {world} needs {local} GPUs from cuda:{first} on this machine; "
                             f"it has {torch.cuda.device_count()}")
