"""A tensor-parallel worker: ranks 1..N-1, each in its own process (spawned by rank 0, see executor.py,
or started by torchrun, see launch.py).

It builds its shard of the model in its own pool (build_rank, the same code as rank 0), then obeys
rank 0 over one pipe: a step's inputs (it runs the forward with rank 0; only rank 0 samples), and
the memory and weight commands, each answered with ("ok", result) or ("error", exception). A step
that fails here leaves the ranks out of step, so the worker exits and rank 0 reports it lost.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import torch

from server.config import EngineConfig
from server.engine.rank import build_rank, rank_device
from server.engine.parallel.group import Group, comm_options
from server.engine.parallel.steps import StepLag, no_delay, unpack_step
from server.engine.host_batch import continuing
from server.engine.sampler import PROMPT_ROWS_PER_PASS
from server.heap import freeze_startup_heap
from server.model.config import ModelConfig
from server.model.source import resolve_model
from server.model.shard import TensorParallel

log = logging.getLogger("sleepserve.engine")


def drop_graphs(runner) -> None:
    """Destroy the decode graphs before the communicator: NCCL's teardown waits until every graph
    that captured one of its collectives is destroyed (its persistent references), so with the graphs
    alive ncclCommAbort never returned (close waited 15 s, then the worker was killed)."""
    if getattr(runner, "graphs", None) is None:
        return
    runner.graphs = None  # the only reference: the CUDAGraphs are destroyed here
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def gpu_ops(prof) -> list[tuple[float, int, str]]:
    """(self device microseconds, calls, name) of every op with GPU time in a torch.profiler run."""
    rows = []
    for e in prof.key_averages():
        gpu = getattr(e, "self_device_time_total", None)
        if gpu is None:
            gpu = getattr(e, "self_cuda_time_total", 0)
        if gpu > 0:
            rows.append((float(gpu), int(e.count), str(e.key)))
    return sorted(rows, reverse=True)


def spin_seconds(device: torch.device) -> float:
    """How long a worker polls for the next step before it blocks: SLEEPSERVE_TP_WORKER_SPIN_US
    (microseconds), default 2000 on CUDA (rank 0's host work between two steps at batch 64 is ~1.2 ms:
    sampling, bookkeeping, scheduling, inputs); never on CPU, where the ranks share the cores."""
    if device.type != "cuda":
        return 0.0
    raw = os.environ.get("SLEEPSERVE_TP_WORKER_SPIN_US", "2000")
    try:
        return max(0.0, min(float(raw), 100_000.0)) / 1e6
    except ValueError:
        log.warning("SLEEPSERVE_TP_WORKER_SPIN_US=%r is not a number of microseconds: 2000 used", raw)
        return 2e-3


def cpu_threads(world: int) -> int:
    """Threads per rank on CPU: the ranks share the cores (oversubscribed, gloo collectives stall)."""
    return max(1, (os.cpu_count() or 1) // world)


class Worker:
    def __init__(self, config: EngineConfig, rank: int, world: int, conn: Connection, port: int,
                 store_host: str = "127.0.0.1"):
        self.conn = conn
        self.rank = rank
        source = resolve_model(config.model)
        model_config = ModelConfig.from_folder(source.folder)
        tp = TensorParallel(model_config, rank, world)
        device = rank_device(config, rank)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        conn.send(("ok", "joining"))  # rank 0 joins the group only once every rank got this far
        self.group = Group(port, rank, world, device, tp, host=store_host)
        self.group.start(**comm_options(config, model_config, device))
        self.parts = build_rank(config, source, model_config, tp)
        self.runner = self.parts.runner
        self.pool = self.parts.pool
        self.fail_next: dict[str, str] = {}  # op -> message: a failure armed by a test (inject_failure)
        # comm_recreate is a collective: its armed failure is raised inside it, once this rank's new
        # communicator is up (comm_cycle.recreate), not before it (the other ranks would wait in it)
        self.fail_recreate: str | None = None
        self.receiver = None  # weight_transfer.receiver.WeightReceiver, made by the first wt_init
        self.lag = StepLag()
        self.spin = spin_seconds(device)
        self.profiler = None  # a torch.profiler run of bench/tensor_parallel.py --profile
        self.closing = False  # rank 0 said close: its connections ending now is no failure
        # Async scheduling: the tokens rank 0 sampled in the last step, broadcast to this rank on the device;
        # the next step, if scheduled ahead, reads its input ids from them (runner.py, steps.py).
        self.tokens: torch.Tensor | None = None

    def serve(self) -> None:
        stepped = False
        while True:
            if stepped and self.spin:
                # The next step comes as soon as rank 0 has sampled this one: poll for it a short
                # while instead of sleeping in recv (a blocked process wakes tens of microseconds
                # late, and rank 0's GPU waits for this rank at the step's first all-reduce).
                deadline = time.perf_counter() + self.spin
                while not self.conn.poll(0) and time.perf_counter() < deadline:
                    pass
            try:
                op, arg = self.conn.recv()
            except (EOFError, OSError):
                return  # rank 0 is gone: nothing left to serve
            received = time.perf_counter()
            stepped = op == "step"
            if stepped:
                self.step(arg, received)
                continue
            if op == "close":
                self.closing = True
                return
            try:
                armed = self.fail_next.pop(op, None)
                if armed is not None:
                    from allocator import PoolError

                    raise PoolError(armed)
                reply: tuple[str, Any] = ("ok", getattr(self, "op_" + op)(arg))
            except Exception as e:
                reply = ("error", e)
            try:
                self.conn.send(reply)
            except Exception as e:  # an exception that does not pickle: send its text
                self.conn.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}; ({e})")))

    @torch.inference_mode()
    def step(self, packed: tuple, received: float) -> None:
        sent, hb, share = unpack_step(packed)
        tokens, self.tokens = self.tokens, None
        if hb.ids_rows is not None:  # scheduled ahead: its ids are the last step's tokens, never on the host
            if tokens is None:
                raise RuntimeError("a step scheduled ahead came without the previous step's tokens")
            hb.ids_from = continuing(tokens, hb.ids_rows)
        _, prompt_hidden = self.runner.forward(hb)
        if hb.decode_only:
            self.lag.add(sent, self.runner.launched, self.runner.replayed, received)
        if prompt_hidden is not None:  # rank 0 scores prompt log-probs in these chunks: gather the same
            for lo in range(0, prompt_hidden.shape[0], PROMPT_ROWS_PER_PASS):
                self.runner.model.compute_logits(prompt_hidden[lo:lo + PROMPT_ROWS_PER_PASS])
        if share:  # rank 0 broadcasts what it sampled right after its sampling: the same place in the order
            self.tokens = self.group.comm.broadcast(  # type: ignore[union-attr]
                torch.empty(len(hb.sample_rows), dtype=torch.long, device=self.runner.device))
        elif self.runner.device.type == "cuda":
            # The graph's pinned staging buffer is refilled by the next step: let this one's copy finish.
            # (With async scheduling the graphs' two staging buffers, each behind its copy's event, do that:
            # this rank then queues the next step while this one runs, as rank 0 does.)
            torch.cuda.current_stream(self.runner.device).synchronize()

    # -- commands (each mirrors what rank 0 does on its own rank at the same time) ----------------

    def op_sleep(self, tags: tuple[list[str], list[str]]):
        # Rank 0 drained first: no step follows the last one on the device, and the broadcast tokens (outside
        # the pool) would keep a segment of torch's allocator in use through the sleep.
        self.tokens = None
        return self.pool.sleep(offload_tags=tags[0], discard_tags=tags[1])

    def op_wake(self, tags: list[str] | None):
        return self.pool.wake_up(tags)

    def op_comm_release(self, _: Any) -> float:
        from server.engine.parallel.comm_cycle import release

        return release(self.runner, self.group)

    def op_comm_recreate(self, _: Any) -> float:
        from server.engine.parallel.comm_cycle import recreate

        fail, self.fail_recreate = self.fail_recreate, None
        return recreate(self.runner, self.group, fail)

    def op_comm_suspend(self, _: Any) -> float:
        return self.group.suspend()

    def op_comm_resume(self, _: Any) -> float:
        return self.group.resume()

    def op_comm_state(self, _: Any) -> dict:
        return self.group.state()

    def op_load_files(self, files) -> int:
        return len(self.runner.load_files(files))

    def op_load_sliced(self, named: list[tuple[str, torch.Tensor]]) -> int:
        from server.model.finite import FiniteCheck
        from server.model.loader import copy_weights

        check = FiniteCheck(self.runner.check_finite)
        loaded = copy_weights(self.runner.model, named, sliced=True, check=check)
        check.verify()
        return len(loaded)

    def op_load_dummy(self, seed: int) -> int:
        return len(self.runner.load_dummy(seed))

    def op_stats(self, _: Any):
        return self.pool.stats()

    def op_check_backup_space(self, tags: list[str]) -> None:
        self.pool.check_backup_space(tags)

    # -- weight transfer: this rank's receiver, driven by rank 0 (weight_transfer/service.py) ---------

    def op_wt_init(self, arg: tuple) -> dict:
        from server.model.loader import receiver_names
        from server.weight_transfer.receiver import WeightReceiver

        config, address, port, rank, world = arg
        if self.receiver is None or self.receiver.config != config:
            from server.model.finite import FiniteCheck

            self.receiver = WeightReceiver(config, self.runner.model, self.runner.device,
                                           *receiver_names(self.runner.model),
                                           finite_check=partial(FiniteCheck, self.runner.check_finite))
        return self.receiver.init(address, port, rank, world)

    def op_wt_receive(self, update) -> dict:
        """The names written, and the error if the receive broke off (TransferFailedError carries
        them but does not pickle with them)."""
        from server.weight_transfer.receiver import TransferFailedError

        if self.receiver is None:
            return {"loaded": [], "error": "this rank has not joined the weight-transfer group"}
        try:
            return {"loaded": sorted(self.receiver.receive(update)), "error": None}
        except TransferFailedError as e:
            return {"loaded": sorted(e.loaded), "error": str(e), "nonfinite": list(e.nonfinite)}

    def op_wt_finish(self, _: Any) -> None:
        if self.receiver is not None:
            self.receiver.finish()

    def op_wt_close(self, _: Any) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def op_step_lag(self, _: Any) -> dict:
        return self.lag.take()

    def op_profile(self, action: str) -> list[tuple[float, int, str]] | None:
        """bench/tensor_parallel.py --profile: "start" torch.profiler on this rank, "stop" it and
        return each GPU op's (self device microseconds, calls, name)."""
        if action == "start":
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.profiler = torch.profiler.profile(activities=acts)
            self.profiler.__enter__()
            return None
        prof, self.profiler = self.profiler, None
        if prof is None:
            raise ValueError("profile stop without a start")
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        prof.__exit__(None, None, None)
        return gpu_ops(prof)

    def op_inject_failure(self, arg: tuple[str, str]) -> None:
        op, message = arg
        if op == "comm_recreate":
            self.fail_recreate = message
        else:
            self.fail_next[op] = message

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        try:
            drop_graphs(self.runner)
            self.group.down()  # at the same time as rank 0 and the other workers (executor.Workers.close)
            self.pool.close()
        finally:
            self.group.close()


