"""Decode throughput of --batch-invariant against the default mode, same model, same run (issue 40: the mode
at batch 1, 64 and 256 should keep >= 0.8 of the default's tok/s on the 1B and 8B shapes).

For each model (random weights, --load-format dummy, bf16 on CUDA): an engine in the default mode, then one
in the batch-invariant mode (one at a time: the first is closed before the second starts), each decoding
`batch` requests of 32-token prompts for --new-tokens greedy tokens at every batch size; the median of
--repeat runs by decode tok/s (first token of every request out -> all done: bench/throughput.py). Prints a
table with the ratio invariant / default per (model, batch) and the result as JSON (also written to --out).
On CUDA also each weight shape's fixed-tile matmul against cuBLAS at those rows: where the mode's time goes;
for a weight whose K is split, also its splits added in each program in one K loop (FLAT) on 64 and 128 rows a
program, against the mode's tile and a loop a split, each as ms and ours / cuBLAS.

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

from bench.common import graph_ms, hardware, now_iso, table, write_json
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


# The tiles --sweep-tiles times beside the mode's (matmul_tile) and the one before split-K (unsplit_tile):
# (BLOCK_N, SPLIT_K) at 64 rows, BLOCK_K 64, 4 warps, 4 stages. A split count above K's steps is clamped.
SWEEP = [(n, s) for n in (32, 64, 128) for s in (1, 2, 4, 8)]
REPS = 16  # matmuls a timed CUDA graph holds, cycling through copies of the weight (together > L2: from HBM)


def sweep_tile(block_n: int, splits: int) -> dict:
    return {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4, "SPLIT_K": splits}


def in_order(tile: dict, **changes) -> dict:
    """tile with its K splits added one after the other (GROUP 1, a program a split): the order the serial and
    one-loop candidates add them in, whatever groups the mode's tile takes."""
    return dict(tile, GROUP=1, GROUPED=False, **changes)


def wide_candidates(mine: dict) -> dict[str, dict]:
    """Tiles for many rows that keep a row's K order (BLOCK_K, SPLIT_K). Split weights: the splits added in each
    program a loop a split on 64-row tiles, in one loop on 64 x 128 tiles, and through the workspace on 128-row
    tiles 128 and 256 columns wide (more programs than the output tiles alone, each an efficient MMA). Unsplit:
    128 rows on 128 and 256 columns, 3 and 4 stages."""
    out = {}
    if mine.get("SPLIT_K", 1) > 1:
        mine = in_order(mine)  # a serial program adds the splits in order
        out["serial m64"] = dict(mine, BLOCK_M=64, num_warps=4, SERIAL=True, FLAT=False)
        out["flat m64 n128"] = dict(mine, BLOCK_M=64, BLOCK_N=128, num_warps=4, SERIAL=True, FLAT=True)
        for n, stages in ((128, 4), (256, 3)):
            out[f"ws m128 n{n} st{stages}"] = dict(mine, BLOCK_M=128, BLOCK_N=n, num_warps=8, num_stages=stages,
                                                   SERIAL=False, FLAT=False)
        return out
    for n, stages in ((128, 4), (256, 3), (256, 4)):
        out[f"m128 n{n} st{stages}"] = dict(mine, BLOCK_M=128, BLOCK_N=n, num_warps=8, num_stages=stages)
    return out


def flat_candidates(mine: dict) -> dict[str, dict]:
    """The mode's split tile with its splits added in each program in ONE K loop over all of them (FLAT), on its
    rows a program and on the other width (128 rows on two warpgroups where it takes 64, 64 on one where it
    takes 128): the K order of the mode's tile (BLOCK_K, SPLIT_K), so the same bits (checked on each run)."""
    flat = in_order(mine, SERIAL=True, FLAT=True)
    wide = mine["BLOCK_M"] == 128
    other = dict(flat, BLOCK_M=64 if wide else 128, num_warps=4 if wide else 8)
    return {f"flat m{flat['BLOCK_M']}": flat, f"flat m{other['BLOCK_M']}": other}


