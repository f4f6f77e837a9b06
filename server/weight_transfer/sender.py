"""The trainer's side, without vLLM: push a model's tensors into a running sleepserve.

    sender = WeightSender("http://127.0.0.1:8000", backend="ipc", api_key=ADMIN_KEY)
    sender.init()                                  # once (joins the group for nccl / gloo)
    sender.send(model.named_parameters())          # each step: start, update..., finish
    sender.close()

nccl / gloo: the sender hosts the rendezvous store as rank 0, posts the update and broadcasts
packed buckets while the server receives them (the server's "ready" key in the store comes
first, so a rejected update never leaves us blocked in a broadcast). ipc / shm: one reusable
bucket (a CUDA buffer exported once, or a shared-memory segment) is filled and posted per chunk;
the server has copied it out when the post returns. Only the standard library talks HTTP.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch

from server.weight_transfer import handles, rendezvous, safe_pickle
from server.weight_transfer.config import DEFAULT_BUCKET_BYTES, WeightTransferConfig
from server.weight_transfer.group import Group, open_group
from server.weight_transfer.protocol import dtype_name, pack_into, plan_buckets, region


class WeightSendError(RuntimeError):
    """The server refused or failed an update; `status` and `body` are its HTTP answer."""

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(message)
        self.status, self.body = status, body


class WeightSender:
    def __init__(self, base_url: str, backend: str = "nccl", api_key: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | str | None = None,
                 master_address: str = "127.0.0.1", timeout_s: float = 300.0,
                 after_bucket: Callable[[int], None] | None = None, packed: bool = True):
        WeightTransferConfig(backend=backend)  # validates the name
        self.url = base_url.rstrip("/")
        self.backend = backend
        self.api_key = api_key
        self.bucket_bytes = bucket_bytes
        default = "cuda" if backend in ("nccl", "ipc") else "cpu"
        self.device = torch.device(device or default)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.after_bucket = after_bucket  # test and benchmark hook: called after each bucket left
        self.packed = packed      # nccl / gloo: packed buckets (vLLM's default), or one broadcast per tensor
        self.group: Group | None = None
        self.store: Any = None
        self._bucket: Any = None
        self._ring: list[torch.Tensor] = []
        self._pack_stream: Any = None

    # -- HTTP --------------------------------------------------------------------------------------

    def post(self, route: str, body: dict | None, method: str = "POST") -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + route, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s + 30) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                err = json.loads(text)
                message = err.get("error", {}).get("message", text)
            except (json.JSONDecodeError, AttributeError):
                err, message = text, text
            raise WeightSendError(f"{method} {route}: {e.code}: {message}", e.code, err) from None

    def _post_async(self, route: str, body: dict) -> Future:
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(self.post(route, body))
            except BaseException as e:
                fut.set_exception(e)
        threading.Thread(target=run, daemon=True, name=f"post{route}").start()
        return fut

    # -- setup -------------------------------------------------------------------------------------

    def init(self) -> dict:
        if self.backend in ("ipc", "shm"):
            return self.post("/init_weight_transfer_engine", {"init_info": {}})
        port = rendezvous.free_port(self.master_address)
        # The group is this trainer (rank 0) and every rank of the server (a tensor-parallel server
        # has several, each keeping its slices), as vLLM's trainers size it from /get_world_size.
        world = 1 + int(self.post("/get_world_size", None, method="GET")["world_size"])
        info = {"master_address": self.master_address, "master_port": port, "rank_offset": 1, "world_size": world,
                "packed": True}
        # The server joins while we host the store (its client retries until we listen), as vLLM's
        # trainers do it: post first, then rendezvous.
        joined = self._post_async("/init_weight_transfer_engine", {"init_info": info})
        try:
            self.store = rendezvous.host_store(self.master_address, port, world, self.timeout_s)
        except Exception:
            if joined.done():
                joined.result()  # the server's refusal says more than the store's timeout
            raise
        self.group = open_group(self.backend, self.store, 0, world, self.device, self.timeout_s)
        return joined.result(timeout=self.timeout_s + 30)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.store = None, None
        if self._bucket is not None:
            self._bucket.close()
            self._bucket = None
        self._ring = []

    # -- sending -----------------------------------------------------------------------------------

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> dict:
        """One complete update: start, the tensors, finish. Returns timings and the server's answer:
        `phases` (seconds of each step, as this process saw them), `sender` (buckets sent straight
        from the tensors' memory or packed; device time of packing) and the server's `update` answer
        (its receive timings)."""
        named = [(n, t.detach()) for n, t in named_tensors]
        clock = _Clock()
        self.post("/start_weight_update", {})
        clock.lap("start_s")
        if self.backend in ("nccl", "gloo"):
            update, sender = self._send_broadcast(named, clock)
        else:
            update, sender = self._send_handles(named, clock)
        send_seconds = clock.elapsed()
        done = self.post("/finish_weight_update", {"weight_version": weight_version} if weight_version else {})
        clock.lap("finish_s")
        seconds = clock.elapsed()
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return {"bytes": nbytes, "send_seconds": send_seconds, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                "phases": clock.laps, "sender": sender, "update": update, "server": done}

    def _meta(self, named: list[tuple[str, torch.Tensor]]) -> dict:
        return {"names": [n for n, _ in named], "dtype_names": [dtype_name(t.dtype) for _, t in named],
                "shapes": [list(t.shape) for _, t in named]}

    def _wait_ready(self, key: str, answer: Future) -> None:
        """Block until the server says it is receiving, or its answer shows it will not."""
        deadline = time.monotonic() + self.timeout_s
        full = rendezvous.READY_PREFIX + key
        while True:
            try:
                self.store.wait([full], timedelta(seconds=0.2))
                break
            except Exception:  # the wait timed out
                if answer.done():
                    answer.result()  # raises the server's refusal
                    raise WeightSendError("the server answered before receiving anything")
                if time.monotonic() > deadline:
                    raise WeightSendError(f"the server did not start receiving within {self.timeout_s:.0f} s")
        message = self.store.get(full).decode()
        if message != "ok":
            try:
                answer.result(timeout=30)
            except WeightSendError:
                raise
            raise WeightSendError(f"the server refused the update: {message}")

    def _send_broadcast(self, named: list[tuple[str, torch.Tensor]], clock: "_Clock") -> tuple[dict, dict]:
        if self.group is None:
            raise WeightSendError("call init() before send()")
        key = uuid.uuid4().hex
        info = {**self._meta(named), "packed": self.packed, "packed_buffer_size_bytes": self.bucket_bytes,
                "sleepserve_ready_key": key}
        answer = self._post_async("/update_weights", {"update_info": info})
        self._wait_ready(key, answer)
        clock.lap("ready_s")
        stats = self._broadcast([t for _, t in named])
        clock.lap("data_s")
        update = answer.result(timeout=self.timeout_s + 30)
        clock.lap("answer_s")
        return update, stats

    def _broadcast(self, tensors: list[torch.Tensor]) -> dict:
        """Enqueue every broadcast, then wait for them in order (no host wait per bucket). A bucket
        whose tensors already lie back to back in one storage (protocol.region) is broadcast from
        there; any other is packed into one of two reused slots on a pack stream, the next pack into
        a slot waiting (an event) for the broadcast out of it."""
        group = self.group
        assert group is not None
        cuda = group.stream is not None
        tensors = [t if t.device == self.device else t.to(self.device) for t in tensors]
        pending: list[Any] = []
        timed: list[tuple[Any, Any]] = []
        direct = staged = 0
        if not self.packed:  # one broadcast per tensor, from its own memory
            tensors = [t.contiguous() for t in tensors]  # kept until every broadcast is done
            for i, t in enumerate(tensors):
                pending.append(group.broadcast(t))
                direct += 1
                if self.after_bucket:
                    self.after_bucket(i)
        else:
            sizes = [t.numel() * t.element_size() for t in tensors]
            buckets = plan_buckets(sizes, self.bucket_bytes)
            views = [region([tensors[j] for j in r]) for r in buckets]
            staged_sizes = [sum(sizes[j] for j in r) for r, v in zip(buckets, views) if v is None]
            slots = self._slots(max(staged_sizes, default=0), min(2, len(staged_sizes)))
            free: list[Any] = [None] * len(slots)  # per slot: the broadcast out of it
            if cuda:
                if self._pack_stream is None:
                    self._pack_stream = torch.cuda.Stream(self.device)
                self._pack_stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensors' producers
            for k, (r, view) in enumerate(zip(buckets, views)):
                if view is not None:
                    pending.append(group.broadcast(view))
                    direct += 1
                else:
                    s = staged % len(slots)
                    staged += 1
                    buf = slots[s][:sum(sizes[j] for j in r)]
                    if not cuda:
                        pack_into(buf, [tensors[j] for j in r])
                        pending.append(group.broadcast(buf))
                    else:
                        stream = self._pack_stream
                        if free[s] is not None:
                            stream.wait_event(free[s])
                        with torch.cuda.stream(stream):  # the broadcast waits for the current stream: this one
                            start = _event(stream)
                            pack_into(buf, [tensors[j] for j in r])
                            timed.append((start, _event(stream)))
                            free[s] = group.broadcast(buf)
                        pending.append(free[s])
                if self.after_bucket:
                    self.after_bucket(k)
        for token in pending:
            group.wait_for(token)
        return {"direct": direct, "staged": staged,
                "pack_gpu_s": sum(a.elapsed_time(b) for a, b in timed) / 1e3}

    def _slots(self, size: int, count: int) -> list[torch.Tensor]:
        """`count` packing buffers of `size` bytes, kept from one send to the next."""
        if count == 0:
            return []
        if len(self._ring) < count or self._ring[0].numel() < size:
            self._ring = []  # freed first: two 1 GiB slots, not four
            self._ring = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(count)]
        return self._ring[:count]

    def _send_handles(self, named: list[tuple[str, torch.Tensor]], clock: "_Clock") -> tuple[dict, dict]:
        sizes = [t.numel() * t.element_size() for _, t in named]
        capacity = max(min(self.bucket_bytes, sum(sizes)), max(sizes, default=1))
        if self._bucket is None or self._bucket.tensor.numel() < capacity:
            if self._bucket is not None:
                self._bucket.close()
            self._bucket = (handles.ShmBucket(capacity) if self.backend == "shm"
                            else handles.CudaBucket(capacity, self.device))
        bucket = self._bucket
        handle = bucket.handle if self.backend == "shm" else None
        pickled = safe_pickle.dumps_b64(bucket.handle) if self.backend == "ipc" else None
        chunk: list[int] = []
        total = 0
        update: dict = {}
        server_s = 0.0
        chunks: list[list[int]] = []
        for i, size in enumerate(sizes):  # vLLM's IPC rule: a chunk never exceeds the buffer
            if chunk and total + size > capacity:
                chunks.append(chunk)
                chunk, total = [], 0
            chunk.append(i)
            total += size
        if chunk:
            chunks.append(chunk)
        for n, idx in enumerate(chunks):
            part = [named[i] for i in idx]
            pack_into(bucket.tensor, [t for _, t in part])
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            clock.lap("pack_s")
            info = {**self._meta(part), "packed": True, "tensor_sizes": [sizes[i] for i in idx]}
            if pickled is not None:
                info["ipc_handles_pickled"] = pickled
            else:
                info["ipc_handles"] = handle
            update = self.post("/update_weights", {"update_info": info})
            server_s += update.get("seconds") or 0.0
            clock.lap("post_s")
            if self.after_bucket:
                self.after_bucket(n)
        return update, {"chunks": len(chunks), "server_copy_s": server_s}


class _Clock:
    """Seconds of each phase of a send, as laps of one clock."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _event(stream: Any) -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event
