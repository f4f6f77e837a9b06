"""A trainer process for the weight-transfer tests and the CPU example: reads a checkpoint folder
and pushes its tensors into a running server with WeightSender.

    python tests/weight_transfer/weight_trainer.py URL BACKEND CHECKPOINT_DIR ADMIN_KEY [--bucket-bytes N] [--pause-after K]

Prints one JSON line with the send report. --pause-after K: after bucket K has gone, print
PAUSED and wait forever (the test kills it there, mid-send). --unpacked: one broadcast per tensor
(vLLM's packed: false). --flat: hold the tensors in one flat buffer, back to back in the order sent
(as trainers with flat parameter buffers do), so the sender broadcasts buckets from it without packing.
--vllm-calls (gloo): vLLM's trainer-side sequence, none of this package's extensions: POST
/start_weight_update and wait; POST /update_weights (no ready key: broadcast at once, the answer read
after); then POST /finish_weight_update.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from server.weight_transfer.sender import WeightSender, WeightSendError  # noqa: E402


def flatten(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same tensors as views of one buffer, back to back in this order."""
    flat = torch.empty(sum(t.numel() * t.element_size() for _, t in named), dtype=torch.uint8)
    out, offset = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        assert offset % t.element_size() == 0, "a flat buffer needs aligned starts"
        view = flat[offset:offset + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append((name, view))
        offset += n
    return out


def vllm_calls(sender: WeightSender, named: list[tuple[str, torch.Tensor]], weight_version: str | None) -> dict:
    """One update as vLLM's trainer helpers make it: three calls, each answered before the next, the
    broadcast started without waiting for any go-ahead from the server."""
    import threading

    sender.post("/start_weight_update", {})
    info = {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "packed": sender.packed,
            "packed_buffer_size_bytes": sender.bucket_bytes}
    answer: dict = {}

    def post() -> None:
        try:
            answer["ok"] = sender.post("/update_weights", {"update_info": info})
        except WeightSendError as e:
            answer["error"] = e
    poster = threading.Thread(target=post)
    poster.start()
    sender._broadcast([t for _, t in named])
    poster.join()
    if "error" in answer:
        raise answer["error"]
    done = sender.post("/finish_weight_update", {"weight_version": weight_version} if weight_version else {})
    return {"update": answer["ok"], "server": done, "sender": {}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("backend")
    ap.add_argument("checkpoint")
    ap.add_argument("key")
    ap.add_argument("--bucket-bytes", type=int, default=8 << 20)
    ap.add_argument("--pause-after", type=int, default=None)
    ap.add_argument("--weight-version", default=None)
    ap.add_argument("--rename", default=None, help="send the first tensor under this name instead")
    ap.add_argument("--unpacked", action="store_true")
    ap.add_argument("--flat", action="store_true")
    ap.add_argument("--vllm-calls", action="store_true")
    args = ap.parse_args()
    tensors = {}
    for f in sorted(Path(args.checkpoint).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    named = sorted(tensors.items())
    if args.rename:
        named[0] = (args.rename, named[0][1])
    if args.flat:
        named = flatten(named)

    def after(i: int) -> None:
        if args.pause_after is not None and i >= args.pause_after:
            print("PAUSED", flush=True)
            while True:
                time.sleep(1)

    sender = WeightSender(args.url, backend=args.backend, api_key=args.key, bucket_bytes=args.bucket_bytes,
                          after_bucket=after, timeout_s=60, packed=not args.unpacked)
    try:
        sender.init()
        if args.vllm_calls:
            report = vllm_calls(sender, named, args.weight_version)
        else:
            report = sender.send(named, weight_version=args.weight_version)
    except WeightSendError as e:
        print(json.dumps({"error": str(e), "status": e.status}), flush=True)
        return 3
    finally:
        sender.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