def worker_main(rank: int, address: str) -> int:
    """A worker that rank 0 spawned (--tp-launch spawn): its key comes in the environment."""
    host, port = address.rsplit(":", 1)
    key = bytes.fromhex(os.environ.pop("SLEEPSERVE_TP_KEY"))
    return _join(rank, host, int(port), key, store_host="127.0.0.1", alive=False)


def join_torchrun(place) -> int:
    """A worker that torchrun started (--tp-launch torchrun, RANK > 0): it joins rank 0 at MASTER_ADDR,
    retrying while rank 0's server starts, on the GPU of its LOCAL_RANK (rank.rank_device)."""
    print(f"sleepserve: tensor-parallel rank {place.rank} joins rank 0 at {place.address}", file=sys.stderr,
          flush=True)
    return _join(place.rank, place.master_addr, place.port, place.key, store_host=place.master_addr, alive=True)


def _connect(host: str, port: int, key: bytes, patience: float) -> Connection:
    from multiprocessing.connection import Client

    deadline = time.monotonic() + patience
    while True:
        try:
            return no_delay(Client((host, port), authkey=key))
        except (ConnectionRefusedError, ConnectionResetError, OSError) as e:
            if isinstance(e, (ConnectionRefusedError, ConnectionResetError)) and time.monotonic() < deadline:
                time.sleep(0.5)  # rank 0 is still starting (imports, its engine process)
                continue
            raise


