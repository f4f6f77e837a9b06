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

import http.client
import json
import select
import time
import urllib.parse
import uuid
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch

from server.weight_transfer import handles, rendezvous, safe_pickle
from server.weight_transfer.config import DEFAULT_BUCKET_BYTES, WeightTransferConfig
from server.weight_transfer.group import TransferGroup, open_group
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
        self.group: TransferGroup | None = None
        self.store: Any = None
        self._bucket: Any = None
        self._ring: list[torch.Tensor] = []
        self._pack_stream: Any = None
        # Two kept-alive connections, both used from the calling thread: an update's request is written
        # on the second, its answer read after the broadcast (no thread, so no GIL hand-off per update).
        self._http = self._connection()
        self._http2 = self._connection()

    # -- HTTP --------------------------------------------------------------------------------------

    def post(self, route: str, body: dict) -> dict:
        """POST on this thread's kept-alive connection; WeightSendError for an HTTP error."""
        return self._http.post(route, body)

    def _connection(self) -> "_Http":
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return _Http(self.url, headers, self.timeout_s + 30)

    # -- setup -------------------------------------------------------------------------------------

    def init(self) -> dict:
        if self.backend in ("ipc", "shm"):
            return self.post("/init_weight_transfer_engine", {"init_info": {}})
        port = rendezvous.free_port(self.master_address)
        # The group is this trainer (rank 0) and every rank of the server (a tensor-parallel server
        # has several, each keeping its slices), as vLLM's trainers size it from /get_world_size.
        world = 1 + int(self._http.get("/get_world_size")["world_size"])
        info = {"master_address": self.master_address, "master_port": port, "rank_offset": 1, "world_size": world,
                "packed": True}
        # The server joins while we host the store (its client retries until we listen), as vLLM's
        # trainers do it: post first, then rendezvous.
        route = "/init_weight_transfer_engine"
        self._http2.send(route, {"init_info": info})  # answered once the server has joined
        try:
            self.store = rendezvous.host_store(self.master_address, port, world, self.timeout_s)
        except Exception:
            if self._http2.answered():
                self._http2.receive(route)  # the server's refusal says more than the store's timeout
            self._http2.close()
            raise
        try:
            self.group = open_group(self.backend, self.store, 0, world, self.device, self.timeout_s)
        except Exception:
            self._http2.close()
            raise
        return self._http2.receive(route)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.store = None, None
        self._http.close()
        self._http2.close()
        if self._bucket is not None:
            self._bucket.close()
            self._bucket = None
        self._ring = []

    # -- sending -----------------------------------------------------------------------------------

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> dict:
        """One complete update: a session (start, the tensors, finish) as vLLM's routes define it, in
        fewer round trips: the first update call opens the session itself (update_info's
        sleepserve_start_session, the same as POST /start_weight_update first), and over nccl / gloo
        the finish is posted as soon as the server receives (it runs once the update's bytes have
        landed). Returns timings and the server's answer: `phases` (seconds of each step, as this
        process saw them), `sender` (buckets sent straight from the tensors' memory or packed; device
        time of packing) and the server's `update` answer (its receive timings)."""
        named = [(n, t.detach()) for n, t in named_tensors]
        clock = _SendClock()
        finish_body = {"weight_version": weight_version} if weight_version else {}
        if self.backend in ("nccl", "gloo"):
            update, sender, done = self._send_broadcast(named, clock, finish_body, open_session=True)
        else:
            update, sender = self._send_handles(named, clock, open_session=True)
            done = self.post("/finish_weight_update", finish_body)
        clock.lap("finish_s")
        seconds = clock.elapsed()
        send_seconds = seconds - clock.laps["finish_s"]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return {"bytes": nbytes, "send_seconds": send_seconds, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                "phases": clock.laps, "walls": clock.walls, "sender": sender, "update": update, "server": done}

    def _meta(self, named: list[tuple[str, torch.Tensor]]) -> dict:
        return {"names": [n for n, _ in named], "dtype_names": [dtype_name(t.dtype) for _, t in named],
                "shapes": [list(t.shape) for _, t in named]}

    def _wait_ready(self, key: str, route: str) -> None:
        """Block until the server says it is receiving, or its answer to the update (on _http2) shows
        it will not (a refusal is also in the store: it is noticed at once)."""
        deadline = time.monotonic() + self.timeout_s
        full = rendezvous.READY_PREFIX + key
        while True:
            try:
                self.store.wait([full], timedelta(seconds=0.2))
                break
            except Exception:  # the wait timed out
                if self._http2.answered():
                    self._http2.receive(route)  # raises the server's refusal
                    raise WeightSendError("the server answered before receiving anything")
                if time.monotonic() > deadline:
                    self._http2.close()
                    raise WeightSendError(f"the server did not start receiving within {self.timeout_s:.0f} s")
        message = self.store.get(full).decode()
        if message != "ok":
            self._http2.receive(route)  # the refusal's 4xx (WeightSendError)
            raise WeightSendError(f"the server refused the update: {message}")

    def _send_broadcast(self, named: list[tuple[str, torch.Tensor]], clock: "_SendClock", finish_body: dict | None,
                        open_session: bool = False) -> tuple[dict, dict, dict | None]:
        """POST the update (open_session: it opens the session too); once the server says it receives,
        POST the finish too (finish_body; None: no finish), then broadcast. The server runs that finish right after this update's write
        closes, and fails it if the update fails (weight_version is set only for bytes that landed).
        Both answers come back when the bytes have landed: the finish's round trip hides behind the data."""
        if self.group is None:
            raise WeightSendError("call init() before send()")
        key = uuid.uuid4().hex
        info = {**self._meta(named), "packed": self.packed, "packed_buffer_size_bytes": self.bucket_bytes,
                "sleepserve_ready_key": key}
        if open_session:
            info["sleepserve_start_session"] = True
        clock.wall("posted")
        self._http2.send("/update_weights", {"update_info": info})  # its answer is read after the broadcast
        try:
            self._wait_ready(key, "/update_weights")
            clock.wall("ready_seen")
            clock.lap("ready_s")

            finish_sent = finish_body is None

            def post_finish() -> None:
                nonlocal finish_sent
                if not finish_sent:
                    self._http.send("/finish_weight_update", finish_body)  # its answer is read last
                    finish_sent = True
            if self.group.stream is None:  # gloo: each broadcast returns when its bytes are there, so now
                post_finish()
            # NCCL: once the first bucket is enqueued (the host returns at once): off the data's path.
            stats = self._broadcast([t for _, t in named], post_finish)
            post_finish()  # nothing was sent
            clock.lap("data_s")
            update = self._http2.receive("/update_weights")
            clock.wall("answer_read")
            clock.lap("answer_s")
        except BaseException:
            # An answer left unread (a failure too) would be taken for the next one: drop the connections.
            self._http.close()
            self._http2.close()
            raise
        return update, stats, None if finish_body is None else self._http.receive("/finish_weight_update")

    def _broadcast(self, tensors: list[torch.Tensor], after_first: Callable[[], None] | None = None) -> dict:
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
                if i == 0 and after_first is not None:
                    after_first()
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
                if k == 0 and after_first is not None:
                    after_first()
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

    def _send_handles(self, named: list[tuple[str, torch.Tensor]], clock: "_SendClock",
                      open_session: bool = False) -> tuple[dict, dict]:
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
        server_parts: dict[str, float] = {}
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
            if open_session and n == 0:
                info["sleepserve_start_session"] = True
            if pickled is not None:
                info["ipc_handles_pickled"] = pickled
            else:
                info["ipc_handles"] = handle
            update = self.post("/update_weights", {"update_info": info})
            server_s += update.get("seconds") or 0.0
            for key, value in (update.get("timings") or {}).items():  # the receive's parts, summed over the buckets
                if isinstance(value, (int, float)):
                    server_parts[key] = server_parts.get(key, 0.0) + value
            clock.lap("post_s")
            if self.after_bucket:
                self.after_bucket(n)
        return update, {"chunks": len(chunks), "server_copy_s": server_s, "server_parts_s": server_parts}


