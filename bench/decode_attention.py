"""The paged decode-attention kernel (server/model/decode_kernel.py) alone, at a grid of (batch, context) on
the 1B and 8B Llama shapes' heads, against the time its K/V bytes take at the device's measured copy bandwidth.
As the engine launches it (a small batch's contexts split over programs, decode_kernel.decode_splits, with no
bound on the context: as in a CUDA graph), and with one program per (sequence, KV head) for comparison.

The cache is block-major with every layer (kv_layout.py), one layer's views attended; block tables are a random
permutation of the blocks (a fragmented cache). Each case is timed over a CUDA graph of 10 launches.

    python bench/decode_attention.py --out $OUT
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, hardware, now_iso, table, write_json  # noqa: E402

SHAPES = {"1B (head_dim 64, 16 layers)": (64, 16), "8B (head_dim 128, 32 layers)": (128, 32)}
CASES = ((1, 128), (1, 384), (1, 1024), (1, 4096), (8, 1024), (64, 512), (256, 128), (256, 384), (256, 640),
         (256, 1024))


def graph_us(fn, launches: int = 10, reps: int = 5) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * launches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    from server.model.decode_kernel import SPLIT_COUNTS, triton_decode_attention

    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    torch.manual_seed(0)
    rows = []
    heads, kv_heads, block = 32, 8, 16
    counts = torch.zeros(SPLIT_COUNTS, device=dev, dtype=torch.int32)
    for shape, (head_dim, layers) in SHAPES.items():
        for batch, context in CASES:
            blocks = batch * -(-context // block)
            kv = torch.randn(blocks + 1, layers, 2, block, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
            k, v = kv[:, layers // 2, 0], kv[:, layers // 2, 1]
            tables = torch.randperm(blocks, device=dev).view(batch, -1)
            lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
            q = torch.randn(batch, heads, head_dim, device=dev, dtype=torch.bfloat16)
            us = graph_us(lambda: triton_decode_attention(q, k, v, tables, lens, head_dim ** -0.5,
                                                          split_counts=counts))
            one_us = graph_us(lambda: triton_decode_attention(q, k, v, tables, lens, head_dim ** -0.5))
            floor_us = batch * context * 2 * kv_heads * head_dim * 2 / bandwidth * 1e6
            rows.append({"shape": shape, "batch": batch, "context": context, "kernel_us": us,
                         "one_program_us": one_us, "bytes_us": floor_us, "of_bandwidth": floor_us / us})
            del kv, k, v
            torch.cuda.empty_cache()
    write_json(args.out, "decode_attention", {"date": now_iso(), "hardware": hardware(dev),
                                               "copy_bandwidth_GBs": bandwidth / 1e9, "rows": rows})
    print(f"\ndecode attention, one layer ({hardware(dev)}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, {now_iso()})")
    print(table([[r["shape"], r["batch"], r["context"], f"{r['kernel_us']:.1f}", f"{r['one_program_us']:.1f}",
                  f"{r['bytes_us']:.1f}", f"{100 * r['of_bandwidth']:.0f}%"] for r in rows],
                ["shape", "batch", "context", "kernel us", "one program per sequence us",
                 "K/V bytes at copy bandwidth us", "of bandwidth"]))


if __name__ == "__main__":
    main()
