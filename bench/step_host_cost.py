"""Host cost of a decode step, the forward excluded: what grows with the batch besides the GPU's work.

A decode step at batch B is the forward (a graph replay on CUDA) plus host work: the scheduler, the
inputs, sampling (the sampler's Python around its tensor ops), stop checks, detokenization, the output
objects; then, in the server, the engine process encodes the step's deltas and pickles one frame, and
the API process unpickles it and rebuilds each request's output. This runs the engine's real step on an
RL-rollout-like load (temperature 1, top-p, logprobs=0, n sequences per prompt) and times, per step:

- engine: EngineCore.step(), minus the forward (the runner's forward, timed synchronized);
- frame: the pickled frame of the step's deltas (the engine process encodes them from the requests inside
  the step, as here);
- api: the API process's side: unpickle the frame, apply each delta to its request's OutputStream and
  take the merged output, as a streaming route's consumer does every step (the text of a stream without
  stop strings included: the API makes it, SamplingParams.text_by_api).

Then the engine's Python alone (python_cost): the same decode bookkeeping with no model and no sampler, on
tokens that decode to whole characters, per sequence: the host work the forward has to cover.

Then (--async-scheduling off,on) the wall time per step as the engine process runs them (step() and the
frame's pickling, no synchronization inside the loop), with async scheduling off and on, side by side: with
it on, the host's work of one step overlaps the device's forward of the next, so on CUDA the step time
falls from forward + host toward the larger of the two (the forward_ms column is that floor).

Then (--http) the same kind of decode through the real server: C requests at once, streamed and not, and
the CPU time each process (API, engine) spends per output token.

On CPU the times are the engine thread's CPU time (the shared host's load makes wall times vary twofold). On CPU the model is `llama-micro` by default (one small layer; a 1k vocabulary so the sampler's tensor ops
stay small), so the figures are host work; the sampler's own tensor ops still run on the CPU and count as
host there (on CUDA they are launches). With --profile the engine part's hottest functions are printed.

    python bench/step_host_cost.py --device cpu
    python bench/step_host_cost.py --device cuda --model llama-1b --out $OUT
    python bench/step_host_cost.py --device cuda --model llama-1b --async-scheduling off,on --http none
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import math
import pickle
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import in_thread, sync, table, write_json  # noqa: E402
from bench.spy import cpu_seconds  # noqa: E402
from testkit.models import model_folder  # noqa: E402


def measure(llm, batch: int, kind: str, n: int, steps: int, temperature: float, top_p: float,
            logprobs: int | None, stop: list[str] | None, profile: bool) -> dict:
    from server import SamplingParams
    try:
        from server.wire.params import RequestOutputKind
        kind_arg = {"output_kind": RequestOutputKind.FINAL_ONLY if kind == "final" else RequestOutputKind.CUMULATIVE}
    except ImportError:  # a tree from before output kinds (a before/after comparison): an output every step
        kind_arg = {}
    from server.engine import deltas as channel
    from server.wire.messages import Frame, Status, pack
    from server.api.engine_client import OutputStream
    try:
        from server.api.engine_client import make_texts
    except ImportError:  # a tree from before text_by_api (a before/after comparison)
        make_texts = None

    core, runner = llm.engine, llm.engine.runner
    dev = core.device
    # On CPU, this thread's CPU time: the shared host's load changes wall times twofold from run to run,
    # while the work done barely changes. On CUDA, wall time (the host waits for the device in sync()).
    clock = time.perf_counter if dev.type == "cuda" else time.thread_time
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=steps + 64, ignore_eos=True,
                            logprobs=logprobs, stop=stop, **kind_arg)
    outs: list = []
    if hasattr(channel, "encode_delta"):  # as the engine process runs it: deltas from the requests themselves
        core.wire_outputs(lambda req: outs.append(channel.encode_delta(req)))
        encode = None
    else:  # a tree from before (a before/after comparison): RequestOutputs, then a DeltaEncoder
        encode = channel.DeltaEncoder().encode
    params, tokenizer = _as_served(params, core.tokenizer)
    streams: dict[str, OutputStream] = {}
    prompt_len = 32
    for i in range(batch // n):
        rid = f"b{batch}-{i}"
        ids = [(100 + 7 * i + j) % 1000 + 16 for j in range(prompt_len)]
        core.add_request(rid, prompt_token_ids=ids, params=params, on_output=outs.append)
        streams[rid] = OutputStream(None, ids, n, tokenizer) if tokenizer is not None else OutputStream(None, ids, n)
    while any(r.first_token_time is None for r in core.requests.values()):
        core.step()
    outs.clear()
    forward = runner.forward
    fwd_time = [0.0]

    def timed_forward(hb):
        sync(dev)
        t = clock()
        result = forward(hb)
        sync(dev)
        fwd_time[0] += clock() - t
        return result

    runner.forward = timed_forward
    gc_time = [0.0, 0.0]  # the garbage collector's pauses inside the timed steps (start, total)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time[0] = clock()
        else:
            gc_time[1] += clock() - gc_time[0]

    gc.callbacks.append(on_gc)
    prof = cProfile.Profile() if profile else None
    totals = {"step": 0.0, "forward": 0.0, "frame": 0.0, "api": 0.0}
    status = Status(core.stats())
    frame_bytes = 0
    try:
        for _ in range(steps):
            fwd_time[0] = 0.0
            sync(dev)
            t0 = clock()
            if prof:
                prof.enable()
            core.step()
            if prof:
                prof.disable()
            sync(dev)
            t1 = clock()
            data = pack(Frame(outs if encode is None else [encode(o) for o in outs], status, [batch]))
            t2 = clock()
            outs.clear()
            frame = pickle.loads(memoryview(data)[8:])
            applied = [streams[item[0]] for item in frame.items]
            for s, item in zip(applied, frame.items):
                s.apply(item)
            if make_texts is not None:  # as EngineClient._on_frame: the frame's streamed texts made together
                make_texts([s for s in applied if s.owed])
            for s in applied:
                s.take()
            t3 = clock()
            frame_bytes += len(data)
            totals["step"] += t1 - t0
            totals["forward"] += fwd_time[0]
            totals["frame"] += t2 - t1
            totals["api"] += t3 - t2
    finally:
        gc.callbacks.remove(on_gc)
        runner.forward = forward
        core.abort_all()
        if encode is None:
            core.wire_outputs(None)
    # What crossed: every sampled token once per step (streaming), nothing before the end (FINAL_ONLY).
    applied = sum(len(acc.token_ids) for st in streams.values() for acc in st.seqs)
    if applied != (batch // n * n * steps if kind == "stream" else 0):
        raise RuntimeError(f"the API side got {applied} tokens in {steps} steps of {batch} sequences ({kind})")
    row = {"batch": batch, "kind": kind, "n": n, **{f"{k}_ms": 1e3 * v / steps for k, v in totals.items()},
           "frame_kib": frame_bytes / steps / 1024}
    row["gc_ms"] = 1e3 * gc_time[1] / steps
    row["engine_host_ms"] = row["step_ms"] - row["forward_ms"]
    row["host_total_ms"] = row["engine_host_ms"] + row["frame_ms"]
    row["host_us_per_seq"] = 1e3 * row["host_total_ms"] / batch
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
        row["profile"] = s.getvalue()
    return row


@functools.lru_cache(maxsize=2)
def _stream_copy(tokenizer, stream_copy):
    """One copy for every measurement, as the server makes one: its cache of token texts stays warm."""
    return stream_copy(tokenizer)


def _as_served(params, tokenizer):
    """The params as the server's EngineClient.generate sends them, and the tokenizer its OutputStream makes
    the text with (a stream without stop strings: text_by_api), or None (the engine makes it; a tree from
    before text_by_api, for a before/after comparison)."""
    from dataclasses import replace
    try:
        from server.api.engine_client import text_tokenizer
        from server.api.tokens import stream_copy
    except ImportError:
        return params, None
    tokenizer = text_tokenizer(_stream_copy(tokenizer, stream_copy), params)
    return (replace(params, text_by_api=True), tokenizer) if tokenizer is not None else (params, None)


def python_cost(llm, batch: int, kind: str, n: int, steps: int, logprobs: int | None, stop: list[str] | None,
                repeats: int = 5) -> dict:
    """The engine's Python per sequence per decode step, with no model and no sampler: Scheduler.schedule_ahead
    (the next step's plan and blocks) + EngineCore.postprocess (append, stop and length checks, text, outputs)
    + the frame (encode_delta, pickle), on `batch` real sequences fed tokens that decode to whole characters
    (what a trained model mostly samples; a dummy model's random ids are byte tokens or ids the tokenizer
    does not know far more often). kind "inproc": RequestOutputs for an on_output callback per request and
    step (bench/serve.py's in-process path), n=1. This thread's CPU time, the fastest of `repeats` runs: on
    the GPU's host, the host work per sequence that the forward has to cover for a step to be device-bound."""
    import random

    from server import SamplingParams
    from server.engine import deltas as channel
    from server.wire.messages import Frame, Status, pack
    from server.wire.detokenizer import _whole_pieces
    from server.wire.params import RequestOutputKind
    from server.engine.step_types import ScheduledBatch, StepResult

    core = llm.engine
    pieces = _whole_pieces(core.tokenizer)
    hi = min(core.model_config.vocab_size, len(core.tokenizer))
    whole = [t for t in range(100, hi) if pieces is None or pieces[t]][:5000]
    rng = random.Random(0)
    wire = kind != "inproc"
    n = n if wire else 1
    outs: list = []
    core.wire_outputs((lambda req: outs.append(channel.encode_delta(req))) if wire else None)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=repeats * steps + 64, ignore_eos=True,
                            logprobs=logprobs, stop=stop,
                            output_kind=RequestOutputKind.FINAL_ONLY if kind == "final" else RequestOutputKind.CUMULATIVE)
    if wire:  # what the server sends (in process, LLM's requests never have the API make their text)
        params = _as_served(params, core.tokenizer)[0]
    best = math.inf
    try:
        for i in range(batch // n):
            core.add_request(f"p{batch}-{kind}-{i}", prompt_token_ids=[rng.choice(whole) for _ in range(32)],
                             params=params, on_output=outs.append if wire else (lambda out: None))
        while core.scheduler.waiting or any(s.num_computed < s.num_tokens - 1 for s in core.scheduler.running):
            core.step()
        core.drain()
        seqs = list(core.scheduler.running)
        status = Status(core.stats())
        for _ in range(repeats):
            outs.clear()
            t0 = time.thread_time()
            for _ in range(steps):
                if core.scheduler.schedule_ahead(seqs) is None:
                    raise RuntimeError("the decode step could not be planned ahead")
                tokens = [rng.choice(whole) for _ in seqs]
                # the sampler's log-prob tuples (logprob_list.py), in process and in the engine process alike
                lps = [(t, -1.5, 3, pieces[t] if pieces else None) for t in tokens] if logprobs is not None \
                    else [None] * len(seqs)
                batch_ = ScheduledBatch([(s, 1) for s in seqs], 0, len(seqs), core.scheduler.removals)
                result = StepResult([s.seq_id for s in seqs], tokens, lps)
                core.outputs_for(core.scheduler.update_from_output(batch_, result))
                if wire:
                    pack(Frame(outs, status, [batch]))
                    outs.clear()
            best = min(best, time.thread_time() - t0)
    finally:
        core.abort_all()
        core.drain()
        core.wire_outputs(None)
    return {"batch": batch, "kind": kind, "n": n, "python_us_per_seq": 1e6 * best / steps / len(seqs)}


def step_wall(llm, batch: int, kind: str, n: int, steps: int, temperature: float, top_p: float,
              logprobs: int | None, stop: list[str] | None, async_on: bool) -> dict:
    """Wall milliseconds per decode step with async scheduling on or off, as the engine process runs them:
    step(), then the step's deltas pickled into a frame; synchronized only around the whole run."""
    from server import SamplingParams
    from server.engine import deltas as channel
    from server.wire.messages import Frame, Status, pack
    from server.wire.params import RequestOutputKind

    core = llm.engine
    dev = core.device
    core.set_async_scheduling(async_on)
    kind_arg = RequestOutputKind.FINAL_ONLY if kind == "final" else RequestOutputKind.CUMULATIVE
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=steps + 64, ignore_eos=True,
                            logprobs=logprobs, stop=stop, output_kind=kind_arg)
    outs: list = []
    core.wire_outputs(lambda req: outs.append(channel.encode_delta(req)))
    try:
        for i in range(batch // n):
            ids = [(100 + 7 * i + j) % 1000 + 16 for j in range(32)]
            core.add_request(f"w{batch}-{async_on}-{i}", prompt_token_ids=ids, params=params, on_output=outs.append)
        while any(r.first_token_time is None for r in core.requests.values()):
            core.step()
        for _ in range(3):  # into the steady state (with async on: a step in flight)
            core.step()
        outs.clear()
        status = Status(core.stats())
        ahead0 = core.steps_ahead
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
            pack(Frame(outs, status, [batch]))
            outs.clear()
        sync(dev)
        seconds = time.perf_counter() - t0
        ahead = core.steps_ahead - ahead0
    finally:
        core.abort_all()
        core.drain()
        core.wire_outputs(None)
        core.set_async_scheduling(False)
    return {"batch": batch, "kind": kind, "async": async_on, "ms_per_step": 1e3 * seconds / steps,
            "tok_s": batch * steps / seconds, "steps_ahead": ahead / steps}


def http_cost(folder: Path, device: str, concurrencies: list[int], tokens: int, temperature: float,
              kv: dict, async_on: bool = False) -> list[dict]:
    """The same decode through the real server: C requests at once (one prompt each, `tokens` new tokens,
    streamed and not), and each process's CPU time per output token: the API process (HTTP, the frames,
    the outputs, SSE/JSON) and the engine process (steps, deltas, pickling). CPU time, not wall: what a
    token costs each process whatever else the host runs."""
    import asyncio

    from bench.serve import run_http, workload
    from testkit.http_server import ServerProcess

    flags = [str(folder), "--device", device, "--load-format", "dummy", "--max-num-seqs", str(max(concurrencies)),
             "--max-model-len", "2048", "--log-level", "warning"] + (["--async-scheduling"] if async_on else ["--no-async-scheduling"])
    for k, v in kv.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    server = ServerProcess(flags).start()
    rows = []
    try:
        api_pid, engine_pid = server.proc.pid, server.engine_pid  # type: ignore[union-attr]
        served = "llm"
        import httpx

        served = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm = workload(2, 16, 4, 0.0, math.inf, 1000, seed=1)
        asyncio.run(run_http(server.url, "EMPTY", served, warm, True, temperature, 600))
        for c in concurrencies:
            reqs = workload(c, 32, tokens, 0.0, math.inf, 1000, seed=c)
            for stream in (False, True):
                a0, e0, t0 = cpu_seconds(api_pid), cpu_seconds(engine_pid), time.perf_counter()
                results, _ = asyncio.run(run_http(server.url, "EMPTY", served, reqs, stream, temperature, 1800))
                a1, e1, t1 = cpu_seconds(api_pid), cpu_seconds(engine_pid), time.perf_counter()
                errors = [r.error for r in results if r.error]
                if errors:
                    raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
                n = sum(r.output_tokens for r in results)
                chunks = sum(len(r.itl) + 1 for r in results) if stream else None  # content chunks received
                rows.append({"concurrency": c, "stream": stream, "async": async_on, "tokens": n,
                             "tok_s": n / (t1 - t0), "tokens_per_chunk": n / chunks if chunks else None,
                             "api_cpu_us_per_token": 1e6 * (a1 - a0) / n,
                             "engine_cpu_us_per_token": 1e6 * (e1 - e0) / n})
    finally:
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="default: llama-micro on CPU, llama-1b on CUDA")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--kinds", default="stream,final",
                    help="stream: an output every step (streaming requests); final: FINAL_ONLY (non-streaming "
                         "requests, LLM.generate)")
    ap.add_argument("--n", type=int, default=8, help="sequences per prompt (RL rollouts: n=8)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--logprobs", type=int, default=0, help="-1: none")
    ap.add_argument("--stop", default=None, help="a stop string every request carries (default: none)")
    ap.add_argument("--profile", action="store_true", help="print the engine step's hottest functions")
    ap.add_argument("--http", default="64,256", help="concurrencies for the pass through the real server "
                                                     "(CPU time per token of each process); 'none' skips it")
    ap.add_argument("--http-tokens", type=int, default=None, help="new tokens per request (default: 256 on CUDA, "
                                                                  "64 on CPU)")
    ap.add_argument("--async-scheduling", default="on",
                    help="off, on, or off,on: wall ms per step (and the --http pass) with each, side by side")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    async_modes = [{"off": False, "on": True}[m.strip()] for m in args.async_scheduling.split(",")]
    from server import LLM

    if args.device == "cpu":
        # One intra-op thread: on a shared, loaded host torch's thread team mostly waits for cores, and
        # the tensor ops here are small; the figure to read is the Python around them.
        torch.set_num_threads(1)
    model = args.model or ("llama-1b" if args.device == "cuda" else "llama-micro")
    folder = model_folder(model, Path(tempfile.mkdtemp()), max_position_embeddings=4096)
    batches = [] if args.batches == "none" else [int(b) for b in args.batches.split(",")]
    kv = {"kv_cache_memory": "512MiB"} if args.device == "cpu" else {}
    llm = LLM(model=str(folder), device=args.device, load_format="dummy", max_num_seqs=max(batches, default=8),
              max_model_len=2048, **kv)
    logprobs = None if args.logprobs < 0 else args.logprobs
    stop = [args.stop] if args.stop else None
    # On a thread, as the server drives the engine (bench/common.in_thread says why it matters on CPU).
    rows = [in_thread(measure, llm, b, kind, args.n, args.steps, args.temperature, args.top_p, logprobs, stop,
                      args.profile) for kind in args.kinds.split(",") for b in batches]
    py_rows = [in_thread(python_cost, llm, b, kind, args.n, min(args.steps, 40), logprobs, stop)
               for kind in args.kinds.split(",") + ["inproc"] for b in batches]
    wall_rows = [in_thread(step_wall, llm, b, kind, args.n, args.steps, args.temperature, args.top_p, logprobs, stop,
                           on) for kind in args.kinds.split(",") for b in batches for on in async_modes]
    llm.close()
    for r in rows:
        if "profile" in r:
            print(f"\n--- batch {r['batch']}, {r['kind']}: engine step, hottest functions (forward included) ---")
            print(r.pop("profile"))
    keys = ["step_ms", "forward_ms", "engine_host_ms", "frame_ms", "api_ms", "gc_ms", "host_us_per_seq", "frame_kib"]
    print(f"\nhost cost per decode step ({model}, {args.device}, temperature {args.temperature}, top_p {args.top_p}, "
          f"logprobs {logprobs}, n {args.n}, stop {stop})")
    print(table([[r["batch"], r["kind"]] + [f"{r[k]:.3f}" for k in keys] for r in rows], ["batch", "kind"] + keys))
    print("\nthe engine's Python alone per decode step (schedule_ahead + postprocess + frame; no model, no sampler; "
          "whole-character tokens; inproc: RequestOutputs per request and step, n 1), us per sequence")
    print(table([[r["batch"], r["kind"], f"{r['python_us_per_seq']:.2f}"] for r in py_rows],
                ["batch", "kind", "python_us_per_seq"]))
    forward = {(r["batch"], r["kind"]): r["forward_ms"] for r in rows}
    wall = {(r["batch"], r["kind"], r["async"]): r for r in wall_rows}
    print(f"\nwall time per decode step, async scheduling {' vs '.join(m.strip() for m in args.async_scheduling.split(','))}"
          " (step + frame, as the engine process; forward_ms: the forward alone, the floor with full overlap)")
    wrows = []
    for b, kind in dict.fromkeys((r["batch"], r["kind"]) for r in wall_rows):
        off, on = wall.get((b, kind, False)), wall.get((b, kind, True))
        wrows.append([b, kind, f"{forward[(b, kind)]:.3f}",
                      f"{off['ms_per_step']:.3f}" if off else "-", f"{on['ms_per_step']:.3f}" if on else "-",
                      f"{off['tok_s']:.0f}" if off else "-", f"{on['tok_s']:.0f}" if on else "-",
                      f"{off['ms_per_step'] / on['ms_per_step']:.2f}x" if off and on else "-",
                      f"{100 * on['steps_ahead']:.0f}%" if on else "-"])
    print(table(wrows, ["batch", "kind", "forward_ms", "off ms/step", "on ms/step", "off tok/s", "on tok/s",
                        "on speedup", "steps ahead"]))
    http_rows = []
    if args.http != "none":
        tokens = args.http_tokens or (256 if args.device == "cuda" else 64)
        for on in async_modes:
            http_rows += http_cost(folder, args.device, [int(c) for c in args.http.split(",")], tokens,
                                   args.temperature, kv, on)
        hkeys = ["tokens", "tok_s", "tokens_per_chunk", "api_cpu_us_per_token", "engine_cpu_us_per_token"]
        print(f"\nthrough the HTTP server ({tokens} new tokens per request, one prompt each, temperature "
              f"{args.temperature}): each process's CPU time per output token")
        print(table([[r["concurrency"], r["stream"], "on" if r["async"] else "off"] + [f"{r[k]:.1f}" if r[k] is not None else "-" for k in hkeys]
                     for r in http_rows], ["concurrency", "stream", "async"] + hkeys))
    if args.out is not None:
        write_json(args.out, "step_host_cost" + ("" if args.device == "cuda" else "-cpu"),
                   {"model": model, "device": args.device, "temperature": args.temperature, "top_p": args.top_p,
                    "logprobs": logprobs, "n": args.n, "stop": stop, "rows": rows, "python": py_rows, "wall": wall_rows,
                    "http": http_rows})


if __name__ == "__main__":
    main()