def _watch_rank0(alive: Connection, worker_state: dict) -> None:
    """Under torchrun: rank 0's end of the liveness connection ended. Unless rank 0 closed this worker,
    rank 0 is gone: exit now, also from inside a collective that would wait for it (600 s)."""
    try:
        while True:
            alive.recv()
    except (EOFError, OSError):
        pass
    worker = worker_state.get("worker")
    if worker is not None and worker.closing:
        return
    log.critical("rank 0 closed the connection: this worker exits")
    os._exit(1)


def _join(rank: int, host: str, port: int, key: bytes, store_host: str, alive: bool) -> int:
    """Connect to rank 0, build, serve. Exit code 0 when rank 0 closed it, 1 on any failure (its
    traceback is logged first)."""
    import multiprocessing
    import socket
    import threading

    patience = 600.0 if alive else 0.0  # a spawned worker's rank 0 listens already
    conn = _connect(host, port, key, patience)
    conn.send((rank, "main", os.getpid(), socket.gethostname()))
    state: dict = {}
    if alive:  # at once, so that rank 0 sees this worker end from now on (it answers the hello meanwhile)
        liveness = _connect(host, port, key, patience)
        liveness.send((rank, "alive", os.getpid(), socket.gethostname()))
    config, world, store_port, log_level, process_key = conn.recv()
    multiprocessing.current_process().authkey = process_key  # rank 0's: tensors it sends are shared under it
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    if alive:
        threading.Thread(target=_watch_rank0, args=(liveness, state), name="sleepserve-tp-rank0-monitor",
                         daemon=True).start()
        # torchrun passes a Ctrl-C or SIGTERM to every rank at once: rank 0 shuts its server down and
        # closes this worker in turn (or its end ends this one, _watch_rank0); torchrun kills a rank
        # that is still there 30 s later.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    if config.torch_device().type == "cpu":
        torch.set_num_threads(cpu_threads(world))
    try:
        worker = state["worker"] = Worker(config, rank, world, conn, store_port, store_host)
    except BaseException as e:
        log.exception("rank %d could not start", rank)
        try:
            conn.send(("error", RuntimeError(f"rank {rank} could not start: {type(e).__name__}: {e}")))
        except OSError:
            pass
        return 1
    freeze_startup_heap(f"tensor-parallel rank {rank}")
    conn.send(("ok", {"rank": rank, "pid": os.getpid(), "device": str(worker.runner.device),
                      "all_reduce": worker.group.all_reduce_name}))
    try:
        worker.serve()
    except BaseException:
        log.exception("rank %d failed; the other ranks cannot run without it", rank)
        return 1
    worker.closing = True
    worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(int(sys.argv[1]), sys.argv[2]))
