"""Decode throughput of --batch-invariant against the default mode, same model, same run (issue 40: the mode
at batch 1, 64 and 256 should keep >= 0.8 of the default's tok/s on the 1B and 8B shapes).

For each model (random weights, --load-format dummy, bf16 on CUDA): an engine in the default mode, then one
in the batch-invariant mode (one at a time: the first is closed before the second starts), each decoding
`batch` requests of 32-token prompts for --new-tokens greedy tokens at every batch size; the median of
--repeat runs by decode tok/s (first token of every request out -> all done: bench/throughput.py). Prints a
table with the ratio invariant / default per (model, batch) and the result as JSON (also written to --out).
On CUDA also each weight shape's fixed-tile matmul against cuBLAS at those rows: where the mode's time goes.

    python bench/batch_invariant.py                      # CUDA: llama-1b and llama-8b, batch 1, 64, 256
    python bench/batch_invariant.py --small              # CPU smoke run, a tiny model, well under a minute
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.common import hardware, now_iso, table, write_json
from bench.throughput import median_rate
from testkit.models import model_folder


def rates(name: str, folder: Path, device: torch.device, invariant: bool, batches: list[int], new_tokens: int,
          repeat: int) -> dict[int, float]:
    """Decode tok/s at each batch size of one engine (one mode)."""
    from server import LLM

    llm = LLM(model=str(folder), device=device.type, load_format="dummy", max_num_seqs=max(batches),
              max_model_len=1024, batch_invariant=invariant,
              kv_cache_memory="4GiB" if device.type == "cuda" else "256MiB")
    try:
        median_rate(llm, max(batches), 4, device, "final", 1)  # warm-up: allocator, kernels, graphs
        return {b: median_rate(llm, b, new_tokens, device, "final", repeat)["decode_tok_s"] for b in batches}
    finally:
        llm.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# Other tiles --sweep-tiles times beside matmul_tile's: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
SWEEP = [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
         (128, 64, 64, 8, 3), (128, 128, 64, 8, 3)]


def gemm_rows(name: str, device: torch.device, batches: list[int], sweep: bool = False) -> list[dict]:
    """Where the mode's time goes: the fixed-tile matmul against cuBLAS (torch.mm) on the model's five weight
    shapes at each batch's rows (CUDA events, the median of 20 runs after 3 warm-ups); with sweep, also each
    tile of SWEEP (a tile is one choice for every row count: the fastest over the batches is the one to keep)."""
    from server.model.batch_invariant_kernels import fixed_tile_matmul, matmul_tile
    from testkit.models import CONFIGS

    c = CONFIGS[name]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = {"qkv": ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d, h),
              "o_proj": (h, c["num_attention_heads"] * d), "gate_up": (2 * i, h), "down": (h, i),
              "lm_head": (c["vocab_size"], h)}

    def median_ms(fn, *args) -> float:
        for _ in range(3):
            fn(*args)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    rows = []
    for label, (N, K) in shapes.items():
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
        for b in batches:
            x = torch.randn(b, K, device=device, dtype=torch.bfloat16)
            ours, cublas = median_ms(fixed_tile_matmul, x, w), median_ms(torch.mm, x, w.t())
            row = {"model": name, "gemm": label, "N": N, "K": K, "rows": b, "fixed_tile_ms": ours,
                   "cublas_ms": cublas, "x_cublas": cublas / ours, "tile": matmul_tile(N, K, torch.bfloat16, device)}
            if sweep:
                row["sweep_ms"] = {
                    ",".join(map(str, t)): median_ms(fixed_tile_matmul, x, w, None, None, dict(
                        BLOCK_M=t[0], BLOCK_N=t[1], BLOCK_K=t[2], num_warps=t[3], num_stages=t[4])) for t in SWEEP}
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU, llama-micro, batch 1 and 4, 8 tokens: a smoke run")
    ap.add_argument("--models", default=None, help="comma-separated (tests/models.py); default llama-1b,llama-8b")
    ap.add_argument("--batches", default=None, help="comma-separated; default 1,64,256")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (8 with --small)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per batch, the median kept (default 3; 1 --small)")
    ap.add_argument("--sweep-tiles", action="store_true", help="CUDA: also time the matmul with each tile of SWEEP")
    ap.add_argument("--gemm-only", action="store_true", help="CUDA: only the matmul timings, no engines")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.small else "cuda")
    models = (args.models or ("llama-micro" if args.small else "llama-1b,llama-8b")).split(",")
    batches = [int(b) for b in (args.batches or ("1,4" if args.small else "1,64,256")).split(",")]
    new_tokens = args.new_tokens or (8 if args.small else 128)
    repeat = args.repeat or (1 if args.small else 3)
    root = Path(tempfile.mkdtemp())
    rows = []
    for name in [] if args.gemm_only else models:
        folder = model_folder(name, root)
        default = rates(name, folder, device, False, batches, new_tokens, repeat)
        invariant = rates(name, folder, device, True, batches, new_tokens, repeat)
        for b in batches:
            rows.append({"model": name, "batch": b, "default_tok_s": default[b], "batch_invariant_tok_s": invariant[b],
                         "ratio": invariant[b] / default[b]})
    gemms = ([g for name in models for g in gemm_rows(name, device, batches, args.sweep_tiles)]
             if device.type == "cuda" else [])
    result = {"date": now_iso(), "hardware": hardware(device), "new_tokens": new_tokens, "prompt_tokens": 32,
              "repeat": repeat, "rows": rows, "min_ratio": min((r["ratio"] for r in rows), default=None),
              "gemms": gemms}
    if gemms:
        print(table([[g["model"], g["gemm"], f"{g['N']}x{g['K']}", g["rows"], f"{g['fixed_tile_ms']:.3f}",
                      f"{g['cublas_ms']:.3f}", f"{g['x_cublas']:.2f}"] for g in gemms],
                    ["model", "gemm", "N x K", "rows", "fixed-tile ms", "cuBLAS ms", "speed vs cuBLAS"]))
        if args.sweep_tiles:  # per tile, the sum over every shape and batch: one tile serves every row count
            totals = {t: sum(g["sweep_ms"][t] for g in gemms) for t in gemms[0]["sweep_ms"]}
            print(table([[t, f"{ms:.3f}"] for t, ms in sorted(totals.items(), key=lambda kv: kv[1])] +
                        [["matmul_tile (the mode's)", f"{sum(g['fixed_tile_ms'] for g in gemms):.3f}"],
                         ["cuBLAS", f"{sum(g['cublas_ms'] for g in gemms):.3f}"]],
                        ["tile (M,N,K,warps,stages)", "total ms"]))
    print(table([[r["model"], r["batch"], f"{r['default_tok_s']:.0f}", f"{r['batch_invariant_tok_s']:.0f}",
                  f"{r['ratio']:.2f}"] for r in rows],
                ["model", "batch", "default tok/s", "batch-invariant tok/s", "ratio"]))
    print(json.dumps(result))
    write_json(args.out, "batch_invariant_small" if args.small else "batch_invariant", result)
    return result


if __name__ == "__main__":
    main()
