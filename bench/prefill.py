"""Prefill attention: the one-launch Triton kernel (server/model/prefill_kernel.py) against one PyTorch
SDPA per span (attention.prefill_spans_torch, the path it replaced), both measured in this run.

1. Attention alone, one layer's call (the plan built once, as the runner shares it between layers):
   256 prompts x 32 tokens and 64 x 512, the 1B and 8B head shapes: ms per call and the speed-up.
2. The in-process engine (1.24B Llama shape, random weights, async scheduling as configured): C prompts
   at once (bench/serve.py's saturation workload: 128-token prompts, 256 output tokens each), output
   tok/s at C = 64 and 256 with each prefill path, and the 256 / 64 ratio (issue 15: target >= 2.5x).

    python bench/prefill.py --out $OUT                       # CUDA
    TRITON_INTERPRET=1 python bench/prefill.py --device cpu --smoke   # the code path, tiny, on CPU
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.common import hardware, in_thread, now_iso, sync, table, write_json  # noqa: E402

TILE_ROWS = (32, 64, 128)  # the kernel's tile sizes timed beside the default (attention.PREFILL_TILE_ROWS)


def variants(base) -> dict[str, type]:
    """The engine's ops set with each prefill path (everything else as the device has it)."""
    from server.model.attention import prefill_spans_torch
    from server.model.prefill_kernel import triton_prefill_attention

    return {"span by span": type("SpanBySpan", (base,), {"prefill_attention": staticmethod(prefill_spans_torch)}),
            "kernel": type("KernelPrefill", (base,), {"prefill_attention": staticmethod(triton_prefill_attention)})}


def per_call_ms(fn, device: torch.device, calls: int) -> float:
    fn()  # warm-up (compilation, the plan)
    sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t) / calls


