"""Weight transfer into a running server, against its own references (one run, same machine).

--backend ipc (same GPU; shm on CPU): push the model's tensors through HTTP with WeightSender
  against (a) a plain device-to-device copy of the same bytes in this process and (b) the disk
  path: safetensors written by the trainer, then POST /update_weights {path}.
--backend nccl (trainer on GPU 0, server on GPU 1; gloo on CPU): push over the group against a
  raw broadcast of the same bytes between two bare processes (three ways: buckets of the largest
  size with the receiver waiting for each, the same buckets all enqueued, one broadcast per tensor
  all enqueued; the fastest is the reference).
  Beside it, in the same run, where the time goes: pushes in several modes (packed buckets of each
  size; one broadcast per tensor, received in place: no pack, no unpack; a trainer whose tensors
  lie in one flat buffer: no pack, the server's unpack alone), each with its phases (start, ready,
  data, answer, finish) and the server's receive timings (buckets in place / unpacked, device time
  of the unpack copies); packing alone on the trainer's GPU; an update of one small tensor (the
  HTTP round trips with no data).
Random weights of real shapes (--models llama-1b,llama-8b); nothing is downloaded.

    python bench/weight_transfer.py --backend ipc --models llama-1b,llama-8b --out gpu-results/results
    python bench/weight_transfer.py --backend nccl --models llama-8b          # needs 2 GPUs
    python bench/weight_transfer.py --device cpu --backend ipc --models llama-tiny   # the CPU twin
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, table, timed, write_json  # noqa: E402
from testkit.models import model_folder  # noqa: E402
from server.weight_transfer import rendezvous  # noqa: E402
from server.weight_transfer.group import open_group  # noqa: E402
from server.weight_transfer.config import DEFAULT_BUCKET_BYTES  # noqa: E402
from server.weight_transfer.protocol import pack_into, plan_buckets  # noqa: E402
from server.weight_transfer.sender import WeightSender, _SendClock  # noqa: E402
from testkit.http_server import ServerProcess  # noqa: E402

GB = 1e9
TIMEOUT_S = 120  # a transfer that stalls fails in minutes, and the other modes still run


def shapes(folder: Path) -> list[tuple[str, tuple[int, ...]]]:
    from server.model.config import ModelConfig
    from server.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_folder(folder), 4096)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def make_tensors(folder: Path, device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(1)
    return [(n, torch.empty(s, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)) for n, s in shapes(folder)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def d2d_copy_s(named: list[tuple[str, torch.Tensor]], device: torch.device, copy_many=None, finish=None,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """The floor: copying the same bytes once on the device, tensor by tensor, in this process (best of 3).
    copy_many([(name, dst, src), ...]): another copy than dst.copy_(src), called once per bucket of
    bucket_bytes (as a receive unpacks them); finish(): run after the copies, inside the timing."""
    dst = [torch.empty_like(t) for _, t in named]
    buckets = plan_buckets([t.numel() * t.element_size() for _, t in named], bucket_bytes)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for bucket in buckets:
            triples = [(named[i][0], dst[i], named[i][1]) for i in bucket]
            if copy_many:
                copy_many(triples)
            else:
                for _, d, t in triples:
                    d.copy_(t)
        if finish:
            finish()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def disk_s(server: ServerProcess, named: list[tuple[str, torch.Tensor]], root: Path) -> tuple[float, float]:
    """(trainer writes safetensors, server loads them) in seconds: the path a push replaces."""
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(dir=root))
    t0 = time.perf_counter()
    save_file({n: t.contiguous() for n, t in named}, str(folder / "model.safetensors"))
    os.sync()
    write = time.perf_counter() - t0
    with server.client(timeout=1800) as c:
        t0 = time.perf_counter()
        r = c.post("/update_weights", json={"path": str(folder)})
        load = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    (folder / "model.safetensors").unlink()
    return write, load


RAW_RECEIVER = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from server.weight_transfer import rendezvous
from server.weight_transfer.group import open_group
from server.weight_transfer.protocol import plan_buckets
port, backend, dev, sizes, bucket, rounds, pipelined = int(sys.argv[2]), sys.argv[3], sys.argv[4], [int(x) for x in sys.argv[5].split(',')], int(sys.argv[6]), int(sys.argv[7]), sys.argv[8] == "1"
device = torch.device(dev)
store = rendezvous.join_store("127.0.0.1", port, 2, 300)
group = open_group(backend, store, 1, 2, device, 300)
plan = plan_buckets(sizes, bucket)
largest = max(sum(sizes[i] for i in r) for r in plan)
slots = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
for _ in range(rounds):
    pending = []
    for k, r in enumerate(plan):
        buf = slots[k % 2][:sum(sizes[i] for i in r)]
        if pipelined:  # enqueue all: the stream orders them (the bytes are dropped)
            pending.append(group.broadcast(buf))
        else:
            group.wait_for(group.broadcast(buf))
    for p in pending:
        group.wait_for(p)
print("done", flush=True)
"""