# --split-schedules: split counts below the mode's for its split weights. The count is the one thing a row's bits
# follow (with BLOCK_K); the mode takes it from one row's decode, which wants ~2 programs an SM. At one row a
# narrower column tile keeps that many programs with fewer splits; from WIDE_ROWS rows 128-row tiles through the
# workspace then hold fewer partials (at 256 rows the split weights' one-loop tiles ran at ~2x cuBLAS, 12-05).
SCHEDULE_SPLITS = (2, 3, 4)


def schedule_candidates(mine: dict, rows: int, splits: int) -> dict[str, dict]:
    """Tiles with `splits` K splits (the same K order at every row count): at fewer than WIDE_ROWS rows 64-row
    tiles 32 columns wide (6 stages: the bytes in flight of a 64-wide tile's 4) and 64 wide, through the
    workspace; from WIDE_ROWS rows 128 x 128 tiles through the workspace, and 64 x 64 tiles adding the splits in
    one loop (FLAT)."""
    from server.model.batch_invariant_kernels import WIDE_ROWS

    base = in_order(mine, SPLIT_K=splits, SERIAL=False, FLAT=False)
    if rows < WIDE_ROWS:
        return {f"s{splits} n{n}": dict(base, BLOCK_M=64, BLOCK_N=n, num_warps=4, num_stages=st)
                for n, st in ((32, 6), (64, 4))}
    return {f"s{splits} ws m128 n128": dict(base, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
            f"s{splits} flat m64 n64": dict(base, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, SERIAL=True,
                                            FLAT=True)}


# Split counts whose splits are added in groups (GROUP): at one row a program a split, as the mode does, its sums
# then folded a group at a time; from WIDE_ROWS rows a program a group, each adding its splits in one loop, through
# a workspace of one partial a group (fewer than the splits, as with fewer splits) on 128 x 128 and 64 x 128 tiles.
# Beside the mode's own count, these (one row pays for the count; many rows for the partials).
GROUP_SPLITS = (4, 6, 8)


def group_candidates(mine: dict, K: int, rows: int) -> dict[str, dict]:
    """Tiles adding the K splits in groups (split counts of GROUP_SPLITS and the mode's, each group a divisor of
    the count that K's BLOCK_K steps give, at least 2 steps a split), the same order at every row count."""
    from server.model.batch_invariant_kernels import WIDE_ROWS

    steps = -(-K // mine["BLOCK_K"])
    out = {}
    for want in sorted({mine["SPLIT_K"], *GROUP_SPLITS}):
        chunk = -(-steps // want)
        splits = -(-steps // chunk)
        if chunk < 2:
            continue
        for group in (g for g in range(2, splits) if splits % g == 0):
            base = dict(mine, SPLIT_K=splits, GROUP=group, SERIAL=False, FLAT=False)
            if rows < WIDE_ROWS:
                out[f"s{splits} g{group}"] = dict(base, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
                continue
            for m, warps in ((128, 8), (64, 4)):
                out[f"s{splits} g{group} m{m} n128"] = dict(base, BLOCK_M=m, BLOCK_N=128, num_warps=warps,
                                                            num_stages=4, GROUPED=True)
    return out


def tile_name(t: dict) -> str:
    return f"n{t['BLOCK_N']}/k{t['BLOCK_K']}/s{t.get('SPLIT_K', 1)}"


def gemm_rows(name: str, device: torch.device, batches: list[int], sweep: bool = False,
              schedules: bool = False) -> list[dict]:
    """Where the mode's time goes: the fixed-tile matmul against cuBLAS (torch.mm) on the model's five weight
    shapes at each batch's rows, the mode's tile (matmul_tile) beside the one before split-K (unsplit_tile);
    with sweep, also each tile of SWEEP. Timed as a decode step runs them: REPS calls captured in one CUDA
    graph (no launch gaps from Python), each on another copy of the weight, the median of 10 replays per
    call. A tile is one choice for every row count: per shape, the fastest over the batches is the one to keep.
    Where K is split, also flat_candidates, with whether each gave the mode's tile's bits on these rows; from
    WIDE_ROWS rows, wide_candidates, with whether each gave row 0 the bits the one-row tile gives it. With
    schedules, fewer splits (schedule_candidates), each with whether row 0 got the bits the same split count's
    one-row tile gives it."""
    from server.model.batch_invariant_kernels import (
        WIDE_ROWS,
        fixed_tile_matmul,
        matmul_tile,
        unsplit_tile,
    )
    from testkit.models import CONFIGS

    c = CONFIGS[name]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    shapes = {"qkv": ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d, h),
              "o_proj": (h, c["num_attention_heads"] * d), "gate_up": (2 * i, h), "down": (h, i),
              "lm_head": (c["vocab_size"], h)}

    def median_ms(fn, x, ws, *args) -> float:
        for w in ws[:2]:  # compile, pick cuBLAS's kernels, for each copy's first call outside the capture
            fn(x, w, *args)

        def calls() -> None:
            for r in range(REPS):
                fn(x, ws[r % len(ws)], *args)
        return graph_ms(calls, device, per_replay=REPS)

    def cublas(x, w):
        return torch.mm(x, w.t())

    rows = []
    for label, (N, K) in shapes.items():
        copies = max(1, min(REPS, -(-(256 << 20) // (N * K * 2))))
        ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        before = unsplit_tile(N, K, torch.bfloat16, device)
        for b in batches:
            # The mode's tile at these rows, and the 64-row one it takes at one row (what it took at any M before).
            mine, narrow = matmul_tile(N, K, torch.bfloat16, device, b), matmul_tile(N, K, torch.bfloat16, device)
            x = torch.randn(b, K, device=device, dtype=torch.bfloat16)
            ours, old, cub = (median_ms(fixed_tile_matmul, x, ws, None, None, mine),
                              median_ms(fixed_tile_matmul, x, ws, None, None, before), median_ms(cublas, x, ws))
            row = {"model": name, "gemm": label, "N": N, "K": K, "rows": b, "fixed_tile_ms": ours,
                   "unsplit_ms": old, "cublas_ms": cub, "x_cublas": cub / ours, "tile": mine, "unsplit_tile": before}
            if mine != narrow:
                row["narrow_ms"] = median_ms(fixed_tile_matmul, x, ws, None, None, narrow)
            if mine.get("SPLIT_K", 1) > 1:  # the splits through the workspace and added in each program
                row["workspace_ms"], row["serial_ms"] = (
                    median_ms(fixed_tile_matmul, x, ws, None, None, in_order(mine, SERIAL=serial, FLAT=False))
                    for serial in (False, True))
                # and added in each program in one K loop, not a loop a split: their times and their bits
                flat = flat_candidates(mine)
                row["flat_ms"] = {k: median_ms(fixed_tile_matmul, x, ws, None, None, t) for k, t in flat.items()}
                want = fixed_tile_matmul(x, ws[0], tile=in_order(mine, SERIAL=False, FLAT=False))
                row["flat_same_bits"] = {k: torch.equal(fixed_tile_matmul(x, ws[0], tile=t), want)
                                         for k, t in flat.items()}
            if b >= WIDE_ROWS:  # candidates for many rows, each keeping the K order (BLOCK_K, SPLIT_K) of one row's
                wide = wide_candidates(mine)
                row["wide_ms"] = {k: median_ms(fixed_tile_matmul, x, ws, None, None, t) for k, t in wide.items()}
                # Whether a wider column tile gives a row the bits the mode's one-row tile gives it: if so, the
                # column tile could follow the rows too (the MMA's N would not order a row's sum on this GPU).
                split = mine.get("SPLIT_K", 1) > 1  # then the candidates add the splits in order
                alone = fixed_tile_matmul(x[:1], ws[0], tile=in_order(narrow) if split else narrow)[0]
                row["wide_same_bits"] = {k: torch.equal(fixed_tile_matmul(x, ws[0], tile=t)[0], alone)
                                         for k, t in wide.items()}
            if schedules and mine.get("SPLIT_K", 1) > 1:
                row["schedules_ms"], row["schedules_same_bits"] = {}, {}
                for s in (s for s in SCHEDULE_SPLITS if s < mine["SPLIT_K"]):
                    one_row = schedule_candidates(mine, 1, s)[f"s{s} n64"]
                    alone = fixed_tile_matmul(x[:1], ws[0], tile=one_row)[0]
                    for k, t in schedule_candidates(mine, b, s).items():
                        row["schedules_ms"][k] = median_ms(fixed_tile_matmul, x, ws, None, None, t)
                        row["schedules_same_bits"][k] = torch.equal(
                            fixed_tile_matmul(x, ws[0], tile=t)[0], alone)
                for k, t in group_candidates(mine, K, b).items():  # the splits added in groups
                    one_row = dict(t, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, GROUPED=False)
                    alone = fixed_tile_matmul(x[:1], ws[0], tile=one_row)[0]
                    row["schedules_ms"][k] = median_ms(fixed_tile_matmul, x, ws, None, None, t)
                    row["schedules_same_bits"][k] = torch.equal(fixed_tile_matmul(x, ws[0], tile=t)[0], alone)
            if sweep:
                row["sweep_ms"] = {tile_name(sweep_tile(*t)): median_ms(fixed_tile_matmul, x, ws, None, None,
                                                                         sweep_tile(*t)) for t in SWEEP}
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    return rows


def flat_table(gemms: list[dict]) -> str:
    """The rows of split weights: the mode's tile (through the workspace or SERIAL, as it chose at these rows), its
    splits added in each program a loop a split (SERIAL), and the FLAT candidates, each as ms and ours / cuBLAS
    (above 1: slower than cuBLAS); and whether every candidate gave the mode's tile's bits."""
    def cell(ms: float, cub: float) -> str:
        return f"{ms:.4f} ({ms / cub:.2f}x)"

    rows = []
    for g in gemms:
        t, cub = g["tile"], g["cublas_ms"]
        how = ("flat" if t.get("FLAT") else "serial") if t.get("SERIAL") else "workspace"
        (same, same_ms), (other, other_ms) = g["flat_ms"].items()
        wrong = [k for k, ok in g["flat_same_bits"].items() if not ok]
        rows.append([g["model"], g["gemm"], g["rows"], f"m{t['BLOCK_M']} {tile_name(t)} {how}",
                     cell(g["fixed_tile_ms"], cub), cell(g["serial_ms"], cub), f"{same} {cell(same_ms, cub)}",
                     f"{other} {cell(other_ms, cub)}", f"{cub:.4f}", "NOT " + ", ".join(wrong) if wrong else "yes"])
    return table(rows, ["model", "gemm", "rows", "mode's tile", "mode's ms (ours/cuBLAS)",
                        "serial, a loop a split", "flat, same width", "flat, other width", "cuBLAS ms",
                        "flat bits = mode's"])


def per_shape(gemms: list[dict]) -> list[list]:
    """Per weight shape, each tile's time summed over the batches: the mode's, the one before split-K, the
    sweep's fastest (when swept), cuBLAS."""
    out = []
    for key in dict.fromkeys((g["model"], g["gemm"]) for g in gemms):
        gs = [g for g in gemms if (g["model"], g["gemm"]) == key]
        mine, old, cub = (sum(g[k] for g in gs) for k in ("fixed_tile_ms", "unsplit_ms", "cublas_ms"))
        best = "-"
        if "sweep_ms" in gs[0]:
            name, ms = min(((t, sum(g["sweep_ms"][t] for g in gs)) for t in gs[0]["sweep_ms"]), key=lambda kv: kv[1])
            best = f"{name} {ms:.4f}"
        out.append([*key, f"{gs[0]['N']}x{gs[0]['K']}", f"{tile_name(gs[0]['unsplit_tile'])} {old:.4f}",
                    f"{tile_name(gs[0]['tile'])} {mine:.4f}", best, f"{cub:.4f}"])
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU, llama-micro, batch 1 and 4, 8 tokens: a smoke run")
    ap.add_argument("--models", default=None, help="comma-separated (tests/models.py); default llama-1b,llama-8b")
    ap.add_argument("--batches", default=None, help="comma-separated; default 1,64,256")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (8 with --small)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per batch, the median kept (default 3; 1 --small)")
    ap.add_argument("--sweep-tiles", action="store_true", help="CUDA: also time the matmul with each tile of SWEEP")
    ap.add_argument("--gemm-only", action="store_true", help="CUDA: only the matmul timings, no engines")
    ap.add_argument("--engines-only", action="store_true", help="only the engines' decode, no matmul timings")
    ap.add_argument("--split-schedules", action="store_true",
                    help="CUDA: also the split weights with fewer K splits (SCHEDULE_SPLITS) and with their splits "
                    "added in groups (GROUP_SPLITS), at every batch")
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
    gemms = ([g for name in models for g in gemm_rows(name, device, batches, args.sweep_tiles, args.split_schedules)]
             if device.type == "cuda" and not args.engines_only else [])
    result = {"date": now_iso(), "hardware": hardware(device), "new_tokens": new_tokens, "prompt_tokens": 32,
              "repeat": repeat, "rows": rows, "min_ratio": min((r["ratio"] for r in rows), default=None),
              "gemms": gemms}
    if gemms:
        print(table([[g["model"], g["gemm"], f"{g['N']}x{g['K']}", g["rows"], f"{g['unsplit_ms']:.4f}",
                      f"{g['fixed_tile_ms']:.4f}", f"{g['cublas_ms']:.4f}", f"{g['x_cublas']:.2f}",
                      f"{g['workspace_ms']:.4f} / {g['serial_ms']:.4f}" if "serial_ms" in g else "-"] for g in gemms],
                    ["model", "gemm", "N x K", "rows", "unsplit ms", "mode's tile ms", "cuBLAS ms",
                     "mode vs cuBLAS", "K splits via workspace / serial ms"]))
        wide = [g for g in gemms if "wide_ms" in g]
        if wide:  # the mode's tile at many rows against the candidates that keep its K order
            print(table([[g["model"], g["gemm"], g["rows"], f"{g['fixed_tile_ms']:.4f}",
                          ", ".join(f"{k} {v:.4f}"
                                    + ("" if g.get("wide_same_bits", {}).get(k, True) else " (other bits)")
                                    for k, v in g["wide_ms"].items()), f"{g['cublas_ms']:.4f}"]
                         for g in wide], ["model", "gemm", "rows", "mode's tile ms", "candidates ms", "cuBLAS ms"]))
        sched = [g for g in gemms if g.get("schedules_ms")]
        if sched:  # fewer or grouped splits: the weight's time at each batch, the mode's against each candidate
            def candidates(g: dict) -> str:
                return ", ".join(f"{k} {v:.4f}" + ("" if g["schedules_same_bits"][k] else " (row 0 NOT its 1-row bits)")
                                 for k, v in g["schedules_ms"].items())
            print(table([[g["model"], g["gemm"], g["rows"],
                          f"s{g['tile']['SPLIT_K']} g{g['tile'].get('GROUP', 1)} {g['fixed_tile_ms']:.4f}",
                          candidates(g), f"{g['cublas_ms']:.4f}"] for g in sched],
                        ["model", "gemm", "rows", "mode's splits, ms", "fewer or grouped splits, ms", "cuBLAS ms"]))
        flat = [g for g in gemms if "flat_ms" in g]
        if flat:  # the split weights' K splits in one loop a program against the mode's tile and a loop a split
            print(flat_table(flat))
        print(table(per_shape(gemms), ["model", "gemm", "N x K", "unsplit tile, ms", "mode's tile, ms",
                                       "fastest swept tile, ms", "cuBLAS ms"]))
    print(table([[r["model"], r["batch"], f"{r['default_tok_s']:.0f}", f"{r['batch_invariant_tok_s']:.0f}",
                  f"{r['ratio']:.2f}"] for r in rows],
                ["model", "batch", "default tok/s", "batch-invariant tok/s", "ratio"]))
    print(json.dumps(result))
    write_json(args.out, "batch_invariant_small" if args.small else "batch_invariant", result)
    return result


if __name__ == "__main__":
    main()
