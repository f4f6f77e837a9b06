"""Decode throughput of --batch-invariant against the default mode, same model, same run (issue 40: the mode
at batch 1, 64 and 256 should keep >= 0.8 of the default's tok/s on the 1B and 8B shapes).

For each model (random weights, --load-format dummy, bf16 on CUDA): an engine in the default mode, then one
in the batch-invariant mode (one at a time: the first is closed before the second starts), each decoding
`batch` requests of 32-token prompts for --new-tokens greedy tokens at every batch size; the median of
--repeat runs by decode tok/s (first token of every request out -> all done: bench/throughput.py). Prints a
table with the ratio invariant / default per (model, batch) and the result as JSON (also written to --out).

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
from tests.models import model_folder


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU, llama-micro, batch 1 and 4, 8 tokens: a smoke run")
    ap.add_argument("--models", default=None, help="comma-separated (tests/models.py); default llama-1b,llama-8b")
    ap.add_argument("--batches", default=None, help="comma-separated; default 1,64,256")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (8 with --small)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per batch, the median kept (default 3; 1 --small)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.small else "cuda")
    models = (args.models or ("llama-micro" if args.small else "llama-1b,llama-8b")).split(",")
    batches = [int(b) for b in (args.batches or ("1,4" if args.small else "1,64,256")).split(",")]
    new_tokens = args.new_tokens or (8 if args.small else 128)
    repeat = args.repeat or (1 if args.small else 3)
    root = Path(tempfile.mkdtemp())
    rows = []
    for name in models:
        folder = model_folder(name, root)
        default = rates(name, folder, device, False, batches, new_tokens, repeat)
        invariant = rates(name, folder, device, True, batches, new_tokens, repeat)
        for b in batches:
            rows.append({"model": name, "batch": b, "default_tok_s": default[b], "batch_invariant_tok_s": invariant[b],
                         "ratio": invariant[b] / default[b]})
    result = {"date": now_iso(), "hardware": hardware(device), "new_tokens": new_tokens, "prompt_tokens": 32,
              "repeat": repeat, "rows": rows, "min_ratio": min(r["ratio"] for r in rows)}
    print(table([[r["model"], r["batch"], f"{r['default_tok_s']:.0f}", f"{r['batch_invariant_tok_s']:.0f}",
                  f"{r['ratio']:.2f}"] for r in rows],
                ["model", "batch", "default tok/s", "batch-invariant tok/s", "ratio"]))
    print(json.dumps(result))
    write_json(args.out, "batch_invariant_small" if args.small else "batch_invariant", result)
    return result


if __name__ == "__main__":
    main()
