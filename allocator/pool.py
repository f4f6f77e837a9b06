"""MemoryPool: tags, their sleep state, and the rules of sleep/wake, independent of the backend.

The pool owns memory and the per-tag state; the engine decides when to sleep and wake. A tag is
awake, offloaded or discarded. Tags only change state here, after the backend did the work, so
a failed call leaves every tag in a state that matches its memory.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .timing import Clock
from .types import (
    Backend,
    PoolError,
    PoolStats,
    PoolSleepReport,
    TagState,
    TagStats,
    PoolWakeReport,
    check_tag,
)


def _tag_list(tags: str | Iterable[str] | None) -> list[str]:
    if tags is None:
        return []
    if isinstance(tags, str):
        tags = [tags]
    out: list[str] = []
    for tag in tags:
        check_tag(tag)
        if tag not in out:
            out.append(tag)
    return out


def _shape(shape: int | Sequence[int] | torch.Size) -> tuple[int, ...]:
    if isinstance(shape, int):
        return (shape,)
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise PoolError(f"negative dimension in shape {dims}")
    return dims


# The largest piece of physical memory (one driver handle) of a chunked tensor: a chunk bigger than
# this is made of several. Measured on an H200 (2026-11-30): unmap + release costs 0.33-0.35 ms/GiB for
# handles of 1 to 4 GiB (the floor; 0.82 at 64 MiB) but 0.42-0.66 ms/GiB for one handle of ~86 GiB, and
# creating such a handle in one call beside a running request made that request 3.98x slower (the
# background mapper cannot give way in the middle of one call).
MAX_PIECE_BYTES = 2 << 30


def _split(offset: int, size: int, granularity: int) -> list[tuple[int, int]]:
    """(offset, size) of the pieces of one chunk: at most MAX_PIECE_BYTES each, on granule bounds."""
    step = max(granularity, MAX_PIECE_BYTES // granularity * granularity)
    return [(o, min(step, offset + size - o)) for o in range(offset, offset + size, step)]


class _Chunks:
    """One chunked tensor's pieces (backend addresses, a list per chunk) and how many leading chunks
    are mapped. `ready` is written under `cond` by the pool (wake, sleep, the background mapper)."""

    def __init__(self, pieces: list[list[int]]) -> None:
        self.pieces = pieces
        self.ready = len(pieces)
        self.cond = threading.Condition()
        self.mapper: threading.Thread | None = None
        self.cancel = threading.Event()
        self.error: PoolError | None = None
        self.active = False  # a mapper runs (or is about to): more chunks may come
        self.waiters = 0     # threads in wait_chunks: the mapper then maps without yielding
        # The last background mapping, for the reports: when it started (perf_counter), how long
        # after that each chunk was ready, and when it ended (None while it runs).
        self.started: float | None = None
        self.chunk_seconds: list[float] = []
        self.ended: float | None = None

    def set_ready(self, n: int) -> None:
        with self.cond:
            self.ready = n
            self.cond.notify_all()

    def start(self, target: Any) -> None:
        with self.cond:
            self.active = True
            self.started, self.chunk_seconds, self.ended = time.perf_counter(), [], None
        self.mapper = threading.Thread(target=target, daemon=True, name="sleepserve-map-chunks")
        self.mapper.start()

    def finish(self) -> None:
        with self.cond:
            if self.active and self.ended is None:
                self.ended = time.perf_counter()
            self.active = False
            self.cond.notify_all()  # waiters learn that nothing more comes

    def describe(self) -> dict[str, Any]:
        """The chunks mapped now and the last background mapping: ms from its start to each chunk
        ready, whether it still runs, how long it ran (or has run so far), and why it stopped early."""
        with self.cond:
            now = time.perf_counter()
            ran = None if self.started is None else ((self.ended or now) - self.started) * 1e3
            return {"ready": self.ready, "total": len(self.pieces), "mapping": self.active,
                    "chunk_ready_ms": [round(t * 1e3, 3) for t in self.chunk_seconds],
                    "ran_ms": ran, "error": str(self.error) if self.error else None}


def _foreground(method: Callable) -> Callable:
    """A pool call that reads or changes the backend from the foreground (the engine's sleep, wake and
    stats): while one runs, the background mapper starts no new piece (_yield_to_foreground). Mapping a
    piece holds the C registry's lock and the driver for its create, map and set-access (a few ms), and a
    mutex does not queue its waiters: on the H200 (2026-12-01) a mapper starting piece after piece kept a
    level-2 sleep from its first pool read for 14-20 ms (the sleep's channel timings). The mapper still maps
    one piece after each foreground call ends, so calls back to back (a client polling /memory) cannot
    starve it: a foreground call waits for one piece at most."""
    @functools.wraps(method)
    def call(self: "MemoryPool", *args: Any, **kwargs: Any) -> Any:
        with self._front_cond:
            self._front += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._front_cond:
                self._front -= 1
                self._front_ended += 1
                self._front_cond.notify_all()
    return call


class MemoryPool:
    """A pool of tensors whose memory sleeps and wakes per tag while their addresses stay put.

    Build one with allocator.create_pool(device). Tensors come from empty(), adopt() or, on CUDA,
    any torch allocation inside `with pool.use(tag)`.
    """

    def __init__(self, backend: Backend, keep_backups: bool = True) -> None:
        self._backend = backend
        self._keep_backups = keep_backups
        self._sleeping: dict[str, TagState] = {}
        self._lock = threading.RLock()
        self._local = threading.local()  # .tags: this thread's stack of use() tags
        self._open_uses: Counter[str] = Counter()
        self._closed = False
        self._chunks: dict[str, _Chunks] = {}  # by tag: the tag's chunked tensor (empty_chunked)
        self._preparing: threading.Thread | None = None  # prepare_backups() at work
        self._busy: Callable[[], bool] | None = None       # yield_mapping_while()
        self._front = 0                                     # foreground calls running (_foreground)
        self._front_ended = 0                               # and how many have ended
        self._front_cond = threading.Condition()
        self._cleared_at = 0.0  # perf_counter when the device will have cleared what the last sleep released
        self.prepare_error: PoolError | None = None  # why the last background preparation failed

    # ------------------------------------------------------------------ allocation

    @property
    def device(self) -> torch.device:
        return self._backend.device

    def _use_stack(self) -> list[str]:
        stack = getattr(self._local, "tags", None)
        if stack is None:
            stack = self._local.tags = []
        return stack

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed; create a new one with allocator.create_pool()")

    def _check_awake(self, tag: str, action: str) -> None:
        state = self._sleeping.get(tag)
        if state is not None:
            raise PoolError(
                f"cannot {action} tag '{tag}': it is asleep ({state.value}); "
                f"call pool.wake_up(['{tag}']) first"
            )

    def empty(
        self,
        shape: int | Sequence[int] | torch.Size,
        dtype: torch.dtype = torch.float32,
        tag: str | None = None,
    ) -> torch.Tensor:
        """A new contiguous, uninitialized tensor living in the pool under `tag` (default: the
        tag of the innermost `with pool.use(tag)` on this thread)."""
        if tag is None:
            stack = self._use_stack()
            if not stack:
                raise PoolError("pool.empty() needs a tag, or must run inside `with pool.use(tag)`")
            tag = stack[-1]
        check_tag(tag)
        dims = _shape(shape)
        with self._lock:
            self._check_open()
            self._check_awake(tag, "allocate in")
        return self._backend.empty(dims, dtype, tag)

    @property
    def granularity(self) -> int:
        """Bytes at which physical memory can be split (CUDA: 2 MiB; CPU: a page)."""
        return self._backend.granularity

    def empty_chunked(self, shape: Sequence[int], dtype: torch.dtype, tag: str,
                      bounds: Sequence[int]) -> torch.Tensor:
        """A contiguous tensor whose memory comes in chunks along its first dimension: chunk c holds
        the indices [bounds[c], bounds[c+1]) of dim 0, one contiguous range of bytes made of pieces of
        physical memory of at most MAX_PIECE_BYTES (driver handles on CUDA: a sleep's release time
        follows the number of handles below 1 GiB each, and the bytes above). After a sleep that discards the tag, wake_up() maps chunk 0 before it returns and
        the others in order in a background thread; chunks_ready() says how many are usable,
        wait_chunks() waits for more. So a wake costs the first chunk, not the whole tensor
        (re-creating memory right after it was released costs ~3 ms/GiB on an H200). Nothing may
        touch a chunk before it is ready (the CPU backend makes it fault). One chunked tensor per tag;
        it can only be discarded, not offloaded.

        bounds: 0 = bounds[0] < ... < bounds[-1] = shape[0]; each bound's byte offset (bound x the
        bytes of one index of dim 0) must be a multiple of granularity."""
        check_tag(tag)
        dims = _shape(shape)
        if not dims or math.prod(dims) == 0:
            raise PoolError(f"a chunked tensor needs at least one element, got shape {dims}")
        b = [int(x) for x in bounds]
        if len(b) < 2 or b[0] != 0 or b[-1] != dims[0] or any(x >= y for x, y in zip(b, b[1:])):
            raise PoolError(f"chunk bounds {b} must rise strictly from 0 to shape[0] = {dims[0]}")
        index_bytes = math.prod(dims[1:]) * dtype.itemsize
        gran = self.granularity
        bad = [x for x in b if (x * index_bytes) % gran]
        if bad:
            raise PoolError(
                f"chunks of {index_bytes} bytes per index at bounds {bad} do not fall on the pool's "
                f"granularity ({gran} bytes); pick bounds (and shape[0]) that are multiples of "
                f"{gran // math.gcd(gran, index_bytes)}")
        per_chunk = [_split(lo * index_bytes, (hi - lo) * index_bytes, gran) for lo, hi in zip(b, b[1:])]
        pieces = [piece for chunk in per_chunk for piece in chunk]
        with self._lock:
            self._check_open()
            self._check_awake(tag, "allocate in")
            if tag in self._chunks:
                raise PoolError(f"tag '{tag}' already has a chunked tensor; use one per tag")
            tensor, addresses = self._backend.empty_chunked(dims, dtype, tag, pieces)
            at = iter(addresses)
            self._chunks[tag] = _Chunks([[next(at) for _ in chunk] for chunk in per_chunk])
        return tensor

    def chunks_ready(self, tag: str) -> int:
        """How many leading chunks of the tag's chunked tensor are mapped (0 while it sleeps)."""
        chunks = self._chunks.get(tag)
        if chunks is None:
            raise PoolError(f"tag '{tag}' has no chunked tensor (pool.empty_chunked)")
        return chunks.ready

    def wait_chunks(self, tag: str, n: int, timeout: float | None = None) -> int:
        """Wait until at least n chunks of the tag are ready, or until no more will come (the
        background mapping failed, was stopped by a sleep, or the tag sleeps). Returns chunks_ready."""
        chunks = self._chunks.get(tag)
        if chunks is None:
            raise PoolError(f"tag '{tag}' has no chunked tensor (pool.empty_chunked)")
        with chunks.cond:
            chunks.waiters += 1
            try:
                chunks.cond.wait_for(lambda: chunks.ready >= n or not chunks.active, timeout)
            finally:
                chunks.waiters -= 1
            return chunks.ready

    def _map_rest(self, tag: str, chunks: _Chunks) -> None:
        """The background mapper: chunks 1.. of a woken tag, in order, one at a time and without
        the pool's lock, so the engine's own calls (tag_state, stats) never wait for a whole chunk, and
        giving way between pieces to foreground calls (_foreground) and to a busy engine. Only
        a sleep of this tag or close() stop it, and they join it first (_stop_mapping). Whatever
        ends it (an error included), finish() tells the waiters that nothing more comes."""
        try:
            self._wait_for_clearing(chunks)
            for c in range(chunks.ready, len(chunks.pieces)):
                for address in chunks.pieces[c]:
                    self._yield_to_foreground(chunks)
                    if chunks.cancel.is_set() or self._closed:
                        break
                    try:
                        self._backend.map_pieces([address])
                    except PoolError as err:
                        # The tensor stays smaller until the next wake; pieces mapped so far are
                        # released by the next sleep like any mapped memory.
                        chunks.error = err
                        break
                else:
                    chunks.set_ready(c + 1)
                    if chunks.started is not None:
                        chunks.chunk_seconds.append(time.perf_counter() - chunks.started)
                    continue
                break
        except Exception as err:  # a bug, not the driver: still end the waits, and say why
            chunks.error = PoolError(f"the background mapping of '{tag}' failed: {type(err).__name__}: {err}")
            raise
        finally:
            chunks.finish()

    def _wait_for_clearing(self, chunks: _Chunks) -> None:
        """Before the background mapper's first piece: while the device still clears the memory the last
        sleep released (a wake right after it), creating memory waits inside the driver for that
        clearing, where no busy() check can hold it back, and a request running beside it is slow (H200, 1B:
        the first request after a level-2 wake right after its sleep 1.44-1.57x of one before; 1.24-1.48x
        with this wait, the rest being what the clearing itself costs the kernels beside it). So it starts
        once the device is done (backend.clearing_seconds), unless someone waits for chunks."""
        while (chunks.waiters == 0 and not chunks.cancel.is_set() and not self._closed
               and time.perf_counter() < self._cleared_at):
            chunks.cancel.wait(0.002)

    def yield_mapping_while(self, busy: Callable[[], bool] | None) -> None:
        """Let the background mapper give way to the foreground: while busy() (e.g. the engine has
        requests running) it maps nothing, unless someone waits for chunks (wait_chunks), who gets
        them at full speed; idle, it maps at once. Mapping device memory slows the kernels running
        beside it (H200: the first request after a wake ran 1.16-1.35x slower with the mapper at full
        speed beside it, 0.88-0.93x when nothing mapped during it)."""
        self._busy = busy

    def _yield_to_foreground(self, chunks: _Chunks) -> None:
        """Before each background piece, unless someone waits for chunks (wait_chunks: then at full speed):
        wait while busy(), and while a foreground call runs, until that call or another ends (the calls
        that ended while busy() held it back do not count: the call running when it stops does)."""
        busy = self._busy
        seen = self._front_ended
        while chunks.waiters == 0 and not chunks.cancel.is_set() and not self._closed:
            if busy is not None and busy():
                seen = self._front_ended
                chunks.cancel.wait(0.001)
                continue
            with self._front_cond:
                if not self._front or self._front_ended != seen:
                    return
                self._front_cond.wait(0.001)

    def _stop_mapping(self, tags: Iterable[str] | None = None) -> None:
        """Stop the background mappers of these tags (all when None); each finishes the chunk at
        hand. Waited for without the lock."""
        for tag, chunks in list(self._chunks.items()):
            if tags is not None and tag not in tags:
                continue
            mapper = chunks.mapper
            if mapper is not None:
                chunks.cancel.set()
                mapper.join()
                chunks.mapper = None
                chunks.finish()

    def adopt(self, module: torch.nn.Module, tag: str) -> torch.nn.Module:
        """Move every parameter and buffer of `module` into the pool under `tag`, in place.

        Parameter objects stay the same (only .data is replaced), so optimizers, tied weights and
        references held elsewhere keep working; values are copied exactly. Returns the module.
        """
        check_tag(tag)
        # Keyed by id() of objects kept alive in the values, so ids cannot be recycled meanwhile.
        params: dict[int, torch.nn.Parameter] = {}
        buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def pooled_copy(t: torch.Tensor) -> torch.Tensor:
            new = self.empty(tuple(t.shape), t.dtype, tag)
            new.copy_(t)
            return new

        with torch.no_grad():
            for mod in module.modules():
                for param in mod._parameters.values():
                    if param is None or id(param) in params:
                        continue  # tied weights are moved once
                    param.data = pooled_copy(param.detach())
                    params[id(param)] = param
                for name, buf in list(mod._buffers.items()):
                    if buf is None:
                        continue
                    if id(buf) not in buffers:
                        buffers[id(buf)] = (buf, pooled_copy(buf))
                    mod._buffers[name] = buffers[id(buf)][1]
        return module

    @contextmanager
    def use(self, tag: str) -> Iterator[None]:
        """Route allocations of this thread to the pool under `tag`.

        CUDA: every torch allocation inside lands in the pool. CPU: sets the default tag of
        pool.empty(). A tag cannot be slept while a use() of it is open (on any thread).
        """
        check_tag(tag)
        with self._lock:
            self._check_open()
            self._check_awake(tag, "allocate in")
            self._open_uses[tag] += 1
        stack = self._use_stack()
        stack.append(tag)
        try:
            with self._backend.use(tag):
                yield
        finally:
            stack.pop()
            with self._lock:
                self._open_uses[tag] -= 1

    def graph_pool(self, tag: str = "cuda_graph") -> Any:
        """The value to pass as torch.cuda.graph(g, pool=...) so the graph's memory lands in the
        pool under `tag`. CUDA only.

        Recipe (warm up inside use() so the cuBLAS workspace of the capture stream is pool memory
        too, then capture outside use(): torch refuses to route one pool twice at once):

            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with pool.use("cuda_graph"), torch.cuda.stream(stream):
                for _ in range(3):
                    fn(static_input)                       # warm-up
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool.graph_pool("cuda_graph"), stream=stream):
                static_output = fn(static_input)

        Call graph_pool() right at each capture (as above): it also tells the pool which tag the
        capture's allocations belong to. Capture before the first sleep: sleep releases torch's
        cached cuBLAS workspaces, and a later capture may reuse a workspace block of the pool.
        """
        check_tag(tag)
        with self._lock:
            self._check_open()
            self._check_awake(tag, "capture into")
            if self._use_stack():
                raise PoolError(
                    "pool.graph_pool() was called inside `with pool.use(...)`: capture the graph "
                    "outside use() (torch cannot route allocations to two pools at once); "
                    "see the recipe in MemoryPool.graph_pool's docstring"
                )
            return self._backend.graph_pool(tag)

    # ------------------------------------------------------------------ sleep and wake

    @_foreground
    def sleep(
        self,
        offload_tags: str | Iterable[str] = (),
        discard_tags: str | Iterable[str] = (),
    ) -> PoolSleepReport:
        """Release the physical memory of the given tags; returns when it is really free.

        Offloaded tags are copied to a host backup first and come back bit-exact on wake;
        discarded tags lose their content. Tags already asleep, and tags without allocations,
        are skipped. Addresses never change.
        """
        offload = _tag_list(offload_tags)
        discard = _tag_list(discard_tags)
        both = sorted(set(offload) & set(discard))
        if both:
            raise PoolError(f"tags {both} are both offloaded and discarded; pick one for each")
        clock = Clock()
        # A backup still being prepared in the background is finished before it is used, and chunks
        # still being mapped stop; both waited for outside the lock, so stats() keeps answering.
        self._join_preparation()
        clock.mark("wait_prepare")
        mappers = {t: c.describe() for t, c in self._chunks.items() if t in offload or t in discard}
        self._stop_mapping([*offload, *discard])
        clock.mark("stop_kv_mapper")
        chunked = sorted(set(offload) & set(self._chunks))
        if chunked:
            raise PoolError(f"tags {chunked} hold a chunked tensor, which can only be discarded")
        with self._lock:
            self._check_open()
            usage = self._backend.usage()
            todo_offload = [t for t in offload if self._needs_sleep(t, usage)]
            todo_discard = [t for t in discard if self._needs_sleep(t, usage)]
            busy = [t for t in todo_offload + todo_discard if self._open_uses[t] > 0]
            if busy:
                raise PoolError(
                    f"cannot sleep {busy}: a `with pool.use(...)` of them is still open; "
                    "leave it first (its allocations would land in released memory)"
                )
            if not todo_offload and not todo_discard:
                clock.mark("check")
                return PoolSleepReport(0, 0, clock.elapsed, timings=clock.report())
            clock.mark("check")
            try:
                cost = self._backend.sleep(todo_offload, todo_discard)
            except PoolError as err:
                released = self._reconcile(todo_offload, TagState.OFFLOADED)
                released += self._reconcile(todo_discard, TagState.DISCARDED)
                raise PoolError(
                    f"sleep failed: {err}. "
                    + (f"Tags {released} were released anyway and count as asleep. "
                       if released else "No memory was released. ")
                    + "Fix the cause and call sleep again."
                ) from err
            self._cleared_at = time.perf_counter() + self._backend.clearing_seconds(
                cost.bytes_offloaded + cost.bytes_discarded)
            for tag in todo_offload:
                self._sleeping[tag] = TagState.OFFLOADED
            for tag in todo_discard:
                self._sleeping[tag] = TagState.DISCARDED
                if tag in self._chunks:
                    self._chunks[tag].set_ready(0)
            backend = self._backend_phases(clock)
        # kv_mapper: how far the background mapping of the last wake had got when this sleep came
        # (a sleep right after a wake stops it and releases only what it mapped).
        return PoolSleepReport(cost.bytes_offloaded, cost.bytes_discarded, clock.elapsed, cost.copy_seconds,
                           timings=clock.report(**backend, kv_mapper=mappers))

    def _backend_phases(self, clock: Clock) -> dict[str, Any]:
        """Close the phase since the last mark (the backend's call and the state update) as the
        backend's own phases plus "state" (the rest), so the phases still add up to the call; returns
        what else the backend reported (driver calls)."""
        spent = clock.mark("backend")
        del clock.phases["backend"]
        timings = dict(getattr(self._backend, "last_timings", None) or {})
        inner = 0.0
        for phase, ms in timings.pop("phases_ms", {}).items():
            clock.add(phase, ms / 1e3)
            inner += ms / 1e3
        clock.add("state", max(0.0, spent - inner))
        timings.pop("total_ms", None)
        timings.pop("gc", None)  # the pool's clock counts the collections of the whole call
        return timings

    @_foreground
    def wake_up(self, tags: str | Iterable[str] | None = None) -> PoolWakeReport:
        """Re-create the memory of sleeping tags (all of them when tags is None) and restore
        offloaded content. All or nothing: on failure (e.g. out of memory) everything this call
        re-created is released again, the tags stay asleep, and PoolError says why."""
        wanted = None if tags is None else _tag_list(tags)
        clock = Clock()
        with self._lock:
            self._check_open()
            targets = [t for t in (self._sleeping if wanted is None else wanted) if t in self._sleeping]
            restore = [t for t in targets if self._sleeping[t] is TagState.OFFLOADED]
            remap = [t for t in targets if self._sleeping[t] is TagState.DISCARDED]
            if not targets:
                clock.mark("check")
                return PoolWakeReport(0, 0, clock.elapsed, timings=clock.report())
            lazy = [t for t in remap if t in self._chunks]
            defer = {a for t in lazy for chunk in self._chunks[t].pieces[1:] for a in chunk}
            clock.mark("check")
            try:
                # The wake that leaves nothing asleep may re-fill caches outside the pool (CUDA: torch's
                # own allocator, for the first request); an earlier, partial wake leaves that memory to
                # whoever still uses it (a trainer between wake_up(weights) and wake_up(kv_cache)).
                last = len(targets) == len(self._sleeping)
                cost = self._backend.wake(restore, remap, defer, warm_caches=last)
            except PoolError as err:
                awake = [t for t in targets if not self._backend.released(t)]
                for tag in awake:
                    del self._sleeping[tag]
                asleep = {t: s.value for t, s in self._sleeping.items() if t in targets}
                raise PoolError(
                    f"wake_up failed and was rolled back: {err}. Tags {asleep} stay asleep"
                    + (f" (rollback could not release {awake}, which count as awake)" if awake else "")
                    + "; free the resource named above and call wake_up again."
                ) from err
            for tag in targets:
                del self._sleeping[tag]
            backend = self._backend_phases(clock)
            for tag in lazy:
                chunks = self._chunks[tag]
                chunks.error = None
                chunks.cancel.clear()
                chunks.set_ready(1)
                if len(chunks.pieces) > 1:
                    chunks.start(lambda tag=tag, chunks=chunks: self._map_rest(tag, chunks))
            clock.mark("start_kv_mapper")
            if not self._keep_backups and restore:
                self._release_backups(restore)
                clock.mark("release_backups")
        return PoolWakeReport(cost.bytes_restored, cost.bytes_mapped, clock.elapsed, cost.copy_seconds,
                          timings=clock.report(**backend))

    def _needs_sleep(self, tag: str, usage: dict) -> bool:
        return tag not in self._sleeping and tag in usage and usage[tag].bytes > 0

    def _reconcile(self, tags: list[str], state: TagState) -> list[str]:
        released = [t for t in tags if self._backend.released(t)]
        for tag in released:
            self._sleeping[tag] = state
        return released

    # ------------------------------------------------------------------ inspection

    @_foreground
    def tag_of(self, tensor: torch.Tensor) -> str | None:
        """The tag whose memory holds the tensor's first byte, or None when it is not pool memory.
        For tests and invariant checks: memory outside the pool is memory sleep cannot free."""
        if tensor.device != self.device or tensor.numel() == 0:
            return None
        with self._lock:
            self._check_open()
            return self._backend.tag_of(tensor.data_ptr())

    @_foreground
    def check_backup_space(self, tags: str | Iterable[str]) -> None:
        """PoolError now when the backups of these tags (as allocated today) would not fit, so a
        server fails at start-up instead of at its first sleep."""
        with self._lock:
            self._check_open()
            usage = self._backend.usage()
            self._backend.check_backup_space(sum(usage[t].bytes for t in _tag_list(tags) if t in usage))

    def tag_state(self, tag: str) -> str:
        """'awake', 'offloaded' or 'discarded'; a tag never allocated is 'awake'."""
        check_tag(tag)
        with self._lock:
            return self._sleeping.get(tag, TagState.AWAKE).value

    def sleeping_tags(self) -> dict[str, str]:
        with self._lock:
            return {tag: state.value for tag, state in self._sleeping.items()}

    def stats_per_rank(self) -> list[PoolStats]:
        """One pool per rank; a tensor-parallel engine's pool facade lists every rank's."""
        return [self.stats()]

    @_foreground
    def stats(self) -> PoolStats:
        with self._lock:
            self._check_open()
            usage = self._backend.usage()
            tags = {}
            for tag in sorted(set(usage) | set(self._sleeping)):
                u = usage.get(tag)
                state = self._sleeping.get(tag, TagState.AWAKE).value
                tags[tag] = TagStats(u.bytes if u else 0, u.allocations if u else 0, state)
            free, total = self._backend.memory_info()
            return PoolStats(
                backend=self._backend.name,
                device=str(self.device),
                tags=tags,
                host_backup_bytes=sum(b.nbytes for b in list(self._backend.backups.values())),
                device_free=free,
                device_total=total,
                chunks={tag: c.describe() for tag, c in self._chunks.items()},
            )

    # ------------------------------------------------------------------ backups and lifetime

    # prepare_backups(only_if_room=True) takes at most this share of what the host can spare now
    # (pinned memory for CUDA, free disk for CPU), leaving the rest to whoever shares the machine.
    ROOM_SHARE = 0.5

    def prepare_backups(self, tags: str | Iterable[str], only_if_room: bool = True) -> int:
        """Allocate the host backups of awake tags now, in a background thread, so that their first
        sleep only copies (pinning the backup used to make the first level-1 sleep 10-30x slower
        than the next). Returns the bytes being prepared: 0 when nothing is to be done or, with
        only_if_room, when the backups would take more than ROOM_SHARE of the host memory (CUDA) or
        offload-folder space (CPU) free now, or when this pool frees its backups after each wake
        (keep_backups=False, the CPU default: nothing stays on disk while awake). A sleep, release_backups() or close() that comes first
        waits for the preparation; a failed preparation only leaves the work to the first sleep
        (prepare_error says why)."""
        wanted = _tag_list(tags)
        with self._lock:
            self._check_open()
            self._join_preparation()
            usage = self._backend.usage()
            todo = [t for t in wanted if t in usage and t not in self._sleeping]
            nbytes = sum(usage[t].bytes for t in todo)
            if not todo or (only_if_room and (not self._keep_backups
                                              or nbytes > self.ROOM_SHARE * self._backend.backup_room())):
                return 0
            self.prepare_error = None
            self._preparing = threading.Thread(target=self._prepare, args=(todo,), daemon=True,
                                               name="sleepserve-backups")
            self._preparing.start()
            return nbytes

    def _prepare(self, tags: list[str]) -> None:
        try:
            for tag in tags:
                self._backend.prepare_backup(tag)
        except PoolError as err:
            self.prepare_error = err

    def wait_prepared(self) -> None:
        """Wait for prepare_backups() to finish (it runs in the background)."""
        self._join_preparation()

    def _join_preparation(self) -> None:
        """Wait for the background preparation, without the lock (it never takes the lock)."""
        thread = self._preparing
        if thread is not None:
            thread.join()
            if self._preparing is thread:
                self._preparing = None

    def release_backups(self) -> None:
        """Free the host backups of awake tags (kept by default so the next sleep reuses them)."""
        self._join_preparation()
        with self._lock:
            self._check_open()
            self._release_backups([t for t in self._backend.backups if t not in self._sleeping])

    def _release_backups(self, tags: Iterable[str]) -> None:
        for tag in list(tags):
            backup = self._backend.backups.pop(tag, None)
            if backup is not None:
                backup.release()

    def close(self) -> None:
        """Release every byte the pool holds. Pool tensors must not be used afterwards."""
        self._join_preparation()
        self._stop_mapping()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sleeping.clear()
            # Backups first: no copy is in flight between calls, and the CUDA backend's close
            # gives up the context that frees pinned memory.
            self._release_backups(self._backend.backups)
            self._backend.close()

    def __enter__(self) -> "MemoryPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryPool(backend={self._backend.name!r}, device={str(self.device)!r}, sleeping={self.sleeping_tags()})"

