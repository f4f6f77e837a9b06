"""What the non-finite weight check (server/model/finite.py) costs on an update of a model's shape.

In this process, on the model's tensors (random weights of the real shapes, nothing downloaded):
  check: one min/max reduction per tensor queued on the device, then one host read of all of them (what every
         update runs after its tensors land);
  copy:  a device-to-device copy of the same bytes (the least any update costs);
  checked copy: the same copy through FiniteCheck.copy (CUDA: copy and check in one pass, what an IPC or
         staged NCCL receive runs), then its host read.
With --push (ipc on CUDA, shm on CPU): the same push into two servers up at once, one with the check and one
started with --no-check-weights-finite, in turn (the median of --rounds each): the check's share of a real
push. Goal: <= 5%.

    python bench/finite_check.py --models llama-8b --push          # H200: the issue's figure
    python bench/finite_check.py --device cpu --models llama-tiny   # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import now_iso, write_json  # noqa: E402
from bench.weight_transfer import TIMEOUT_S, d2d_copy_s, make_tensors, sync  # noqa: E402
from server.model.finite import FiniteCheck  # noqa: E402
from testkit.models import model_folder  # noqa: E402


def check_s(named: list[tuple[str, torch.Tensor]], device: torch.device, rounds: int) -> tuple[float, float]:
    """(median, best) seconds of one whole check over the tensors, after a warm-up."""
    times = []
    for i in range(rounds + 1):
        sync(device)
        t0 = time.perf_counter()
        check = FiniteCheck()
        for name, t in named:
            check.add(name, t)
        assert check.bad() == [], "random weights are finite"
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def checked_copy_s(named: list[tuple[str, torch.Tensor]], device: torch.device, per_tensor: bool = False) -> float:
    """Every tensor copied through FiniteCheck.copy_many a bucket at a time (as an IPC or staged NCCL receive
    unpacks one; per_tensor: one call, so one launch, per tensor), then the one host read (best of 3)."""
    check = FiniteCheck()

    def verify() -> None:
        assert check.bad() == [], "random weights are finite"

    def one_by_one(triples) -> None:
        for triple in triples:
            check.copy_many([triple])

    return d2d_copy_s(named, device, copy_many=one_by_one if per_tensor else check.copy_many, finish=verify)


# The server's receives, split (summed over the buckets; WeightReceiver.last_stats): the IPC handle's opening, the
# host queueing the copies (and the check's launches), the wait for the device, the verdicts' read.
RECEIVE_PARTS = ("open_s", "copy_s", "sync_s", "verdict_s")


def push_parts(report: dict) -> dict[str, float]:
    """Where a push's seconds go, from a send's report (WeightSender.send): the server's receives (each bucket's
    copy, check and sync, as its transfer thread timed them), the sender's packing, the posts around those receives
    (HTTP, the engine's hand-over), the finish; then the receives' RECEIVE_PARTS as receive_<part>."""
    phases, receive = report["phases"], report["sender"].get("server_copy_s", 0.0)
    server = report["sender"].get("server_parts_s") or {}
    return {"server_receive_s": receive, "pack_s": phases.get("pack_s", 0.0),
            "post_minus_receive_s": phases.get("post_s", 0.0) - receive, "finish_s": phases.get("finish_s", 0.0),
            **{f"receive_{part}": server.get(part, 0.0) for part in RECEIVE_PARTS}}


def paired_share(checked: list[float], unchecked: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """The check's share of the push from the rounds' pairs (each round pushes to both servers in turn, so a slow
    moment of the host lands on both of a pair): the median of checked - unchecked over the median checked push,
    and a bootstrap 95% interval over the rounds."""
    import random

    pairs = list(zip(checked, unchecked))

    def share(sample: list[tuple[float, float]]) -> float:
        return statistics.median(c - u for c, u in sample) / statistics.median(c for c, _ in sample)

    rng = random.Random(0)
    draws = sorted(share([rng.choice(pairs) for _ in pairs]) for _ in range(resamples))
    return share(pairs), draws[int(0.025 * resamples)], draws[int(0.975 * resamples) - 1]


def push_times(folder: Path, named, backend: str, device: torch.device, rounds: int) -> dict:
    """Seconds of each push of the tensors into two servers up at once, one with the check and one without
    (--no-check-weights-finite), in turn: on, off, on, off... so neither pays for coming first (with one server
    after the other, best of 5 each, the same tree read 10.1% on one run and -5.4% on another, 2026-12-05/06).
    {True: [...], False: [...]} (checked, unchecked), and under "parts" each push's push_parts the same way: on
    one H100 host the check cost 2.9% of the push, on another 12.5% (2026-12-06), which the parts can place."""
    from server.weight_transfer.sender import WeightSender
    from testkit.http_server import ServerProcess

    args = [str(folder), "--device", device.type, "--load-format", "dummy", "--max-model-len", "1024",
            "--kv-cache-memory", "1GiB", "--enforce-eager", "--dev-mode",
            "--weight-transfer-config", json.dumps({"backend": backend, "timeout_s": TIMEOUT_S})]
    servers = {check: ServerProcess(args + ([] if check else ["--no-check-weights-finite"])) for check in (True, False)}
    senders: dict[bool, WeightSender] = {}
    times: dict[bool, list[float]] = {True: [], False: []}
    parts: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for check, server in servers.items():
            server.start()
            senders[check] = WeightSender(server.url, backend=backend, device=device, timeout_s=TIMEOUT_S)
            senders[check].init()
        for _ in range(rounds + 1):  # the first round of each warms its server up, not timed
            for check, sender in senders.items():
                t0 = time.perf_counter()
                report = sender.send(named)
                times[check].append(time.perf_counter() - t0)
                parts[check].append(push_parts(report))
                assert report["server"]["weights_valid"] is True, report
        for sender in senders.values():
            sender.close()
        return {**{check: t[1:] for check, t in times.items()}, "parts": {check: p[1:] for check, p in parts.items()}}
    finally:
        for server in servers.values():
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--models", default="llama-8b")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--push", action="store_true", help="also push through the server with the check on and off")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    root = Path(tempfile.mkdtemp(prefix="sleepserve-finite-"))
    result: dict = {"date": now_iso(), "device": args.device, "rows": []}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(device)
    for name in args.models.split(","):
        folder = model_folder(name, root / "models", max_position_embeddings=4096)
        named = make_tensors(folder, device, dtype)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        median, best = check_s(named, device, args.rounds)
        row = {"model": name, "GB": nbytes / 1e9, "tensors": len(named), "check_median_s": median,
               "check_best_s": best, "check_GBps": nbytes / median / 1e9, "d2d_copy_s": d2d_copy_s(named, device)}
        row["check_over_copy"] = median / row["d2d_copy_s"]
        row["checked_copy_s"] = checked_copy_s(named, device)
        row["checked_copy_over_copy"] = row["checked_copy_s"] / row["d2d_copy_s"]
        row["checked_copy_per_tensor_s"] = checked_copy_s(named, device, per_tensor=True)
        print(f"{name}: copy and check in one pass {1e3 * row['checked_copy_s']:.1f} ms, a launch a bucket "
              f"({row['checked_copy_over_copy']:.2f}x the plain copy); a launch a tensor "
              f"{1e3 * row['checked_copy_per_tensor_s']:.1f} ms", flush=True)
        print(f"{name}: {nbytes / 1e9:.2f} GB in {len(named)} tensors: check {1e3 * median:.1f} ms median "
              f"({row['check_GBps']:.0f} GB/s), a device copy of the same bytes {1e3 * row['d2d_copy_s']:.1f} ms "
              f"(check / copy {row['check_over_copy']:.2f})", flush=True)
        if args.push:
            backend = "ipc" if cuda else "shm"
            times = push_times(folder, named, backend, device, args.rounds)
            on, off = statistics.median(times[True]), statistics.median(times[False])
            share, low, high = paired_share(times[True], times[False])
            row.update(push_checked_s=on, push_unchecked_s=off, check_share_of_push=(on - off) / on,
                       check_share_paired=share, check_share_paired_95=[low, high],
                       push_checked_best_s=min(times[True]), push_unchecked_best_s=min(times[False]),
                       push_times_s={"checked": times[True], "unchecked": times[False]},
                       push_parts_median_s={("checked" if check else "unchecked"): {
                           part: statistics.median(p[part] for p in times["parts"][check])
                           for part in times["parts"][check][0]}
                           for check in (True, False)})
            print(f"{name}: push ({backend}, median of {args.rounds} in turn with a server without the check) "
                  f"with the check {on:.3f} s, without {off:.3f} s (best {min(times[True]):.3f} / "
                  f"{min(times[False]):.3f}): the check is {100 * (on - off) / on:.1f}% of the push (goal <= 5%); "
                  f"paired by round {100 * share:.1f}% (95% {100 * low:.1f} to {100 * high:.1f})",
                  flush=True)
            split = row["push_parts_median_s"]
            print(f"{name}: where the push goes, median ms checked / unchecked: " + ", ".join(
                f"{part[:-2]} {1e3 * split['checked'][part]:.1f} / {1e3 * split['unchecked'][part]:.1f}"
                for part in split["checked"]), flush=True)
        result["rows"].append(row)
        del named
        if cuda:
            torch.cuda.empty_cache()
    write_json(args.out, f"finite-check-{args.device}", result)


if __name__ == "__main__":
    main()
