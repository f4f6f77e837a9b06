"""The small-batch matmul (server/model/small_gemm.py) against cuBLAS and the kernels it replaces, on a
decoder layer's shapes, inside CUDA graphs (as the decode step runs them).

Each case is a chain over `copies` distinct weight sets (together several times L2, so every weight comes
from HBM as in a real step) captured in one graph and replayed; the time per op is the replay's over the
chain. Three parts:
- sweep: each op (norm + q|k|v, o_proj, norm + gate|up + SiLU, down_proj, norm + LM head) over tile shapes
  and warps, at one row, programmatic dependent launch (GDC) on; the reference is cuBLAS with the unfused
  kernels around it (the Triton add_rmsnorm before, silu_mul after), in the same run;
- rows: the best tile per op at 1, 2, 4 and 8 rows, GDC on and off, against the same reference;
- layer: a decoder layer's four matmuls with their norms and activation, chained as the model runs them,
  the reference chain against the small-gemm chain (GDC on and off): µs a layer and the fraction of the
  measured copy bandwidth the layer's weight bytes reach.

    python bench/small_gemm.py --out $OUT
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, hardware, now_iso, table, write_json  # noqa: E402

SHAPES = {  # hidden, q|k|v rows, intermediate, vocabulary, o_proj's input (the q heads' width)
    "1b": (2048, 3072, 8192, 128256, 2048),
    "8b": (4096, 6144, 14336, 128256, 4096),
    # Qwen3-30B-A3B's attention and LM head (its MLP is sparse: gate|up and down here are a dense MLP of its
    # config's intermediate_size, kept for the chain): at batch 1 its qkv, o_proj and LM head through
    # small_gemm read 2.46 GB a step in 1.25 ms (H100, 12-05): 59% of its 3.35 TB/s, the tile chosen on the 1B and 8B.
    "30b-a3b": (2048, 5120, 6144, 151936, 4096),
}
EPS = 1e-5


def graph_time(fn, reps: int = 20) -> float:
    """Seconds one call of fn takes, captured in a CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    del g
    return best


class Layer:
    """One decoder layer's weights (packed as the loader packs them) and the activations a step passes."""

    def __init__(self, hidden: int, qkv: int, inter: int, dtype: torch.dtype, q_dim: int | None = None):
        def w(n, k):
            return torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5

        self.q_dim = q_dim or hidden
        self.qkv, self.o = w(qkv, hidden), w(hidden, self.q_dim)
        self.gate_up, self.down = w(2 * inter, hidden), w(hidden, inter)
        self.n1 = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
        self.n2 = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qkv, self.o, self.gate_up, self.down))


def ref_op(op: str, layer: Layer, x, r, head=None):
    from server.model.fused_ops import TritonOps

    if op == "qkv":
        h, r = TritonOps.add_rmsnorm(x, r, layer.n1, EPS)
        return F.linear(h, layer.qkv), r
    if op == "o":
        return F.linear(x, layer.o), r
    if op == "gate_up":
        h, r = TritonOps.add_rmsnorm(x, r, layer.n2, EPS)
        return TritonOps.silu_mul_packed(F.linear(h, layer.gate_up)), r
    if op == "down":
        return F.linear(x, layer.down), r
    h, r = TritonOps.add_rmsnorm(x, r, layer.n1, EPS)  # head
    return F.linear(h, head), r


def ours_op(op: str, layer: Layer, x, r, cfg: dict, gdc: bool, head=None):
    from server.model.small_gemm import small_gemm

    if op == "qkv":
        return small_gemm(x, layer.qkv, residual=r, norm_weight=layer.n1, eps=EPS, gdc=gdc, **cfg)
    if op == "o":
        return small_gemm(x, layer.o, gdc=gdc, **cfg)[0], r
    if op == "gate_up":
        return small_gemm(x, layer.gate_up, residual=r, norm_weight=layer.n2, eps=EPS, silu=True, gdc=gdc, **cfg)
    if op == "down":
        return small_gemm(x, layer.down, gdc=gdc, **cfg)[0], r
    return small_gemm(x, head, residual=r, norm_weight=layer.n1, eps=EPS, gdc=gdc, **cfg)