def attention_rows(device: torch.device, dtype: torch.dtype, shapes, heads: tuple[int, int], dims, calls: int) -> list[dict]:
    from server.model.attention import plan_prefill, prefill_spans_torch
    from server.model.prefill_kernel import triton_prefill_attention
    from testkit.kernel_cases import prefill_error, random_prefill_case

    rows = []
    for head_dim in dims:
        for prompts, tokens in shapes:
            case = random_prefill_case([(tokens, 0)] * prompts, heads[0], heads[1], head_dim, 16, dtype,
                                       device.type, seed=0, decodes=0)
            q, k, v, kc, vc, ctx = case
            out = torch.empty_like(q)
            ms = {name: per_call_ms(lambda: fn(q, k, v, kc, vc, ctx, head_dim ** -0.5, out), device, calls)
                  for name, fn in (("span by span", prefill_spans_torch), ("kernel", triton_prefill_attention))}
            # The kernel with other tile sizes (rows = query tokens x the GQA group), for tuning PREFILL_TILE_ROWS.
            by_rows = {}
            for tile_rows in TILE_ROWS:
                ctx.prefill_plan = plan_prefill(ctx.prefills, heads[0] // heads[1], q.device, tile_rows)
                by_rows[tile_rows] = per_call_ms(lambda: triton_prefill_attention(q, k, v, kc, vc, ctx, head_dim ** -0.5,
                                                                             out), device, calls)
            err = prefill_error(triton_prefill_attention, random_prefill_case(
                [(tokens, 0)] * prompts, heads[0], heads[1], head_dim, 16, dtype, device.type, seed=1), head_dim ** -0.5)
            rows.append({"prompts": prompts, "tokens": tokens, "heads": heads[0], "kv_heads": heads[1],
                         "head_dim": head_dim, "span_ms": ms["span by span"], "kernel_ms": ms["kernel"],
                         "speedup": ms["span by span"] / ms["kernel"], "relative_error": err,
                         "kernel_ms_by_tile_rows": by_rows})
    return rows


def engine_rows(llm, concurrencies: list[int], input_len: int, output_len: int) -> list[dict]:
    from bench.serve import run_engine, summarize, workload

    core = llm.engine
    vocab = core.model_config.vocab_size
    paths = variants(core.model.ops)
    for name, ops in paths.items():  # warm-up: kernels compiled, the decode graphs replayed once
        core.model.ops = ops
        in_thread(run_engine, core, workload(2, input_len, 4, 0.0, math.inf, vocab, 7), 0.0, f"warm-{name}")
    rows = []
    for c in concurrencies:
        reqs = workload(c, input_len, output_len, 0.0, math.inf, vocab, 100 + c)
        for name, ops in paths.items():
            core.model.ops = ops
            core.reset_prefix_cache()  # the same prompts for both paths, neither finding the other's blocks
            results, duration = in_thread(run_engine, core, reqs, 0.0, f"{name}-{c}")
            s = summarize(results, duration)
            assert s["failed"] == 0 and s["output_tokens"] == c * output_len, s
            rows.append({"concurrency": c, "path": name, "output_tok_s": s["output_tok_s"],
                         "duration_s": duration, "ttft_p50_ms": s["ttft_ms"]["p50"] if s["ttft_ms"] else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="llama-1b (CUDA default) / llama-8b / llama-tiny: random weights")
    ap.add_argument("--concurrency", default=None, help="comma-separated; default 64,256")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--async-scheduling", default="on", choices=["off", "on"])
    ap.add_argument("--no-engine", action="store_true", help="attention alone")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU with TRITON_INTERPRET=1: the code path)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    smoke = args.smoke or device.type == "cpu"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict = {"date": now_iso(), "hardware": hardware(device), "dtype": str(dtype).split(".")[-1]}

    shapes = [(4, 8), (2, 40)] if smoke else [(256, 32), (64, 512)]
    heads = (4, 2) if smoke else (32, 8)
    attn = attention_rows(device, dtype, shapes, heads, [64] if smoke else [64, 128], 2 if smoke else 20)
    result["attention"] = attn
    print(f"\nprefill attention, one layer's call ({result['dtype']}, {result['hardware']}, {result['date']})")
    print(table([[f"{r['prompts']} x {r['tokens']}", f"{r['heads']}/{r['kv_heads']}/{r['head_dim']}",
                  f"{r['span_ms']:.3f}", f"{r['kernel_ms']:.3f}", f"{r['speedup']:.1f}x", f"{r['relative_error']:.1e}",
                  " / ".join(f"{r['kernel_ms_by_tile_rows'][n]:.3f}" for n in TILE_ROWS)] for r in attn],
                ["prompts x tokens", "heads/kv/dim", "span by span ms", "kernel ms", "kernel speed-up",
                 "kernel rel. error", f"kernel ms at {' / '.join(map(str, TILE_ROWS))} tile rows"]))

    if not args.no_engine:
        from server import LLM
        from testkit.models import model_folder

        name = args.model or ("llama-tiny" if smoke else "llama-1b")
        conc = [int(c) for c in (args.concurrency or ("2,4" if smoke else "64,256")).split(",")]
        input_len = args.input_len or (8 if smoke else 128)
        output_len = args.output_len or (4 if smoke else 256)
        folder = model_folder(name, Path(tempfile.mkdtemp()), max_position_embeddings=131072)
        kw = {"kv_cache_memory": "64MiB"} if device.type == "cpu" else {}
        llm = LLM(model=str(folder), device=device.type, load_format="dummy", max_num_seqs=max(conc),
                  max_model_len=2048, async_scheduling=args.async_scheduling == "on", **kw)
        try:
            rows = engine_rows(llm, conc, input_len, output_len)
        finally:
            llm.close()
        result.update(model=name, input_len=input_len, output_len=output_len, engine=rows)
        tok = {(r["concurrency"], r["path"]): r["output_tok_s"] for r in rows}
        print(f"\nprefill in the engine ({name}, in-process, C prompts of {input_len} tokens at once, "
              f"{output_len} output tokens each, async scheduling {args.async_scheduling})")
        print(table([[c, f"{tok[c, 'span by span']:.0f}", f"{tok[c, 'kernel']:.0f}",
                      f"{tok[c, 'kernel'] / tok[c, 'span by span']:.2f}x",
                      *(f"{r['ttft_p50_ms']:.0f}" for r in rows if r["concurrency"] == c)] for c in conc],
                    ["C", "span by span tok/s", "kernel tok/s", "kernel / span by span",
                     "TTFT p50 ms (span by span)", "TTFT p50 ms (kernel)"]))
        lo, hi = min(conc), max(conc)
        result["ratio"] = {p: tok[hi, p] / tok[lo, p] for p in ("span by span", "kernel")}
        print(f"prefill: in-process tok/s at {hi} / at {lo}: kernel {result['ratio']['kernel']:.2f}x, span by span "
              f"{result['ratio']['span by span']:.2f}x (target >= 2.5x for 256 / 64)")
    write_json(args.out, f"prefill-{device.type}", result)


if __name__ == "__main__":
    main()
