"""Weight transfer without disk, end to end on CPU: a trainer process pushes perturbed weights
through vLLM's routes over gloo (the NCCL protocol) and shared memory (the IPC protocol).

The reference for "the same weights" is the disk path: the same server loads the perturbed
checkpoint with /update_weights {path} and its greedy outputs are recorded; after a push they
must be equal. Between tests the original weights are loaded back from disk.
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from testkit.http_server import REPO, ServerProcess, BASE_ARGS, wait_for

from server.weight_transfer import safe_pickle
from server.weight_transfer.config import WeightTransferConfig
from server.weight_transfer.protocol import TensorMeta, pack_into, plan_buckets, unpack

pytestmark = pytest.mark.timeout(300)

ADMIN = "sk-weights-admin"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TRAINER = [sys.executable, str(REPO / "tests" / "weight_transfer" / "weight_trainer.py")]
BUCKET = str(16 << 20)  # ~34 buckets for the 0.5 GB model: a kill lands mid-send


# -- units: the protocol's pieces -----------------------------------------------------------------

def test_buckets_follow_vllms_rule_and_round_trip():
    # A bucket ends once it exceeds the size: the crossing tensor stays in it.
    assert plan_buckets([4, 4, 4, 4, 4], 7) == [range(0, 2), range(2, 4), range(4, 5)]
    assert plan_buckets([10, 1], 4) == [range(0, 1), range(1, 2)]
    assert plan_buckets([], 4) == []
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.randn(2, 2, 2).double()]
    metas = [TensorMeta(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
    buf = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8)
    assert pack_into(buf, tensors) == buf.numel()
    for (name, got), want in zip(unpack(buf, metas), tensors):
        assert torch.equal(got, want), name


def test_config_is_checked_at_startup():
    assert WeightTransferConfig.parse('{"backend": "gloo"}').backend == "gloo"
    assert WeightTransferConfig.parse(None) is None
    for bad, words in [("{", "not JSON"), ('["nccl"]', "JSON object"), ('{"backend": "rdma"}', "one of"),
                       ('{"backend": "nccl", "buckets": 3}', "unknown field")]:
        with pytest.raises(ValueError, match=words):
            WeightTransferConfig.parse(bad)
    with pytest.raises(ValueError, match="use 'gloo'"):
        WeightTransferConfig(backend="nccl").check_device("cpu")


def test_pickles_may_name_only_handle_types():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with pytest.raises(safe_pickle.UnsafePickleError, match="builtins.print"):
        safe_pickle.loads(pickle.dumps(Evil()))
    with pytest.raises(safe_pickle.UnsafePickleError):
        safe_pickle.loads_b64("not base64!")
    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 0, torch.storage.TypedStorage, torch.bfloat16, 0,
            b"\x01" * 64, 12, 0, False, b"r", 0, b"e", True)  # the shape of rebuild_cuda_tensor's args
    assert safe_pickle.loads_b64(safe_pickle.dumps_b64({"GPU-x": args})) == {"GPU-x": args}
    # Older vLLM pickles its own ctypes struct for the NCCL unique id: read back as ours.
    uid = safe_pickle.NcclUniqueId()
    uid.internal[3] = 9
    data = pickle.dumps(uid, protocol=3).replace(  # protocol 3 names classes as text: rename ours to vLLM's
        b"server.weight_transfer.safe_pickle\nNcclUniqueId", b"vllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId")
    assert b"pynccl_wrapper" in data and bytes(safe_pickle.loads(data)) == bytes(uid)


# -- end to end through the server ----------------------------------------------------------------

def launch(backend: str) -> ServerProcess:
    # --while-asleep reject: generation on invalid weights answers 503 at once (held otherwise).
    return ServerProcess([*BASE_ARGS, "--max-model-len", "256", "--while-asleep", "reject", "--weight-transfer-config",
                          json.dumps({"backend": backend})],
                         env={"SLEEPSERVE_DEV_MODE": "1", "SLEEPSERVE_ADMIN_API_KEY": ADMIN}).launch()


@pytest.fixture(scope="module")
def servers():
    # Both boot at once (a start is mostly waiting on the model load), launched from this thread:
    # the servers end with the thread that started them (PR_SET_PDEATHSIG).
    started = {backend: launch(backend) for backend in ("gloo", "shm")}
    for s in started.values():
        s.wait_ready()
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory, default_model_folder) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed")
    gen = torch.Generator().manual_seed(7)
    for f in sorted(default_model_folder.glob("*.safetensors")):
        tensors = load_file(str(f))
        save_file({n: (t * (1 + 0.2 * torch.randn(t.shape, generator=gen, dtype=t.dtype))).contiguous()
                   for n, t in tensors.items()}, str(out / f.name))
    return out


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120, **kw)


def greedy(server) -> list[str]:
    out = []
    for p in PROMPTS:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def state(server) -> dict:
    return admin(server, "GET", "/is_sleeping").json()


def load_from_disk(server, path: Path | None = None) -> list[str]:
    r = admin(server, "POST", "/update_weights", json={"path": str(path)} if path else {})
    assert r.status_code == 200, r.text
    assert state(server)["weights_valid"] is True
    return greedy(server)


@pytest.fixture(scope="module")
def references(servers, perturbed):
    """(original outputs, outputs after a disk load of the perturbed checkpoint), per server."""
    refs = {}
    for name, server in servers.items():
        original = greedy(server)
        refs[name] = (original, load_from_disk(server, perturbed))
        assert load_from_disk(server) == original
        assert refs[name][1] != original, "the perturbation must change greedy outputs"
    return refs


def trainer(server, backend: str, checkpoint: Path, *extra: str, wait: bool = True):
    cmd = [*TRAINER, server.url, backend, str(checkpoint), ADMIN, "--bucket-bytes", BUCKET, *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=240)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"the trainer printed nothing (exit {proc.returncode}):\n{err[-3000:]}"
    return proc.returncode, json.loads(lines[-1])


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_pushed_weights_serve_like_a_disk_load(servers, references, perturbed, backend):
    server = servers[backend]
    original, expected = references[backend]
    # The RL order: the weights (and the rotary tables that share their tag) were discarded.
    assert admin(server, "POST", "/sleep", params={"level": 2}).status_code == 200
    assert admin(server, "POST", "/wake_up", params={"tags": "weights"}).status_code == 200
    rc, report = trainer(server, backend, perturbed, "--weight-version", f"step-{backend}")
    assert rc == 0, report
    assert report["server"]["weights_valid"] is True and report["server"]["tensors"] > 100
    if backend == "gloo":
        # Sorted names, 16 MiB buckets: the embedding is a bucket alone and lands straight in its
        # parameter; the other buckets mix layers' tensors and are unpacked from a slot buffer.
        timings = report["update"]["timings"]
        assert timings["direct"] >= 1 and timings["staged"] >= 1, timings
        assert report["sender"]["staged"] >= 1, report["sender"]
    else:
        # a receive over handles says where its seconds went, and the sender sums them over the buckets
        parts = report["sender"]["server_parts_s"]
        assert set(parts) >= {"open_s", "copy_s", "verdict_s"} and parts["copy_s"] > 0, parts  # (sync_s: CUDA)
        assert sum(parts.values()) <= report["sender"]["server_copy_s"], report["sender"]
    assert admin(server, "GET", "/get_weight_version").json() == {"weight_version": f"step-{backend}"}
    assert admin(server, "POST", "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert greedy(server) == expected
    assert load_from_disk(server) == original


@pytest.mark.parametrize("how", ["--unpacked", "--flat"])
def test_copy_free_paths_serve_like_a_disk_load(servers, references, perturbed, how):
    """--unpacked: one broadcast per tensor, each received straight into its parameter (no bucket, no
    unpack). --flat: the trainer's tensors lie back to back in one buffer, so every bucket is
    broadcast from it without packing."""
    server = servers["gloo"]
    original, expected = references["gloo"]
    rc, report = trainer(server, "gloo", perturbed, how)
    assert rc == 0, report
    timings, sender = report["update"]["timings"], report["sender"]
    if how == "--unpacked":
        assert timings["direct"] == report["update"]["tensors"] > 100 and timings["staged"] == 0, timings
    else:
        assert sender["direct"] > 1 and sender["staged"] == 0, sender
    assert state(server)["weights_valid"] is True
    assert greedy(server) == expected
    assert load_from_disk(server) == original


def test_vllms_call_sequence_without_our_extensions(servers, references, perturbed):
    """A trainer that calls the routes as vLLM's helpers do (start, then an update with no go-ahead key
    whose broadcast starts at once, then finish, each answered before the next) is served the same:
    the ENGINE-thread commands and the finish that may wait for a write change nothing for it."""
    server = servers["gloo"]
    original, expected = references["gloo"]
    rc, report = trainer(server, "gloo", perturbed, "--vllm-calls", "--weight-version", "vllm-seq")
    assert rc == 0, report
    assert report["server"]["weights_valid"] is True and report["server"]["weight_version"] == "vllm-seq"
    assert report["update"]["tensors"] > 100
    assert greedy(server) == expected
    assert load_from_disk(server) == original


def test_a_bucket_lands_in_place_when_the_parameters_line_up():
    """In one process over gloo (two threads): a bucket that is exactly a fused q|k|v block in the
    announced order is broadcast into the block itself; one that is not (another order, a cast) goes
    through a slot buffer; both end equal to what was sent."""
    import threading

    import torch.distributed as dist
    from server.weight_transfer.broadcast_receive import BroadcastReceive
    from server.weight_transfer.group import GlooGroup
    from server.weight_transfer.protocol import region

    fused = torch.zeros(10, 4)
    q, k, v = fused.split([4, 3, 3])
    targets = {"q": q, "k": k, "v": v, "o": torch.zeros(4, 4), "n": torch.zeros(4)}
    assert region([q, k, v]) is not None and region([k, q]) is None and region([q, targets["o"]]) is None
    sent = {name: torch.randn(t.shape) for name, t in targets.items()}
    sent["n"] = sent["n"].double()  # cast on copy: never in place
    order = ["q", "k", "v", "o", "n"]
    metas = [TensorMeta(n, sent[n].dtype, tuple(sent[n].shape)) for n in order]
    bucket = sum(m.nbytes for m in metas[:3]) - 1  # bucket 0 closes exactly after v
    assert plan_buckets([m.nbytes for m in metas], bucket)[0] == range(0, 3)
    store = dist.HashStore()
    groups: dict[int, GlooGroup] = {}

    def join(rank: int) -> None:
        groups[rank] = GlooGroup(store, rank, 2, 30)
    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]

    def send() -> None:
        for r in plan_buckets([m.nbytes for m in metas], bucket):
            buf = torch.empty(sum(metas[i].nbytes for i in r), dtype=torch.uint8)
            pack_into(buf, [sent[order[i]] for i in r])
            groups[0].broadcast(buf)
    sender = threading.Thread(target=send)
    sender.start()
    loaded: set[str] = set()
    stats = BroadcastReceive(groups[1], targets, torch.device("cpu")).run(metas, True, bucket, loaded)
    sender.join(timeout=60)
    assert (stats.direct, stats.staged) == (1, 1), stats
    assert loaded == set(order)
    for name in order:
        assert torch.equal(targets[name], sent[name].to(targets[name].dtype)), name
    assert torch.equal(fused[:4], sent["q"])  # written through the block's own memory


class RecordingCuda:
    """Stand-ins for torch.cuda's Event, Stream, stream() and current_stream() that append to `log`
    what is asked of them ("record", stream, event id; "wait", stream, event id; "wait stream", stream,
    other), so the stream and event order of a CUDA transfer is checked on CPU. Streams made by the code
    under test are named `new_streams`; `current` is the stack of current streams, `first` at the bottom."""

    def __init__(self, monkeypatch, new_streams: str, first: str):
        import contextlib
        import itertools

        log: list[tuple] = []
        ids = itertools.count(1)

        class Event:
            def __init__(self, enable_timing: bool = False):
                self.id = next(ids)

            def record(self, stream) -> None:
                log.append(("record", stream.name, self.id))

            def query(self) -> bool:
                return True

            def elapsed_time(self, other) -> float:
                return 0.0

        class Stream:
            def __init__(self, name: str):
                self.name = name

            def wait_event(self, event) -> None:
                log.append(("wait", self.name, event.id))

            def wait_stream(self, other) -> None:
                log.append(("wait stream", self.name, other.name))

        current = [Stream(first)]

        @contextlib.contextmanager
        def on(stream):
            current.append(stream)
            yield
            current.pop()

        self.log, self.Event, self.Stream, self.current = log, Event, Stream, current
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream(new_streams))
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])


def test_the_stream_order_of_a_cuda_receive(monkeypatch):
    """The order BroadcastReceive gives its CUDA work, checked on CPU with streams and events that
    record what is asked of them (the real streams run in gpu_check's weights-nccl stage): the copy
    out of a bucket waits for that bucket's broadcast; the broadcast into a reused slot waits for the
    copy out of the bucket that used the slot before; a bucket that lines up with the parameters is
    broadcast into them with neither; the host waits for both streams' last work at the end."""
    from server.weight_transfer import broadcast_receive

    cuda = RecordingCuda(monkeypatch, new_streams="copy", first="host")
    log, Event, Stream, current = cuda.log, cuda.Event, cuda.Stream, cuda.current
    real_copy = broadcast_receive.BroadcastReceive._copy

    def copy(self, pairs):
        log.append(("copy", current[-1].name))
        real_copy(self, pairs)
    monkeypatch.setattr(broadcast_receive.BroadcastReceive, "_copy", copy)

    fused = torch.zeros(10, 4)
    q, k, v = fused.split([4, 3, 3])
    targets = {"q": q, "k": k, "v": v, **{f"t{i}": torch.zeros(4, 4) for i in range(9)}}
    sent = {name: torch.randn(t.shape) for name, t in targets.items()}
    order = list(targets)
    metas = [TensorMeta(n, torch.float32, tuple(sent[n].shape)) for n in order]
    bucket = 159  # [q k v] (160 bytes: in place), then three buckets of three 64-byte tensors
    plan = plan_buckets([m.nbytes for m in metas], bucket)
    assert [len(r) for r in plan] == [3, 3, 3, 3]
    packed = []
    for r in plan:
        buf = torch.empty(sum(metas[i].nbytes for i in r), dtype=torch.uint8)
        pack_into(buf, [sent[order[i]] for i in r])
        packed.append(buf)

    class Group:
        stream = Stream("nccl")

        def __init__(self):
            self.incoming = iter(packed)

        def broadcast(self, tensor, src=0):
            assert current[-1].name == "host"  # enqueued from the transfer thread's stream, as NcclBroadcaster expects
            tensor.copy_(next(self.incoming))  # the bytes "arrive" when enqueued: the log checks the order
            log.append(("bcast", "in place" if tensor.data_ptr() == fused.data_ptr() else "slot"))
            event = Event()
            event.record(self.stream)
            return event

        def wait_for(self, event) -> None:
            log.append(("host waits", event.id))

    loaded: set[str] = set()
    stats = broadcast_receive.BroadcastReceive(Group(), targets, torch.device("cpu"))
    stats.cuda = True  # a group with a stream: the CUDA path
    stats.copy_stream = Stream("copy")
    result = stats.run(metas, True, bucket, loaded)
    assert (result.direct, result.staged) == (1, 3) and loaded == set(order)
    for name in order:
        assert torch.equal(targets[name], sent[name]), name
    # The log, bucket by bucket.
    assert log[:2] == [("bcast", "in place"), ("record", "nccl", log[1][2])]  # no wait, no copy
    i, unpacked_by_slot, tokens = 2, {}, []
    for n in range(3):
        slot = n % 2
        if slot in unpacked_by_slot:  # the slot's previous copy must be done before new bytes land
            assert log[i] == ("wait", "nccl", unpacked_by_slot[slot]), (n, log[i])
            i += 1
        assert log[i] == ("bcast", "slot") and log[i + 1][:2] == ("record", "nccl"), (n, log[i:i + 2])
        token = log[i + 1][2]
        tokens.append(token)
        assert log[i + 2] == ("wait", "copy", token), (n, log[i + 2])  # the copy waits for its bytes
        assert log[i + 3][:2] == ("record", "copy") and log[i + 4] == ("copy", "copy"), (n, log[i + 3:i + 5])
        assert log[i + 5][:2] == ("record", "copy"), (n, log[i + 5])
        unpacked_by_slot[slot] = log[i + 5][2]
        i += 6
    # Then the last marks of both streams, and only now does the host wait (no wait per bucket before).
    assert [e[:2] for e in log[i:i + 2]] == [("record", "nccl"), ("record", "copy")]
    assert all(e[0] != "host waits" for e in log[:i + 2])
    assert [e[0] for e in log[i + 2:]] == ["host waits"] * (len(log) - i - 2)
    assert log[-1][1] == log[i + 1][2]  # the last wait is for the copy stream's last mark


def test_the_stream_order_of_a_cuda_send(monkeypatch):
    """The sender's side, the same way: packing starts after the trainer's own stream (which made
    the tensors), each pack is on the pack stream and its broadcast waits for it (the broadcast is
    enqueued with the pack stream current), the pack into a reused slot waits for the broadcast out
    of it, and a bucket that is one tensor's own memory is broadcast from it without packing."""
    from server.weight_transfer.sender import WeightSender

    cuda = RecordingCuda(monkeypatch, new_streams="pack", first="trainer")
    log, Event, Stream, current = cuda.log, cuda.Event, cuda.Stream, cuda.current
    sent: list[torch.Tensor] = []

    class Group:
        stream = Stream("nccl")

        def broadcast(self, tensor, src=0):
            sent.append(tensor.clone())
            log.append(("bcast", current[-1].name))  # NcclBroadcaster makes its stream wait for this one
            event = Event()
            event.record(self.stream)
            return event

        def wait_for(self, event) -> None:
            log.append(("host waits", event.id))

    tensors = [torch.randn(40)] + [torch.randn(4, 4) for _ in range(9)]  # 160 bytes alone, then 3 x 3 x 64
    sender = WeightSender("http://127.0.0.1:1", backend="gloo", bucket_bytes=159)
    sender.group = Group()
    report = sender._broadcast(tensors)
    assert (report["direct"], report["staged"]) == (1, 3)
    plan = plan_buckets([t.numel() * t.element_size() for t in tensors], 159)
    for got, r in zip(sent, plan):
        assert torch.equal(got, torch.cat([tensors[i].view(-1) for i in r]).view(torch.uint8)), r
    assert log[0] == ("wait stream", "pack", "trainer")
    assert log[1] == ("bcast", "trainer") and log[2][:2] == ("record", "nccl")  # in place: no pack
    i, sent_by_slot = 3, {}
    for n in range(3):
        slot = n % 2
        if slot in sent_by_slot:
            assert log[i] == ("wait", "pack", sent_by_slot[slot]), (n, log[i])
            i += 1
        assert [e[:2] for e in log[i:i + 2]] == [("record", "pack"), ("record", "pack")], (n, log[i:i + 2])
        assert log[i + 2] == ("bcast", "pack") and log[i + 3][:2] == ("record", "nccl"), (n, log[i + 2:i + 4])
        sent_by_slot[slot] = log[i + 3][2]
        i += 4
    assert all(e[0] == "host waits" for e in log[i:]) and len(log) - i == 4


def test_a_mismatch_is_refused_before_any_byte_moves(servers, references, perturbed):
    """Over gloo the trainer would otherwise be blocked in a broadcast the server never joins: the
    server's refusal reaches it through the rendezvous store, and it stops with the 400."""
    backend = "gloo"
    server = servers[backend]
    original, _ = references[backend]
    version = state(server)["weight_version"]
    rc, report = trainer(server, backend, perturbed, "--rename", "model.layers.99.mlp.up_proj.weight")
    assert rc == 3 and report["status"] == 400, report
    assert "unexpected tensor 'model.layers.99.mlp.up_proj.weight'" in report["error"]
    s = state(server)
    assert s["weights_valid"] is True and s["weight_version"] == version
    assert greedy(server) == original  # not one tensor of the perturbed set landed


def test_bad_update_info_answers_400(servers):
    server = servers["shm"]
    name = "model.norm.weight"
    cases = [
        ({"names": [name], "dtype_names": ["float32"], "shapes": [[3]], "ipc_handles": {"shm": "x"},
          "tensor_sizes": [12]}, "shape [3] but the model has"),
        ({"names": [name], "dtype_names": ["int64"], "shapes": [[576]], "ipc_handles": {"shm": "x"}},
         "not a floating-point dtype"),
        ({"names": [name, name], "dtype_names": ["float32"], "shapes": [[576]]}, "as long as each other"),
        ({"names": [name], "dtype_names": ["float32"], "shapes": [[576]], "ipc_handles": {"shm": "../etc/passwd"},
          "tensor_sizes": [2304]}, "shared-memory handle"),
        ({"names": [name], "dtype_names": ["float32"], "shapes": [[576]], "tensor_sizes": [2304],
          "ipc_handles_pickled": safe_pickle.dumps_b64(print)}, "builtins.print"),
        ({"names": [name], "dtype_names": ["float32"], "shapes": [[576]], "tensor_sizes": [4],
          "ipc_handles": {"shm": "x"}}, "tensor_sizes"),
    ]
    for info, words in cases:
        r = admin(server, "POST", "/update_weights", json={"update_info": info})
        assert r.status_code == 400, (info, r.text)
        assert words in r.json()["error"]["message"], (words, r.json())
    assert state(server)["weights_valid"] is True
    # The disk body still works on the same route, and its bad input still answers 400.
    assert admin(server, "POST", "/update_weights", json={"path": "/nonexistent"}).status_code == 400


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_trainer_killed_mid_send_leaves_no_silent_mix(servers, references, perturbed, backend):
    server = servers[backend]
    original, expected = references[backend]
    version = state(server)["weight_version"]
    proc = trainer(server, backend, perturbed, "--pause-after", "2", "--weight-version", "never", wait=False)
    try:
        assert proc.stdout.readline().strip() == "PAUSED", proc.stderr.read()[-3000:]
        # Mid-transfer the server keeps answering, and serves nothing from the half-written weights.
        assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "weights_invalid"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    wait_for(lambda: not state(server)["transfer_active"], timeout=60, what="the broken transfer to end")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "weights_invalid", r.text
    # Over gloo the sender had posted its finish before the kill (it waits on the server for the update):
    # the update failed, so did the finish, and no version names weights that never arrived.
    assert state(server)["weight_version"] == version
    # The next complete update brings the server back.
    rc, report = trainer(server, backend, perturbed)
    assert rc == 0, report
    assert state(server)["weights_valid"] is True
    assert greedy(server) == expected
    assert load_from_disk(server) == original


def test_sglang_style_routes(servers, references):
    server = servers["shm"]
    original, _ = references["shm"]
    r = admin(server, "POST", "/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert admin(server, "POST", "/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert admin(server, "POST", "/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert state(server)["weights_valid"] is False  # released without a copy, as SGLang does
    folder = str(REPO)  # not a checkpoint: 400, state unchanged
    assert admin(server, "POST", "/update_weights_from_disk", json={"model_path": folder}).status_code == 400
    from server.model.source import resolve_model
    r = admin(server, "POST", "/update_weights_from_disk",
              json={"model_path": str(resolve_model(None).folder), "weight_version": "disk-1"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert admin(server, "GET", "/get_weight_version").json()["weight_version"] == "disk-1"
    assert greedy(server) == original
    r = admin(server, "POST", "/update_weights_from_tensor", json={"serialized_named_tensors": ["eA=="]})
    assert r.status_code == 400 and "CUDA IPC" in r.json()["error"]["message"]
    r = admin(server, "POST", "/init_weights_update_group",
              json={"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2})
    assert r.status_code == 400 and "backend is 'shm'" in r.json()["error"]["message"]


def test_routes_need_a_configured_backend_and_the_admin_key(servers):
    server = servers["gloo"]
    r = httpx.post(server.url + "/start_weight_update", json={})
    assert r.status_code == 401
    r = admin(server, "POST", "/init_weight_transfer_engine",
              json={"init_info": {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 2,
                                  "world_size": 2}})
    assert r.status_code == 400 and "rank_offset" in r.json()["error"]["message"]


@pytest.mark.parametrize("backend, bad", [("gloo", float("nan")), ("shm", float("inf")), ("gloo", float("-inf")),
                                          ("shm", float("nan"))])
def test_a_push_of_nan_or_inf_is_refused_and_never_served(servers, references, default_model_folder, tmp_path,
                                                          backend, bad):
    """A diverged trainer step: its tensors land, are checked on the device (model/finite.py), and the update
    ends with 400 naming the tensor; the server then serves nothing (503 weights_invalid) until a complete
    good update."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    server = servers[backend]
    original, _ = references[backend]
    name = "model.layers.1.post_attention_layernorm.weight"
    with safe_open(str(next(default_model_folder.glob("*.safetensors"))), "pt") as f:
        t = f.get_tensor(name).clone()
    t[7] = bad
    save_file({name: t}, str(tmp_path / "model.safetensors"))
    rc, report = trainer(server, backend, tmp_path)
    assert rc == 3 and report["status"] == 400, report
    assert name in report["error"] and "NaN or Inf" in report["error"], report
    assert state(server)["weights_valid"] is False
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "weights_invalid", r.text
    assert load_from_disk(server) == original  # a complete good update brings it back