def raw_broadcast_s(named, backend: str, device: torch.device, peer_device: str, bucket: int, rounds: int = 3,
                    pipelined: bool = False) -> float:
    """The ceiling for nccl/gloo: the same bytes, same buckets, between two bare processes. The
    receiver waits for each bucket before the next (pipelined=False) or enqueues them all."""
    sizes = [t.numel() * t.element_size() for _, t in named]
    port = rendezvous.free_port()
    env = dict(os.environ)
    if device.type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = peer_device
    peer = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(Path(__file__).resolve().parents[1]), str(port),
                             backend, "cuda:0" if device.type == "cuda" else "cpu", ",".join(map(str, sizes)),
                             str(bucket), str(rounds), "1" if pipelined else "0"], env=env)
    store = rendezvous.host_store("127.0.0.1", port, 2, 300)
    group = open_group(backend, store, 0, 2, device, 300)
    plan = plan_buckets(sizes, bucket)
    largest = max(sum(sizes[i] for i in r) for r in plan)
    slots = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        pending = []
        for k, r in enumerate(plan):
            pending.append(group.broadcast(slots[k % 2][:sum(sizes[i] for i in r)]))
            if len(pending) > 1 and not pipelined:
                group.wait_for(pending.pop(0))
        for p in pending:
            group.wait_for(p)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    peer.wait(timeout=300)
    group.close()
    return best


def pack_alone_s(named: list[tuple[str, torch.Tensor]], device: torch.device, bucket: int) -> float:
    """The trainer's packing of every bucket on its own (no broadcast): the device copies a push
    makes on the trainer's GPU, unhidden."""
    tensors = [t for _, t in named]
    plan = plan_buckets([t.numel() * t.element_size() for t in tensors], bucket)
    largest = max(sum(tensors[i].numel() * tensors[i].element_size() for i in r) for r in plan)
    slots = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]

    def pack_all() -> None:
        for k, r in enumerate(plan):
            pack_into(slots[k % 2], [tensors[i] for i in r])
    pack_all()
    return min(timed(pack_all, device) for _ in range(3))


