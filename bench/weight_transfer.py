"""Weight transfer into a running server, against its own references (one run, same machine).

--backend ipc (same GPU; shm on CPU): push the model's tensors through HTTP with WeightSender
  against (a) a plain device-to-device copy of the same bytes in this process and (b) the disk
  path: safetensors written by the trainer, then POST /update_weights {path}.
--backend nccl (trainer on GPU 0, server on GPU 1; gloo on CPU): push over the group against a
  raw broadcast of the same bytes in the same bucket size between two bare processes.
Random weights of real shapes (--models llama-1b,llama-8b); nothing is downloaded.

    python bench/weight_transfer.py --backend ipc --models llama-1b,llama-8b --out gpu-results/results
    python bench/weight_transfer.py --backend nccl --models llama-8b          # needs 2 GPUs
    python bench/weight_transfer.py --device cpu --backend ipc --models llama-tiny   # the CPU twin
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, table, write_json  # noqa: E402
from tests.models import model_folder  # noqa: E402
from server.weight_transfer import rendezvous  # noqa: E402
from server.weight_transfer.group import open_group  # noqa: E402
from server.weight_transfer.protocol import plan_buckets  # noqa: E402
from server.weight_transfer.sender import WeightSender  # noqa: E402
from tests.http_server import ServerProcess  # noqa: E402

GB = 1e9


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


def d2d_copy_s(named: list[tuple[str, torch.Tensor]], device: torch.device) -> float:
    """The floor: copying the same bytes once on the device, tensor by tensor, in this process."""
    dst = [torch.empty_like(t) for _, t in named]
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for d, (_, t) in zip(dst, named):
            d.copy_(t)
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
port, backend, dev, sizes, bucket, rounds = int(sys.argv[2]), sys.argv[3], sys.argv[4], [int(x) for x in sys.argv[5].split(',')], int(sys.argv[6]), int(sys.argv[7])
device = torch.device(dev)
store = rendezvous.join_store("127.0.0.1", port, 2, 300)
group = open_group(backend, store, 1, 2, device, 300)
for _ in range(rounds):
    for r in plan_buckets(sizes, bucket):
        buf = torch.empty(sum(sizes[i] for i in r), dtype=torch.uint8, device=device)
        group.wait_for(group.broadcast(buf))
print("done", flush=True)
"""


def raw_broadcast_s(named, backend: str, device: torch.device, peer_device: str, bucket: int, rounds: int = 3) -> float:
    """The ceiling for nccl/gloo: the same bytes, same buckets, between two bare processes."""
    sizes = [t.numel() * t.element_size() for _, t in named]
    port = rendezvous.free_port()
    env = dict(os.environ)
    if device.type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = peer_device
    peer = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(Path(__file__).resolve().parents[1]), str(port),
                             backend, "cuda:0" if device.type == "cuda" else "cpu", ",".join(map(str, sizes)),
                             str(bucket), str(rounds)], env=env)
    store = rendezvous.host_store("127.0.0.1", port, 2, 300)
    group = open_group(backend, store, 0, 2, device, 300)
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        pending = []
        for r in plan_buckets(sizes, bucket):
            buf = torch.empty(sum(sizes[i] for i in r), dtype=torch.uint8, device=device)
            pending.append(group.broadcast(buf))
            if len(pending) > 1:
                group.wait_for(pending.pop(0))
        for p in pending:
            group.wait_for(p)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    peer.wait(timeout=300)
    group.close()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="ipc", choices=["ipc", "nccl"])
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--buckets", default="256MiB,1GiB", help="bucket sizes to try (comma-separated)")
    ap.add_argument("--no-disk", action="store_true")
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
                 "--weight-transfer-config", json.dumps({"backend": backend})]
        env = {"CUDA_VISIBLE_DEVICES": "1"} if backend == "nccl" else None
        server = ServerProcess(serve, env=env).start()
        row: dict = {"model": name, "GB": nbytes / GB, "tensors": len(named)}
        try:
            if backend in ("ipc", "shm"):
                row["d2d_copy_s"] = d2d_copy_s(named, device)
            else:
                row["raw_broadcast_s"] = raw_broadcast_s(named, backend, device, "1", buckets[-1])
            sender = WeightSender(server.url, backend=backend, device=device, timeout_s=1800)
            sender.init()
            for bucket in buckets:
                sender.bucket_bytes = bucket
                sender.send(named)  # warm-up: buffers, IPC mapping, the first NCCL buckets
                best = min((sender.send(named) for _ in range(3)), key=lambda r: r["seconds"])
                row[f"push_s@{bucket >> 20}MiB"] = best["seconds"]
            sender.close()
            if not args.no_disk and backend in ("ipc", "shm"):
                row["disk_write_s"], row["disk_load_s"] = disk_s(server, named, root)
        finally:
            server.stop()
        del named
        if cuda:
            torch.cuda.empty_cache()
        push = min(v for k, v in row.items() if k.startswith("push_s@"))
        row["push_s"] = push
        row["push_GBps"] = nbytes / push / GB
        ref = row.get("d2d_copy_s") or row.get("raw_broadcast_s")
        row["push_over_reference"] = ref / push
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["rows"] = rows
    write_json(args.out, f"weight-transfer-{backend}-{args.device}", result)
    print(f"\nweight transfer ({backend}, {args.device}, {result['date']})")
    ref_name = "d2d copy" if backend in ("ipc", "shm") else "raw broadcast"
    print(table([[r["model"], f"{r['GB']:.2f} GB", f"{r['push_s']:.3f} s", f"{r['push_GBps']:.1f} GB/s",
                  f"{(r.get('d2d_copy_s') or r.get('raw_broadcast_s')):.3f} s", f"{r['push_over_reference']:.2f}",
                  (f"{r['disk_write_s']:.2f} + {r['disk_load_s']:.2f} s" if "disk_load_s" in r else "-")]
                 for r in rows],
                ["model", "bytes", "push through HTTP", "push GB/s", ref_name, "reference / push",
                 "disk: write + load"]))


if __name__ == "__main__":
    main()
