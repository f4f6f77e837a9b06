"""Mixture-of-experts serving on one device (Qwen3-30B-A3B's shape, random weights), in one run:

- decode tok/s at batch 1, 64 and 256 beside the roofline of the bytes a step really reads: the experts the
  batch activated (counted from the routed experts the engine returned for those very steps), the attention,
  norm and router weights, the LM head, and the KV cache read, at the memory bandwidth measured in the run
  (or its FLOPs at the measured matmul rate, whichever is slower); at the smallest batch also the device's busy
  time a step and its longest idle gaps (device_timeline: what lies between the decode graphs);
- level-1 sleep and wake seconds per cycle, the first included, beside the raw pinned copy bandwidth for
  the same bytes; level 2 and a reload; device memory in use while asleep;
- the cost of routed-expert capture at batch 256: the same decode with the flag off (another engine), on
  without asking (the sparse layers' buffer writes), and on with every request asking;
- CUDA: one sparse layer alone (fused_moe.py) at 1, 64, 256 and 8192 tokens, its default tiles against a few
  others, its few-token path, and the same layer on PyTorch's grouped GEMM (torch._grouped_mm: a library's
  kernel beside ours), each captured in a CUDA graph, beside the bytes of the experts it read.

Prints one JSON object (stdout, also --out/moe.json) and its progress on stderr; a phase that runs past
--phase-timeout prints what it has and exits 124.

    python bench/moe.py --device cuda --out $OUT            # H200: Qwen3-30B-A3B (61 GB in bf16)
    python bench/moe.py --small                              # CPU, a tiny Qwen3-MoE: < 60 s (tests/test_bench_moe.py)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import gpu_clocks, graph_ms, hardware, now_iso, write_json  # noqa: E402
from testkit.models import MOE_CONFIGS, moe_model_folder  # noqa: E402

GB = 1e9
RESULT: dict = {}


class Phases:
    """Progress on stderr, and a watchdog: a phase past its limit prints the results so far and exits 124."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.name: str | None = None
        self.started = 0.0
        threading.Thread(target=self._watch, daemon=True).start()

    def __call__(self, name: str) -> "Phases":
        self.name, self.started = name, time.perf_counter()
        print(f"[moe] {name} ...", file=sys.stderr, flush=True)
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        print(f"[moe] {self.name}: {time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True)
        self.name = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if self.name is not None and time.perf_counter() - self.started > self.limit_s:
                RESULT["timed_out"] = f"{self.name} ran past {self.limit_s:.0f} s"
                print(json.dumps(RESULT, default=str), flush=True)
                os._exit(124)


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(100, min(vocab, 49152), length).tolist() for _ in range(batch)]


# A few sequences' steps: at least this many timed a run, in at least SMALL_BATCH_REPEATS rounds. A run's time
# includes the prompt's prefill, which the one-token run's subtracts; at batch 1, 32 steps (~0.1 s) in 2 rounds
# let that prefill's noise through: the 30B's batch-1 step read 2.56 to 4.00 ms on H100s (2026-12-06), its two
# engines in one process each faster or slower by turns.
SMALL_BATCH, SMALL_BATCH_STEPS, SMALL_BATCH_REPEATS = 8, 128, 5


def decode_rate(llm, batch: int, prompt_len: int, steps: int, ask: bool, repeats: int) -> dict:
    """Decode tok/s of `batch` sequences: generate(steps + 1) minus generate(1) on the same prompts (prefix
    caching off: both prefill alike), the median of `repeats`. With ask, also the routed experts of the run."""
    from server import SamplingParams

    ids = prompts(batch, prompt_len, llm.engine.model_config.vocab_size, seed=batch)
    if batch <= SMALL_BATCH:
        steps, repeats = max(steps, SMALL_BATCH_STEPS), max(repeats, SMALL_BATCH_REPEATS)

    def run(n: int) -> tuple[float, list]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, return_routed_experts=ask)
        t = time.perf_counter()
        outs = llm.generate(ids, params)
        return time.perf_counter() - t, outs

    run(2)  # warm-up
    times = []
    outs: list = []
    for _ in range(repeats):
        full, outs = run(steps + 1)
        prefill, _ = run(1)
        times.append(max(full - prefill, 1e-9))
    seconds = statistics.median(times)
    res = {"batch": batch, "steps": steps, "prompt_tokens": prompt_len, "decode_s": seconds,
           "step_ms": 1e3 * seconds / steps, "tok_s": batch * steps / seconds,
           # each round's step: the spread says whether two figures differ by more than the method's noise
           "round_step_ms": [1e3 * t / steps for t in times],
           # clocks and temperature after the rate: a throttled GPU would show here (12-06: 1830-1980 MHz)
           "gpu_after": gpu_clocks()}
    if ask:
        res["routed"] = [o.outputs[0].routed_experts for o in outs]
    return res