def flat_copy(named: list[tuple[str, torch.Tensor]], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The same tensors as views of one buffer, back to back in this order (a trainer with a flat
    parameter buffer): every bucket is then broadcast from it without packing."""
    flat = torch.empty(sum(t.numel() * t.element_size() for _, t in named), dtype=torch.uint8, device=device)
    out, offset = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        view = flat[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append((name, view))
        offset += n
    return out


def best_send(sender: WeightSender, named, rounds: int = 3) -> dict:
    sender.send(named)  # warm-up: buffers, IPC mapping, the first NCCL buckets
    return min((sender.send(named) for _ in range(rounds)), key=lambda r: r["seconds"])


def breakdown(report: dict) -> dict:
    """What one send spent where: host phases, the trainer's buckets, the server's receive."""
    return {"seconds": report["seconds"], "phases": report.get("phases", {}), "sender": report.get("sender", {}),
            "stages": stage_times(report.get("walls") or {}, report.get("update")),
            "server": (report.get("update") or {}).get("timings", {}),
            "server_receive_s": (report.get("update") or {}).get("seconds")}


def push_modes(sender: WeightSender, named, buckets: list[int], backend: str, device: torch.device, row: dict) -> None:
    """Every push mode, best of 3 each; push_s@MODE and its breakdown go into the row."""
    modes: list[tuple[str, dict, bool]] = [(f"{b >> 20}MiB", {"bucket_bytes": b, "packed": True}, True) for b in buckets]
    if backend in ("nccl", "gloo"):
        modes.append(("tensor", {"packed": False}, True))
        modes.append((f"{buckets[-1] >> 20}MiB-flat", {"bucket_bytes": buckets[-1], "packed": True}, False))
    row["breakdown"] = {}
    for label, settings, headline in modes:
        for k, v in settings.items():
            setattr(sender, k, v)
        try:
            if label.endswith("-flat"):
                flat = flat_copy(named, device)
                best = best_send(sender, flat)
                del flat
            else:
                best = best_send(sender, named)
        except Exception as e:  # one mode failing must not lose the others' figures
            print(f"  push {label} FAILED: {type(e).__name__}: {e}", flush=True)
            row.setdefault("errors", {})[label] = f"{type(e).__name__}: {e}"
            if sender.group is not None:  # a broken group: both sides start a new one
                sender.group.close(abort=True)
                sender.group = None
                sender.init()
            continue
        row[f"push_s@{label}"] = best["seconds"]
        row["breakdown"][label] = breakdown(best)
        if headline and best["seconds"] < row.get("push_s", float("inf")):
            row["push_s"], row["push_mode"] = best["seconds"], label
        print(f"  push {label}: {best['seconds'] * 1e3:.1f} ms", flush=True)
    sender.packed, sender.bucket_bytes = True, buckets[-1]
    control(sender, named, row)


# An update's stages, from the trainer's and the server's wall clocks (one host): the sender's `walls`
# and the server's `clock` in its answer.
STAGES = [("trainer -> API", "posted", "api_in"), ("API -> engine thread", "api_in", "engine_in"),
          ("engine -> transfer thread", "engine_in", "transfer_in"), ("go-ahead -> trainer", "transfer_in", "ready_seen"),
          ("bytes", "ready_seen", "landed"),
          ("landed -> engine thread", "landed", "closing"), ("engine -> API", "closing", "api_out"),
          ("API -> trainer", "api_out", "answer_read")]


def stage_times(walls: dict, update: dict | None) -> dict[str, float]:
    moments = {**((update or {}).get("clock") or {}), **walls}
    return {name: moments[b] - moments[a] for name, a, b in STAGES if a in moments and b in moments}


def control(sender: WeightSender, named, row: dict, rounds: int = 30) -> None:
    """Where a push's HTTP round trips go: the median of `rounds` of each control call, through the
    sender's own kept-alive connection, with one small tensor (no data to speak of). The floors: GET
    /health (HTTP alone) and POST /reset_prefix_cache (HTTP and a round trip to the engine thread).
    Then vLLM's calls one by one (start; an update of one tensor, until its answer, with the time until
    the server said it receives; finish) and the whole one-tensor push as WeightSender sends it (the
    start folded into the update, the finish posted while the bytes move): control_s, its best."""
    small = [min(named, key=lambda nt: nt[1].numel())]
    distributed = sender.backend in ("nccl", "gloo")
    calls: dict[str, list[float]] = {k: [] for k in ("health", "engine_floor", "start", "update", "update_ready",
                                                     "finish", "push")}

    def lap(key: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        calls[key].append(time.perf_counter() - t0)

    where: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for i in range(rounds + 3):  # the first 3: warm-up
        lap("health", lambda: sender._http.get("/health"))
        lap("engine_floor", lambda: sender.post("/reset_prefix_cache", {}))
        lap("start", lambda: sender.post("/start_weight_update", {}))
        clock = _SendClock()
        answer: dict = {}
        lap("update", lambda: answer.update(sender._send_broadcast(small, clock, None)[0] if distributed
                                            else sender._send_handles(small, clock)[0]))
        calls["update_ready"].append(clock.laps.get("ready_s", 0.0))
        for name, seconds in stage_times(clock.walls, answer).items():
            where[name].append(seconds)
        lap("finish", lambda: sender.post("/finish_weight_update", {}))
        lap("push", lambda: sender.send(small))
        if i < 3:
            for v in [*calls.values(), *where.values()]:
                v.clear()
    row["control_ms"] = {k: statistics.median(v) * 1e3 for k, v in calls.items()}
    row["control_s"] = min(calls["push"])
    c = row["control_ms"]
    print(f"  control calls (median of {rounds}, ms): GET /health {c['health']:.2f} (HTTP floor), "
          f"POST /reset_prefix_cache {c['engine_floor']:.2f} (+ engine thread); vLLM's calls: start "
          f"{c['start']:.2f}, update of one tensor {c['update']:.2f}"
          + (f" (server receiving after {c['update_ready']:.2f})" if distributed else "")
          + f", finish {c['finish']:.2f}; one-tensor push as WeightSender sends it {c['push']:.2f}", flush=True)
    if all(where.values()):
        row["update_stages_ms"] = {k: statistics.median(v) * 1e3 for k, v in where.items()}
        print("  one-tensor update, where (median ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["update_stages_ms"].items()), flush=True)


def print_breakdown(rows: list[dict], backend: str) -> None:
    ms = lambda x: f"{x * 1e3:.1f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
    for r in rows:
        if "breakdown" not in r:
            continue
        print(f"\nwhere the time goes ({r['model']}, {backend}; ms, best push of 3 per mode)")
        refs = [f"raw broadcast {ms(r['raw_broadcast_s'])}" if "raw_broadcast_s" in r else None,
                f"(the fastest of: receiver waiting per bucket {ms(r.get('raw_broadcast_synced_s'))}, "
                f"all buckets enqueued {ms(r.get('raw_broadcast_pipelined_s'))}, "
                f"one broadcast per tensor {ms(r.get('raw_broadcast_tensor_s'))})" if "raw_broadcast_synced_s" in r else None,
                f"packing alone on the trainer {ms(r.get('pack_alone_s'))}" if "pack_alone_s" in r else None,
                f"one-tensor push (HTTP round trips, no data; best) {ms(r.get('control_s'))}"]
        print("; ".join(x for x in refs if x))
        c = r.get("control_ms")
        if c:
            print(f"control calls (median ms): GET /health {c['health']:.2f}, POST /reset_prefix_cache "
                  f"{c['engine_floor']:.2f}, start {c['start']:.2f}, one-tensor update {c['update']:.2f}, finish "
                  f"{c['finish']:.2f}, one-tensor push {c['push']:.2f}; the update's stages: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in (r.get("update_stages_ms") or {}).items()))
        lines = []
        for label, b in r["breakdown"].items():
            ph, snd, srv = b["phases"], b["sender"], b["server"]
            if backend in ("ipc", "shm"):
                lines.append([label, ms(b["seconds"]), ms(ph.get("start_s")), ms(ph.get("pack_s")),
                              ms(ph.get("post_s")), ms(snd.get("server_copy_s")), ms(ph.get("finish_s")),
                              snd.get("chunks", "-")])
                continue
            ratio = f"{r['raw_broadcast_s'] / b['seconds']:.2f}" if "raw_broadcast_s" in r else "-"
            lines.append([label, ms(b["seconds"]), ratio, ms(ph.get("start_s")), ms(ph.get("ready_s")), ms(ph.get("data_s")),
                          ms(ph.get("answer_s")), ms(ph.get("finish_s")),
                          f"{snd.get('direct', '-')}/{snd.get('staged', '-')}", ms(snd.get("pack_gpu_s")),
                          f"{srv.get('direct', '-')}/{srv.get('staged', '-')}", ms(srv.get("unpack_gpu_s")),
                          ms(srv.get("enqueue_s")), ms(srv.get("wait_s")), ms(srv.get("alloc_s")),
                          ms(b.get("server_receive_s"))])
        if backend in ("ipc", "shm"):
            print(table(lines, ["mode", "push", "start", "trainer packs (+sync)", "posts", "server copies (in posts)",
                                "finish", "chunks"]))
        else:
            print(table(lines, ["mode", "push", "raw / push", "start", "ready", "data", "answer", "finish",
                                "trainer in place/packed",
                                "pack GPU", "server in place/unpacked", "unpack GPU", "server enqueue", "server wait",
                                "server alloc", "server receive"]))
            staged = [[label, *(ms(b["stages"].get(name)) for name, _, _ in STAGES)]
                      for label, b in r["breakdown"].items() if b.get("stages")]
            if staged:
                print(table(staged, ["mode", *(name for name, _, _ in STAGES)]))
            print("start/ready/data/answer/finish: the trainer's host phases (start: folded into the update, so "
                  "~0; POST update until the server says it receives; broadcasting until the last bucket left; the "
                  "update's answer; the finish's answer, posted at 'ready'). in place = broadcast from/into the "
                  "tensors' own memory; packed/unpacked = through a bucket buffer. Second table: the update's "
                  "stages from both sides' wall clocks (bytes: from the trainer's go-ahead to the server's last "
                  "byte landed).")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="ipc", choices=["ipc", "nccl"])
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--buckets", default="256MiB,1GiB", help="bucket sizes to try (comma-separated)")
    ap.add_argument("--no-disk", action="store_true")
    ap.add_argument("--control-only", action="store_true",
                    help="only the control calls' latency (no references, no full pushes): quick, e.g. on CPU")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from server.config import parse_size

    cuda = args.device == "cuda"
    backend = args.backend if cuda else {"ipc": "shm", "nccl": "gloo"}[args.backend]
    device = torch.device("cuda:0" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    buckets = [parse_size(b) for b in args.buckets.split(",")]
    root = Path(tempfile.mkdtemp(prefix="sleepserve-wt-"))
    result: dict = {"date": now_iso(), "device": args.device, "backend": backend, "rows": []}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(device)
    rows = []
    for name in args.models.split(","):
        folder = model_folder(name, root / "models", max_position_embeddings=4096)
        named = make_tensors(folder, device, dtype)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        serve = [str(folder), "--device", args.device, "--load-format", "dummy", "--max-model-len", "1024",
                 "--kv-cache-memory", "1GiB", "--enforce-eager", "--dev-mode",
                 "--weight-transfer-config", json.dumps({"backend": backend, "timeout_s": TIMEOUT_S})]
        env = {"CUDA_VISIBLE_DEVICES": "1"} if backend == "nccl" else None
        server = ServerProcess(serve, env=env).start()
        row: dict = {"model": name, "GB": nbytes / GB, "tensors": len(named)}
        try:
            if args.control_only:
                sender = WeightSender(server.url, backend=backend, device=device, timeout_s=TIMEOUT_S)
                sender.init()
                control(sender, named, row)
                sender.close()
                rows.append(row)
                continue
            if backend in ("ipc", "shm"):
                row["d2d_copy_s"] = d2d_copy_s(named, device)
            else:
                row["raw_broadcast_synced_s"] = raw_broadcast_s(named, backend, device, "1", buckets[-1])
                row["raw_broadcast_pipelined_s"] = raw_broadcast_s(named, backend, device, "1", buckets[-1],
                                                                   pipelined=True)
                # One broadcast per tensor, all enqueued: the ceiling of the per-tensor push.
                row["raw_broadcast_tensor_s"] = raw_broadcast_s(named, backend, device, "1", 1, pipelined=True)
                row["raw_broadcast_s"] = min(row["raw_broadcast_synced_s"], row["raw_broadcast_pipelined_s"],
                                             row["raw_broadcast_tensor_s"])
                row["pack_alone_s"] = pack_alone_s(named, device, buckets[-1])
            print(f"{name}: references done", flush=True)
            sender = WeightSender(server.url, backend=backend, device=device, timeout_s=TIMEOUT_S)
            sender.init()
            push_modes(sender, named, buckets, backend, device, row)
            sender.close()
            if not args.no_disk and backend in ("ipc", "shm"):
                row["disk_write_s"], row["disk_load_s"] = disk_s(server, named, root)
        finally:
            server.stop()
        del named
        if cuda:
            torch.cuda.empty_cache()
        push = row.get("push_s")  # absent only if every mode failed
        ref = row.get("d2d_copy_s") or row.get("raw_broadcast_s")
        row["push_GBps"] = nbytes / push / GB if push else None
        row["push_over_reference"] = ref / push if push else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["rows"] = rows
    if args.control_only:
        write_json(args.out, f"weight-transfer-control-{backend}-{args.device}", result)
        return
    write_json(args.out, f"weight-transfer-{backend}-{args.device}", result)
    print(f"\nweight transfer ({backend}, {args.device}, {result['date']})")
    ref_name = "d2d copy" if backend in ("ipc", "shm") else "raw broadcast"
    print(table([[r["model"], f"{r['GB']:.2f} GB",
                  f"{r['push_s']:.3f} s ({r.get('push_mode', '-')})" if r.get("push_s") else "failed",
                  f"{r['push_GBps']:.1f} GB/s" if r.get("push_GBps") else "-",
                  f"{(r.get('d2d_copy_s') or r.get('raw_broadcast_s')):.3f} s",
                  f"{r['push_over_reference']:.2f}" if r.get("push_over_reference") else "-",
                  (f"{r['disk_write_s']:.2f} + {r['disk_load_s']:.2f} s" if "disk_load_s" in r else "-")]
                 for r in rows],
                ["model", "bytes", "push through HTTP", "push GB/s", ref_name, "reference / push",
                 "disk: write + load"]))
    print_breakdown(rows, backend)


if __name__ == "__main__":
    main()