def op_input(op: str, rows: int, hidden: int, inter: int, dtype, q_dim: int | None = None):
    k = {"down": inter, "o": q_dim or hidden}.get(op, hidden)
    return (torch.randn(rows, k, device="cuda", dtype=dtype), torch.randn(rows, hidden, device="cuda", dtype=dtype))


def op_bytes(op: str, layer: Layer, head) -> int:
    t = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down, "head": head}[op]
    return t.numel() * t.element_size()


def configs(k: int):
    from server.model.small_gemm import block_k

    for block_n, warps, cap in itertools.product((1, 2, 4, 8), (2, 4, 8), (1024, 2048, 4096)):
        bk = block_k(k, cap)
        if bk != cap and cap > 1024 and block_k(k, cap // 2) == bk:
            continue  # the same chunk as the smaller cap
        if block_n * bk // (32 * warps) > 128 or block_n * bk // (32 * warps) < 8:
            continue  # too many registers a thread, or too little to load a thread
        yield {"block_n": block_n, "num_warps": warps, "block_k_cap": cap}


def chain_time(ops, layers, x, r):
    """One call runs every (op, layer) in order; the output of each feeds only the time, not the next."""
    def run():
        for fn, layer in itertools.product(ops, layers):
            fn(layer, x, r)
    return graph_time(run) / len(layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", default="1b,8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--gib", type=float, default=1.5, help="weights per chain (copies of a layer): past L2")
    args = ap.parse_args()
    dtype = torch.bfloat16
    dev = torch.device("cuda")
    # The HBM's rate as bench/throughput.py's roofline takes it: a device copy's bytes read + written per
    # second. A matmul's weight bytes over its time, as a share of it (runs before 2026-12-02 06:50 UTC printed
    # the share of half of it, "of read bw").
    bw = copy_bandwidth(dev)
    results = {"date": now_iso(), "hardware": hardware(dev), "copy_bandwidth": bw, "shapes": {}}
    print(f"copy bandwidth (read + write) {bw / 1e9:.0f} GB/s")
    for name in args.shapes.split(","):
        hidden, qkv, inter, vocab, q_dim = SHAPES[name]
        probe = Layer(hidden, qkv, inter, dtype, q_dim)
        copies = max(2, int(args.gib * 2**30 // probe.bytes()))
        layers = [probe] + [Layer(hidden, qkv, inter, dtype, q_dim) for _ in range(copies - 1)]
        head = torch.randn(vocab, hidden, device="cuda", dtype=dtype) / hidden ** 0.5
        heads = [head, torch.randn_like(head)]
        res = results["shapes"][name] = {"copies": copies, "sweep": {}, "rows": [], "layer": []}
        best = {}
        rows_out = []
        for op in ("qkv", "o", "gate_up", "down", "head"):
            k = {"down": inter, "o": q_dim}.get(op, hidden)
            x, r = op_input(op, 1, hidden, inter, dtype, q_dim)
            ls = [(lay, h) for lay, h in zip(layers, heads)] if op == "head" else [(lay, head) for lay in layers]
            nbytes = op_bytes(op, layers[0], head)

            def ref_fn(lh, x=x, r=r, op=op):
                return ref_op(op, lh[0], x, r, lh[1])

            t_ref = chain_time([ref_fn], ls, x, r)
            sweep = []
            for cfg in configs(k):
                def fn(lh, x=x, r=r, op=op, cfg=cfg):
                    return ours_op(op, lh[0], x, r, cfg, True, lh[1])
                try:
                    t = chain_time([fn], ls, x, r)
                except Exception as e:  # a tile the compiler refuses (registers, shared memory)
                    print(f"  {name} {op} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                sweep.append({**cfg, "us": t * 1e6})
            sweep.sort(key=lambda s: s["us"])
            best[op] = {c: sweep[0][c] for c in ("block_n", "num_warps", "block_k_cap")}
            res["sweep"][op] = {"reference_us": t_ref * 1e6, "bytes": nbytes, "configs": sweep}
            print(f"{name} {op}: cuBLAS + unfused {t_ref * 1e6:.1f} us ({nbytes / t_ref / bw:.0%} of the copy rate); "
                  f"best {sweep[0]['us']:.1f} us ({nbytes / (sweep[0]['us'] / 1e6) / bw:.0%}) at {best[op]}; "
                  f"top 5: " + ", ".join(f"{s['block_n']}/{s['num_warps']}/{s['block_k_cap']}:{s['us']:.1f}"
                                         for s in sweep[:5]))
            for rows in (1, 2, 4, 8):
                xr, rr = op_input(op, rows, hidden, inter, dtype, q_dim)

                def ref_r(lh, x=xr, r=rr, op=op):
                    return ref_op(op, lh[0], x, r, lh[1])
                t_ref = chain_time([ref_r], ls, xr, rr)
                row = {"op": op, "rows": rows, "reference_us": t_ref * 1e6}
                for gdc in (True, False):
                    def fn(lh, x=xr, r=rr, op=op, gdc=gdc):
                        return ours_op(op, lh[0], x, r, best[op], gdc, lh[1])
                    row["gdc" if gdc else "plain"] = chain_time([fn], ls, xr, rr) * 1e6
                res["rows"].append(row)
                rows_out.append([op, rows, f"{row['reference_us']:.1f}", f"{row['gdc']:.1f}", f"{row['plain']:.1f}",
                                 f"{row['reference_us'] / row['gdc']:.2f}"])
        print(table(rows_out, ["op", "rows", "cuBLAS+unfused us", "small gdc us", "small plain us", "speed-up"]))
        layer_out = []
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            r = torch.randn(rows, hidden, device="cuda", dtype=dtype)

            def ref_layer(layer, x=x, r=r):
                qkv_out, r2 = ref_op("qkv", layer, x, r)
                o = ref_op("o", layer, qkv_out[:, :q_dim], r2)[0]
                act, r3 = ref_op("gate_up", layer, o, r2)
                return ref_op("down", layer, act, r3)

            def our_layer(layer, x=x, r=r, gdc=True):
                qkv_out, r2 = ours_op("qkv", layer, x, r, best["qkv"], gdc)
                o = ours_op("o", layer, qkv_out[:, :q_dim], r2, best["o"], gdc)[0]
                act, r3 = ours_op("gate_up", layer, o, r2, best["gate_up"], gdc)
                return ours_op("down", layer, act, r3, best["down"], gdc)

            t_ref = chain_time([ref_layer], layers, x, r)
            t_gdc = chain_time([our_layer], layers, x, r)
            t_plain = chain_time([lambda lay, x=x, r=r: our_layer(lay, x, r, False)], layers, x, r)
            nbytes = layers[0].bytes()
            res["layer"].append({"rows": rows, "reference_us": t_ref * 1e6, "gdc_us": t_gdc * 1e6,
                                 "plain_us": t_plain * 1e6, "bytes": nbytes})
            layer_out.append([rows, f"{t_ref * 1e6:.1f} ({nbytes / t_ref / bw:.0%})",
                              f"{t_gdc * 1e6:.1f} ({nbytes / t_gdc / bw:.0%})",
                              f"{t_plain * 1e6:.1f} ({nbytes / t_plain / bw:.0%})", f"{t_ref / t_gdc:.2f}"])
        print(f"{name}: a layer's four matmuls with their norms and SiLU ({copies} weight sets)")
        print(table(layer_out, ["rows", "reference us (of the copy rate)", "small gdc", "small plain", "speed-up"]))
        res["best"] = best
        del layers, heads, head, probe
        torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, "small_gemm", results)


if __name__ == "__main__":
    main()