class _Http:
    """One kept-alive HTTP/1.1 connection (urllib opens one per request: ~0.4 ms each on the CI host,
    three times per update). Used by one thread at a time."""

    IDLE_S = 3.0  # uvicorn closes a connection idle for 5 s: open a new one before that

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float):
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port
        self.prefix = parts.path.rstrip("/")
        self.headers = headers
        self.timeout_s = timeout_s
        self.conn: http.client.HTTPConnection | None = None
        self.last = 0.0
        self._reused = False
        self._sent: bytes | None = None
        self._method = "POST"

    def post(self, route: str, body: dict) -> dict:
        self.send(route, body)
        return self.receive(route)

    def get(self, route: str) -> dict:
        self.send(route, None, "GET")
        return self.receive(route)

    def send(self, route: str, body: dict | None, method: str = "POST") -> None:
        """Write the request; receive() reads its answer."""
        data = json.dumps(body).encode() if body is not None else None
        self._method = method
        self._reused = self.conn is not None and time.monotonic() - self.last < self.IDLE_S
        if not self._reused:
            self.close()
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self.conn = cls(self.host, self.port, timeout=self.timeout_s)
        self._sent = data
        try:
            self.conn.request(method, self.prefix + route, body=data, headers=self.headers)  # type: ignore[union-attr]
        except (ConnectionResetError, BrokenPipeError):
            if not self._reused:
                self.close()
                raise
            self._retry(route)

    def receive(self, route: str) -> dict:
        try:
            try:
                resp = self.conn.getresponse()  # type: ignore[union-attr]
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # A kept connection that the server had closed never carried this request: send it again.
                if not self._reused:
                    raise
                self._retry(route)
                resp = self.conn.getresponse()  # type: ignore[union-attr]
            payload = resp.read()
        except BaseException:
            self.close()
            raise
        self.last = time.monotonic()
        if resp.will_close:
            self.close()
        if resp.status >= 400:
            text = payload.decode(errors="replace")
            try:
                err = json.loads(text)
                message = err.get("error", {}).get("message", text)
            except (json.JSONDecodeError, AttributeError):
                err, message = text, text
            raise WeightSendError(f"{self._method} {route}: {resp.status}: {message}", resp.status, err)
        return json.loads(payload or b"{}")

    def answered(self) -> bool:
        """Whether the answer to the request sent has arrived (or the connection closed): readable now."""
        sock = self.conn.sock if self.conn is not None else None
        return sock is None or bool(select.select([sock], [], [], 0)[0])

    def _retry(self, route: str) -> None:
        self.close()
        self._reused = False
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        self.conn = cls(self.host, self.port, timeout=self.timeout_s)
        self.conn.request(self._method, self.prefix + route, body=self._sent, headers=self.headers)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class _SendClock:
    """Seconds of each phase of a send, as laps of one clock."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.walls: dict[str, float] = {}  # wall-clock moments, comparable with the server's `clock`

    def wall(self, name: str) -> None:
        self.walls[name] = time.time()

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