def timeline(llm, row: dict, args, phases: "Phases") -> None:
    """The smallest batch's device timeline (device_timeline) into its decode row: the last thing the benchmark
    does, on the flag-off engine (none with --no-off-engine), so nothing timed runs after torch.profiler has.
    (The profiler was suspected of the 0.60 wakes and the slower flag-off engine of 12-05/06; it caused neither:
    the wakes were one host's copy kernel, bench/host_copies.py, and the flag-off engine steps slower at batch 1
    with nothing traced before it.)"""
    with phases("the smallest batch's device timeline (flag off)"):
        row["device_timeline"] = device_timeline(llm, row["batch"], args.prompt_len, min(args.steps, 32))


def device_timeline(llm, batch: int, prompt_len: int, steps: int, top: int = 8) -> dict:
    """One generate of `steps` tokens a sequence under torch.profiler (device activity only): the device's busy ms
    a step against the step's time (what the decode graph and the sampler keep the device doing, and what lies
    between), and the `top` longest idle gaps with the activities around each. At batch 1 on 12-05 the decode
    graph took 3.32 ms of a 4.37 ms step (H100): this says where the rest goes. ({} without device events.)"""
    from torch.profiler import ProfilerActivity, profile as traced

    from server import SamplingParams
    from server.engine.step_profiler import device_busy

    if not torch.cuda.is_available():
        return {}
    ids = prompts(batch, prompt_len, llm.engine.model_config.vocab_size, seed=batch)
    with traced(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    busy, span = device_busy(prof.events())
    gaps, (end, before) = [], spans[0][1:]
    for lo, hi, name in spans[1:]:
        if lo > end:
            gaps.append((lo - end, before[:70], name[:70]))
        if hi > end:
            end, before = hi, name
    gaps.sort(reverse=True)
    return {"busy_ms_per_step": busy / steps / 1e3, "span_ms_per_step": span / steps / 1e3,
            "idle_ms_per_step": sum(g[0] for g in gaps) / steps / 1e3,
            "longest_gaps_us": [{"us": round(us, 1), "after": a, "before": b} for us, a, b in gaps[:top]]}


def alternating(llm, batch: int, prompt_len: int, steps: int, repeats: int) -> tuple[dict, float]:
    """decode_rate not asking for routed experts and asking, one run each in turn, at least 3 times: (the
    not-asking row with its median, the asking median tok/s). Measured one after the other, the pass that ran
    first came out 15% slower than the one asking, which does more (2026-12-05, H100): an order effect."""
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(max(3, repeats)):
        for ask in (False, True):
            runs[ask].append(decode_rate(llm, batch, prompt_len, steps, ask=ask, repeats=1))
    row = sorted(runs[False], key=lambda r: r["tok_s"])[len(runs[False]) // 2]
    row.pop("routed", None)
    row["repeats_tok_s"] = [r["tok_s"] for r in runs[False]]
    return row, statistics.median(r["tok_s"] for r in runs[True])


def activated_experts(routed: list[np.ndarray], prompt_len: int, steps: int) -> float:
    """Mean over the decode steps and sparse layers of the distinct experts the batch's tokens went to."""
    counts = []
    for s in range(steps):
        pos = prompt_len + s  # the token each sequence fed at decode step s
        rows = np.stack([r[pos] for r in routed])  # [batch, layers, k]
        counts += [len(np.unique(rows[:, layer])) for layer in range(rows.shape[1])]
    return float(np.mean(counts))


def step_bytes(model, batch: int, context: float, experts: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step: weights outside the experts once (the embedding only for the rows
    looked up), `experts` of each sparse layer's experts, and the KV of `context` tokens per sequence."""
    from server.model.moe import ExpertStack

    c = model.config
    elem = next(model.parameters()).element_size()
    stacks = [m for m in model.modules() if isinstance(m, ExpertStack)]
    expert_bytes = sum(m.w13_weight[0].numel() + m.w2_weight[0].numel() for m in stacks) * elem  # one expert/layer
    params = dict(model.named_parameters())
    in_stacks = sum(p.numel() for n, p in params.items() if ".experts." in n) * elem
    embed = params["model.embed_tokens.weight"].numel() * elem
    dense = sum(p.numel() for p in model.parameters()) * elem - in_stacks - embed
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * elem * batch * context
    nbytes = dense + experts * expert_bytes + batch * c.hidden_size * elem + kv
    active = (sum(p.numel() for n, p in params.items() if ".layers." in n and ".experts." not in n)
              + c.num_experts_per_tok * expert_bytes / elem)
    flops = 2 * batch * (active + c.vocab_size * c.hidden_size) + 4 * c.num_layers * c.num_heads * c.head_dim * batch * context
    return nbytes, flops


# The narrow ones (BLOCK_N 16, 32) are for a decode batch of a few tokens: 8 assignments at batch 1 give 8
# busy blocks, so only the N tiles spread a layer's 75 MB over the SMs (64 wide: 96 programs on 132 SMs).
TILES = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128),
         dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
         dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64),
         dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)]


