"""A step's inputs on the wire to the workers: the plain lists of a HostBatch, without the sequences
(only rank 0 samples), and the moment rank 0 sent them. One pickle of a few int lists per step (tens
of microseconds at batch 64).

Async scheduling adds two things (runner.py says why the tokens are broadcast): `share`, rank 0 will
broadcast the tokens it samples in this step on the device communicator, right after its sampling, and
every worker joins that broadcast right after its forward; `rows`, this step was scheduled ahead: its
input ids are these rows of the tokens the previous step broadcast (None: its ids are in `ids`).

The send time lets each rank measure how long after it its forward was launched (StepLag):
time.perf_counter is the host's monotonic clock, the same in every process. A worker that launches
later than rank 0 makes rank 0's GPU wait at the step's first all-reduce."""
from __future__ import annotations

import os
import socket
import statistics
import time
from collections import deque
from multiprocessing.connection import Connection

from server.engine.host_batch import HostBatch


def no_delay(conn: Connection) -> Connection:
    """TCP_NODELAY on a rank-0 <-> worker connection (TCP, whether spawned or under torchrun). Steps flow one
    way, with nothing sent back between them, so Nagle's algorithm holds a step's last partial segment until
    the worker's delayed ACK of the one before (40 ms on Linux): on 2xH200 (8B, TP=2, async, batch 64) the
    workers received steps up to 39 ms late (p90), and a decode step took 13 ms instead of ~4."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket, another descriptor
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)  # a process-wide default timeout made the shared socket non-blocking above
    return conn


def pack_step(hb: HostBatch, share: bool) -> tuple:
    return (time.perf_counter(), hb.ids, hb.positions, hb.slots, hb.decode_tables, hb.decode_lens, hb.spans,
            hb.sample_rows, hb.prompt_rows, share, hb.ids_rows if hb.ids_from is not None else None)


def unpack_step(packed: tuple) -> tuple[float, HostBatch, bool]:
    """(rank 0's send time, the batch, whether rank 0 broadcasts its sampled tokens after it). The batch's
    ids_rows is set when its input ids are rows of the previous step's broadcast tokens."""
    sent, ids, positions, slots, tables, lens, spans, sample_rows, prompt_rows, share, rows = packed
    hb = HostBatch(ids, positions, slots, tables, lens, spans, sample_rows, [], prompt_rows=prompt_rows, ids_rows=rows)
    return sent, hb, share


class StepLag:
    """Per decode step (a CUDA graph's replay, or the eager forward): microseconds from rank 0's send to this rank's
    receipt of the step (workers) and to its graph launch. The last 4096 steps; a summary reads
    and clears them (bench/tensor_parallel.py prints them)."""

    def __init__(self) -> None:
        self.recv: deque[float] = deque(maxlen=4096)
        self.launch: deque[float] = deque(maxlen=4096)
        self.eager = 0  # decode steps that ran eagerly (no graph covered them) since the last take()

    def add(self, sent: float, launched: float, graph: bool, received: float | None = None) -> None:
        self.launch.append((launched - sent) * 1e6)
        if received is not None:
            self.recv.append((received - sent) * 1e6)
        self.eager += not graph

    def take(self) -> dict:
        out: dict = {name: _summary(values) for name, values in (("recv_us", self.recv), ("launch_us", self.launch))
                     if values}
        if out:
            out["eager_steps"] = self.eager
        self.recv.clear()
        self.launch.clear()
        self.eager = 0
        return out


def _summary(values: deque[float]) -> dict[str, float]:
    s = sorted(values)
    return {"steps": len(s), "median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1]}