def library_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """The same layer on a well-kept library's grouped GEMM, for comparison: PyTorch's torch._grouped_mm (CUTLASS
    on Hopper) for gate|up and for down over the assignments sorted by expert, silu * up and the weighted
    scatter-add in PyTorch; no host sync, so it captures in a CUDA graph. (FlashInfer's fused MoE was the other
    candidate: a 101 MB wheel, 715 MB unpacked, plus ~40 MB of dependencies and the CUTLASS DSL, and its sm_90
    kernels build with nvcc on first use: more than a device call carries and builds, 2026-12-05.)"""
    T, K = ids.shape
    I = w2.shape[2]
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tokens = order // K
    h = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs)            # [T*K, 2I]
    act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)                   # [T*K, H]
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)


# Up to SMALL_TOKENS tokens a layer reads a few experts (75 MB at one token of the 30B-A3B shape, against a 50 MB
# L2): replayed alone, part of them could come from L2, which a decode step, reading 48 layers' experts in turn,
# never gives. So a capture runs the layer on this many inputs, each routed to its own experts, in turn.
FEW_TOKEN_INPUTS = 8


def layer_times(config: dict, device: torch.device, tokens: list[int], bandwidth: float, flops: float) -> list[dict]:
    """One sparse layer's experts (align + both GEMMs + combine) per token count: the default tiles and each of
    TILES, captured in a CUDA graph as decode runs them and timed per replay with CUDA events (median of 20),
    beside the bytes of the distinct experts the tokens chose (a mean over the inputs, FEW_TOKEN_INPUTS of them
    up to SMALL_TOKENS tokens). (Timed eagerly, every tile took the same 349 us at 1 token, 2026-12-04: the
    launches, not the kernels.)"""
    from server.model.fused_moe import SMALL_TOKENS, fused_experts, route, route_align_small, tiles

    H, I, E, K = (config["hidden_size"], config["moe_intermediate_size"], config["num_experts"],
                  config["num_experts_per_tok"])
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, device=device, dtype=torch.bfloat16, generator=g) / I ** 0.5
    gate = torch.randn(E, H, device=device, dtype=torch.bfloat16, generator=g) / H ** 0.5
    rows = []
    for T in tokens:
        inputs = []  # (x, ids, weights): one layer call each, in turn in one capture
        for _ in range(FEW_TOKEN_INPUTS if T <= SMALL_TOKENS else 1):
            x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=g)
            inputs.append((x, *route(x, gate, K, True, True)))

        def timed(cfg, layer=fused_experts) -> float:  # microseconds a call, as a decode graph replays it
            def calls() -> None:
                for x, ids, weights in inputs:
                    layer(x, w13, w2, ids, weights, cfg)
            return 1e3 * graph_ms(calls, device, replays=20, per_replay=len(inputs))

        default = tiles(T * K, max(H, I), E)
        sweep = {json.dumps(t): timed(t) for t in TILES}
        best = min(sweep, key=sweep.get)
        experts = sum(len(torch.unique(ids)) for _, ids, _ in inputs) / len(inputs)
        nbytes = experts * 3 * H * I * 2
        floor_us = 1e6 * max(nbytes / bandwidth, 2 * 3 * H * I * T * K / flops)
        row = {"tokens": T, "inputs": len(inputs), "experts_read": experts, "default_tile": default,
               "default_us": sweep.get(json.dumps(default), None) or timed(default), "best_tile": json.loads(best),
               "best_us": sweep[best], "roofline_us": floor_us, "sweep_us": sweep}
        try:  # the library's grouped GEMM, as the same graph runs it
            row["library_us"] = timed(None, lambda *a: library_experts(*a[:5]))
        except (RuntimeError, AttributeError) as e:  # torch._grouped_mm missing or refusing these shapes here
            row["library_error"] = f"{type(e).__name__}: {e}"[:300]
        if T <= SMALL_TOKENS:
            # the one-program routing alone (unchained: its own time) by its warps: a batch-1 layer waits for it
            logits = inputs[0][0] @ gate.t()
            def routings(w: int, n: int = 16) -> None:  # n in one graph: the replay's own launch cost shared
                for _ in range(n):
                    route_align_small(logits, K, True, True, 16, num_warps=w)
            row["route_align_us"] = {w: 1e3 * graph_ms(lambda w=w: routings(w), device, replays=20, per_replay=16)
                                     for w in (1, 2, 4)}
        rows.append(row)
    return rows


def sleep_cycles(llm, weight_bytes: int, cycles: int, device: torch.device) -> dict:
    from bench.sleep_wake import used

    rows = []
    for _ in range(cycles):
        awake = used(device)
        t = time.perf_counter()
        s = llm.sleep(level=1)
        sleep_s = time.perf_counter() - t
        asleep = used(device)
        t = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t
        rows.append({"sleep_s": sleep_s, "engine_sleep_s": s.seconds, "wake_s": wake_s, "awake_used": awake,
                     "asleep_used": asleep, "sleep_gbps": weight_bytes / sleep_s / GB,
                     "wake_gbps": weight_bytes / wake_s / GB})
    t = time.perf_counter()
    llm.sleep(level=2)
    l2_sleep = time.perf_counter() - t
    asleep2 = used(device)
    t = time.perf_counter()
    llm.wake_up()
    l2_wake = time.perf_counter() - t
    t = time.perf_counter()
    llm.update_weights()  # dummy weights: the same seeded values again
    reload_s = time.perf_counter() - t
    return {"level1": rows, "level2": {"sleep_s": l2_sleep, "wake_s": l2_wake, "reload_dummy_s": reload_s,
                                       "asleep_used": asleep2}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MOE_CONFIGS))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=3, help="level-1 sleep/wake cycles (the first is reported too)")
    ap.add_argument("--phase-timeout", type=float, default=420.0)
    ap.add_argument("--no-off-engine", action="store_true", help="skip the flag-off engine (capture cost)")
    ap.add_argument("--small", action="store_true", help="CPU, a tiny Qwen3-MoE, few steps: a smoke run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    global SMALL_BATCH
    if args.small:
        SMALL_BATCH = 0  # a smoke run: the few steps asked for
        args.device, args.model, args.batches = "cpu", "qwen3-moe-tiny", "1,4,8"
        args.steps, args.prompt_len, args.repeats, args.cycles = 4, 16, 1, 1
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    phases = Phases(args.phase_timeout)
    from bench.roofline import Device
    from server import LLM

    RESULT.update({"bench": "moe", "date": now_iso(), "hardware": hardware(device), "model": args.model,
                   "config": MOE_CONFIGS[args.model], "args": {k: str(v) for k, v in vars(args).items()}})
    folder = moe_model_folder(args.model, Path(tempfile.mkdtemp()))
    max_len = args.prompt_len + max(args.steps, SMALL_BATCH_STEPS) + 8
    kw = dict(model=str(folder), device=args.device, load_format="dummy", max_num_seqs=max(batches),
              max_model_len=max_len, enable_prefix_caching=False)
    if device.type == "cpu":
        kw["kv_cache_memory"] = "64MiB"
    with phases("measure the device"):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        dev = Device.measure(device, dtype)
        RESULT["device"] = {"bandwidth_gbps": dev.bandwidth / GB, "gemm_tflops": dev.gemm_flops / 1e12}
        if device.type == "cuda":
            from bench.sleep_wake import raw_pinned_gbps

            RESULT["raw_pinned_gbps"] = raw_pinned_gbps()

    if device.type == "cuda":
        with phases("one sparse layer, tiles"):
            RESULT["layer"] = layer_times(MOE_CONFIGS[args.model], device, [1, 64, 256, 8192], dev.bandwidth,
                                          dev.gemm_flops)
            torch.cuda.empty_cache()

    with phases("start the engine (routed experts on)"):
        t = time.perf_counter()
        llm = LLM(enable_return_routed_experts=True, **kw)
        RESULT["start_s"] = time.perf_counter() - t
    model = llm.engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    RESULT["weight_bytes"] = weight_bytes
    RESULT["parameters"] = sum(p.numel() for p in model.parameters())
    decode = []
    for batch in batches:
        with phases(f"decode at batch {batch}"):
            routed = decode_rate(llm, batch, args.prompt_len, args.steps, ask=True, repeats=1)
            experts = activated_experts(routed.pop("routed"), args.prompt_len, routed["steps"])
            if batch == max(batches):  # the capture's cost: not asking and asking in turn, so order is no bias
                row, asking = alternating(llm, batch, args.prompt_len, args.steps, args.repeats)
                row["asking_tok_s"] = asking
            else:
                row = decode_rate(llm, batch, args.prompt_len, args.steps, ask=False, repeats=args.repeats)
            context = args.prompt_len + (row["steps"] + 1) / 2  # the mean context a decode step reads
            nbytes, flops = step_bytes(model, batch, context, experts)
            floor = max(nbytes / dev.bandwidth, flops / dev.gemm_flops)
            row.update({"experts_per_layer": experts, "step_bytes": nbytes, "roofline_step_ms": 1e3 * floor,
                        "roofline_tok_s": batch / floor, "fraction_of_roofline": floor / (row["step_ms"] / 1e3)})
            decode.append(row)
            RESULT["decode"] = decode
    with phases("sleep and wake"):
        RESULT["sleep"] = sleep_cycles(llm, weight_bytes, args.cycles, device)
        raw = RESULT.get("raw_pinned_gbps")
        if raw:
            first = RESULT["sleep"]["level1"][0]
            RESULT["sleep"]["level1_vs_raw"] = {"sleep_first": first["sleep_gbps"] / raw["d2h"],
                                                "wake_first": first["wake_gbps"] / raw["h2d"]}
    llm.close()
    del llm, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    top = decode[-1]
    capture = {"batch": top["batch"], "on_not_asking_tok_s": top["tok_s"], "on_asking_tok_s": top["asking_tok_s"]}
    if not args.no_off_engine:
        with phases("flag off: decode at the largest batch"):
            with LLM(**kw) as off:
                row = decode_rate(off, top["batch"], args.prompt_len, args.steps, ask=False, repeats=args.repeats)
                # and the smallest batch: whether the capture's graph nodes are part of a small step's time
                small = decode_rate(off, decode[0]["batch"], args.prompt_len, args.steps, ask=False,
                                    repeats=args.repeats)
                timeline(off, decode[0], args, phases)
            capture["off_tok_s"] = row["tok_s"]
            capture["off_smallest_batch"] = {"batch": small["batch"], "step_ms": small["step_ms"],
                                             "on_step_ms": decode[0]["step_ms"]}
            capture["cost_not_asking"] = 1 - top["tok_s"] / row["tok_s"]
            capture["cost_asking"] = 1 - top["asking_tok_s"] / row["tok_s"]
    RESULT["routed_capture"] = capture
    print(json.dumps(RESULT, default=str), flush=True)
    if args.out:
        write_json(args.out, "moe", RESULT)


if __name__ == "__main__":
    main()
