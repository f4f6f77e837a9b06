"""An RL rollout as GRPO trainers run it: P prompts x n samples (256 x 8 by default), 512 new tokens each,
temperature 1, sent as TRL's VLLMClient sends them (one batched POST /v1/completions with token-id
prompts, n, logprobs=0, return_token_ids), then the same rollout through the in-process engine, then
transformers' batched `generate` on a slice of the same prompts (in its own process: it cannot share
the device with an engine that took 0.9 of its memory).

Each is compared with a roofline of the steps the in-process engine really took: per step, the larger
of (weights + KV read) / measured memory bandwidth and FLOPs / measured dense-matmul throughput
(bench/roofline.py), summed over the run.

    python bench/rollout.py --device cpu --model llama-tiny --smoke
    python bench/rollout.py --device cuda --model llama-1b --out $OUT
    python bench/rollout.py --device cuda --model llama-8b --out $OUT
    python bench/rollout.py --device cuda --model llama-1b --async-scheduling both --no-hf --out $OUT
    python bench/rollout.py --device cuda --model qwen3-30b-a3b --out $OUT      # mixture of experts (61 GB)

With --async-scheduling both, the server runs twice (without and with --async-scheduling) and the
in-process engine runs the rollout twice (switched between runs), printed side by side.

Outputs are forced to their full length (ignore_eos, as TRL's generation_kwargs allow) so every run
generates the same number of tokens from random weights.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import hardware, in_thread, now_iso, server_steps, table, write_json  # noqa: E402
from bench.roofline import Device, ModelCost, StepRecorder  # noqa: E402

SHAPES = ("llama-micro", "llama-tiny", "llama-1b", "llama-8b")  # micro: the host's work alone, on CPU
MOE_SHAPES = ("qwen3-moe-tiny", "qwen3-30b-a3b")  # Qwen3-MoE (testkit/models.py MOE_CONFIGS)


def make_prompts(num: int, length: int, range_ratio: float, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo, hi = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
    return [rng.integers(min(1000, vocab // 2), min(vocab, 40000), size=int(n)).tolist() for n in rng.integers(lo, hi + 1, size=num)]


def trl_payload(model: str, prompts: list[list[int]], n: int, max_tokens: int, temperature: float) -> dict:
    """What trl.generation.vllm_client.VLLMClient.generate posts (its defaults), plus ignore_eos."""
    return {"model": model, "prompt": prompts, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "n": n, "repetition_penalty": 1.0, "temperature": temperature, "top_p": 1.0, "top_k": 0,
            "min_p": 0.0, "max_tokens": max_tokens, "logprobs": 0, "ignore_eos": True}


class EngineSteps:
    """Polls the server's engine step count (bench.common.server_steps: /metrics) every `every` seconds on a
    thread while a rollout runs, so the run's time splits into before the engine's first step, its steps, and
    after its last (the response's encoding, transfer and decoding). Each poll is a call on the engine thread
    (its stats): 5 a second against ~300 steps a second. A poll that fails (the API busy encoding a large
    body past the timeout) is skipped. trace_after: once the engine has run that many steps, trace the
    next TIMELINE_STEPS and more (to a poll: ~60 at 300 steps a second) with the server's /start_profile and
    /stop_profile (the server started with VLLM_TORCH_PROFILER_DIR), the report kept in `trace`; the
    trace's own cost (slower steps, seconds of writing on the engine thread) is then in the run's time."""

    def __init__(self, url: str, api_key: str, every: float = 0.2, trace_after: int | None = None):
        import threading

        self.url, self.api_key = url, api_key
        self.first: float | None = None
        self.last: float | None = None
        self.trace_after = trace_after
        self.trace: dict | None = None
        self._traced_from: int | None = None
        self.samples: list[tuple[float, int]] = []  # (seconds, steps run) at each poll that saw new steps
        self._start = server_steps(url, api_key)
        self._done = threading.Event()
        self.t0 = time.perf_counter()  # after the first poll: the rollout's clock starts here
        self._thread = threading.Thread(target=self._poll, args=(every,), daemon=True)
        self._thread.start()

    def _poll(self, every: float) -> None:
        seen = self._start
        while not self._done.wait(every):
            steps = server_steps(self.url, self.api_key)
            if steps is not None and steps != seen:
                now = time.perf_counter() - self.t0
                self.first = now if self.first is None else self.first
                self.last, seen = now, steps
                if self._start is not None:
                    self.samples.append((round(now, 3), steps - self._start))
                if self.trace_after is not None and self._start is not None:
                    self._trace(steps - self._start)

    def _trace(self, done: int) -> None:
        import httpx

        try:
            if self._traced_from is None and done >= self.trace_after:  # type: ignore[operator]
                self._profile("/start_profile")
                self._traced_from = done
            elif self._traced_from is not None and self.trace is None and done - self._traced_from >= TIMELINE_STEPS:
                self.trace = {**self._profile("/stop_profile"), "steps": done - self._traced_from}
        except httpx.HTTPError as e:  # the trace is lost, not the run's time split
            print(f"  engine trace failed: {e!r}", flush=True)
            self.trace_after = None

    def _profile(self, route: str) -> dict:
        import httpx

        r = httpx.post(self.url + route, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=300)
        r.raise_for_status()
        return r.json()

    def close(self) -> dict:
        self._done.set()
        self._thread.join()
        if self._traced_from is not None and self.trace is None and self.trace_after is not None:
            self.trace = {**self._profile("/stop_profile"), "steps": None}  # the run ended first
        return {"first_step_s": self.first, "last_step_s": self.last, "step_samples": self.samples,
                **({"engine_trace": self.trace} if self.trace is not None else {})}


class StepSampler:
    """The in-process engine's steps (count()) every `every` seconds on a thread, as EngineSteps samples the
    server's: where the two runs' steps part (a wave's end, its admission) shows in their samples."""

    def __init__(self, count, every: float = 0.2):
        import threading

        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()
        t0, start = time.perf_counter(), count()

        def poll() -> None:
            while not self._done.wait(every):
                self.samples.append((round(time.perf_counter() - t0, 3), count() - start))

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def close(self) -> list[tuple[float, int]]:
        self._done.set()
        self._thread.join()
        return self.samples


def wave_seconds(samples: list[tuple[float, int]], every: int = 512) -> list[float]:
    """Seconds each `every` steps took (a rollout's wave of max-num-seqs sequences is ~max_tokens steps),
    interpolated between the samples."""
    import numpy as np

    if len(samples) < 2:
        return []
    t, n = np.array([s[0] for s in samples]), np.array([s[1] for s in samples], dtype=float)
    marks = np.interp(np.arange(0, n[-1] + 1, every), n, t)
    return [round(float(b - a), 3) for a, b in zip(marks[:-1], marks[1:])]


def http_rollout(url: str, api_key: str, model: str, prompts: list[list[int]], n: int, max_tokens: int,
                 temperature: float, requests: int = 1, timeout: float = 3600.0, trace_after: int | None = None) -> dict:
    """The prompts in `requests` batched POSTs at once (1: TRL's main process sends them all in one). Besides
    the total: when the engine stepped first and last (EngineSteps, to 0.2 s), when the last body had arrived,
    and the seconds the client spent decoding the JSON bodies."""
    import asyncio

    import httpx

    parts = [prompts[i::requests] for i in range(requests)]
    received, decoding = [], []

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                     headers={"Authorization": f"Bearer {api_key}"}) as c:
            async def post(part):
                r = await c.post("/v1/completions", json=trl_payload(model, part, n, max_tokens, temperature))
                if r.status_code != 200:
                    raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:300]}")
                received.append(time.perf_counter())
                body = r.json()
                decoding.append(time.perf_counter() - received[-1])
                return body
            return await asyncio.gather(*(post(p) for p in parts if p))

    steps = EngineSteps(url, api_key, trace_after=trace_after)
    t = steps.t0
    try:
        bodies = asyncio.run(run())
    finally:
        split = steps.close()
    seconds = time.perf_counter() - t
    split.update(body_received_s=max(received) - t, client_decode_s=sum(decoding))
    choices = [ch for b in bodies for ch in b["choices"]]
    tokens = sum(len(ch["token_ids"]) for ch in choices)
    assert len(choices) == len(prompts) * n, f"{len(choices)} choices for {len(prompts)} prompts x n={n}"
    assert all(len(ch["logprobs"]["token_logprobs"]) == len(ch["token_ids"]) for ch in choices)
    return {"seconds": seconds, "sequences": len(choices), "tokens": tokens, "tok_s": tokens / seconds, **split}


def engine_rollout(llm, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                   profile: bool = False, timeline: Path | None = None) -> dict:
    """The rollout through LLM.generate on this thread (the engine's). profile: cProfile's hottest functions
    of this thread, printed. (Its CPU time says little: CUDA's waits spin, so waiting counts as busy.)
    timeline: a folder for torch.profiler's trace of TIMELINE_STEPS steps mid-rollout, with the device's
    busy share of their span printed (the gaps say how much of a step the device waits for the host)."""
    from server import SamplingParams

    params = SamplingParams(n=n, temperature=temperature, top_p=1.0, max_tokens=max_tokens, logprobs=0,
                            ignore_eos=True)
    profiler = cProfile.Profile() if profile else None
    stop_timeline = record_timeline(llm.engine, timeline) if timeline is not None else None
    t = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    try:
        outs = llm.generate(prompts, params)
    finally:
        if stop_timeline is not None:
            stop_timeline()
    seconds = time.perf_counter() - t
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    seqs = [o for out in outs for o in out.outputs]
    tokens = sum(len(o.token_ids) for o in seqs)
    assert all(len(o.logprobs) == len(o.token_ids) for o in seqs)
    return {"seconds": seconds, "sequences": len(seqs), "tokens": tokens, "tok_s": tokens / seconds}


TIMELINE_SKIP, TIMELINE_STEPS = 300, 20  # steps before the trace (admission, compiles), steps traced


def record_timeline(core, folder: Path):
    """Trace TIMELINE_STEPS of the engine's steps after TIMELINE_SKIP with torch.profiler (CPU and CUDA):
    write the Chrome trace into `folder`, print the device's busy share of the traced span and the kernels
    that took the most device time. Returns the function that stops it (and restores core.step)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=TIMELINE_SKIP, warmup=3, active=TIMELINE_STEPS,
                                                            repeat=1), on_trace_ready=lambda p: report_timeline(p, folder))
    step = core.step

    def traced_step():
        out = step()
        prof.step()
        return out

    prof.start()
    core.step = traced_step

    def stop() -> None:
        del core.step
        prof.stop()

    return stop


def report_timeline(prof, folder: Path) -> None:
    from server.engine.step_profiler import device_busy, write_trace

    folder.mkdir(parents=True, exist_ok=True)
    trace = write_trace(prof, folder / "rollout-timeline.json")
    busy, span = device_busy(prof.events())
    if not span:
        print("timeline: no device events (CPU run)", flush=True)
        return
    print(f"timeline: {TIMELINE_STEPS} steps, device busy {busy / 1e3:.2f} of {span / 1e3:.2f} ms "
          f"({100 * busy / span:.0f}%); trace: {trace}", flush=True)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=12), flush=True)


def hf_rollout(folder: str, device: str, prompts: list[list[int]], n: int, max_tokens: int,
               temperature: float, batch: int, seed: int) -> dict:
    """transformers' generate, `batch` prompts (x n samples) per call, left-padded, random weights of the
    same shape (the values do not change the time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = torch.device(device)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(folder)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()

    def generate(part: list[list[int]], new: int) -> None:
        width = max(map(len, part))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in part], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part], device=dev)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                           num_return_sequences=n, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    generate(prompts[:min(batch, 2)], 2)  # warm-up
    part = prompts[:batch]
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    generate(part, max_tokens)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    tokens = len(part) * n * max_tokens
    return {"seconds": seconds, "sequences": len(part) * n, "tokens": tokens, "tok_s": tokens / seconds}


def hf_in_subprocess(args, folder: str, prompts: list[list[int]]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"folder": folder, "device": args.device, "prompts": prompts, "n": args.n,
                                   "max_tokens": args.max_tokens, "temperature": args.temperature,
                                   "batch": args.hf_prompts, "seed": args.seed}))
        subprocess.run([sys.executable, __file__, "--hf-job", str(job)], check=True)
        return json.loads(job.with_suffix(".out.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None,
                    help=f"{', '.join(SHAPES + MOE_SHAPES)} (random weights) or a model folder")
    ap.add_argument("--prompts", type=int, default=None, help="default 256 (smoke: 4)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt, default 8 (smoke: 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 512 (smoke: 8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="mean prompt tokens, default 128 (smoke: 16)")
    ap.add_argument("--range-ratio", type=float, default=0.25)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=1, help="split the prompts over this many concurrent POSTs")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default=None)
    ap.add_argument("--hf-prompts", type=int, default=None,
                    help="prompts (x n) per transformers generate call; default 32 (smoke: all)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-http", action="store_true", help="the in-process engine only")
    ap.add_argument("--profile", action="store_true",
                    help="print cProfile's hottest functions of the in-process rollout's engine thread")
    ap.add_argument("--timeline", action="store_true",
                    help="torch.profiler's trace of ~20 steps mid-rollout into --out, with the device's busy share "
                         "of their span: in process, and in the server's engine process (its /start_profile and "
                         "/stop_profile, VLLM_TORCH_PROFILER_DIR=--out/engine-traces)")
    ap.add_argument("--async-scheduling", default="on", choices=["off", "on", "both"],
                    help="run the server and the engine with async scheduling off, on, or both (side by side)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--hf-job", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_job is not None:  # the transformers reference, in its own process
        job = json.loads(args.hf_job.read_text())
        res = hf_rollout(**job)
        args.hf_job.with_suffix(".out.json").write_text(json.dumps(res))
        return

    smoke = args.smoke
    args.prompts = args.prompts or (4 if smoke else 256)
    args.n = args.n or (2 if smoke else 8)
    args.max_tokens = args.max_tokens or (8 if smoke else 512)
    args.prompt_len = args.prompt_len or (16 if smoke else 128)
    args.hf_prompts = args.hf_prompts or (args.prompts if smoke else 32)
    cuda = args.device == "cuda"
    name = args.model or ("llama-1b" if cuda else "llama-tiny")
    if name in SHAPES + MOE_SHAPES:
        from testkit.models import shape_folder

        folder = str(shape_folder(name, Path(tempfile.mkdtemp())))
        load = ["--load-format", "dummy"]
    else:
        folder, load = name, []
    kv = args.kv_cache_memory or (None if cuda else "512MiB")
    flags = [folder, "--device", args.device, *load, "--max-num-seqs", str(args.max_num_seqs),
             "--max-model-len", str(args.max_model_len), *(["--kv-cache-memory", kv] if kv else [])]

    from server.model.config import ModelConfig

    vocab = ModelConfig.from_folder(Path(folder)).vocab_size
    prompts = make_prompts(args.prompts, args.prompt_len, args.range_ratio, vocab, args.seed)
    result: dict = {"date": now_iso(), "model": name, "device": args.device, "prompts": args.prompts, "n": args.n,
                    "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "temperature": args.temperature,
                    "requests": args.requests, "engine_flags": flags[1:]}

    # transformers first, then the server, then the in-process engine: each has the device alone.
    if not args.no_hf:
        result["hf"] = hf_in_subprocess(args, folder, prompts)
        result["hf"]["prompts_per_call"] = args.hf_prompts
        progress("transformers", result["hf"])
    from server.config import PROFILER_DIR_ENV
    from testkit.http_server import ServerProcess

    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    for on in modes if not args.no_http else ():
        key = "http_async" if on else "http"
        env = {PROFILER_DIR_ENV: str(args.out.resolve() / "engine-traces")} if args.timeline else None
        server = ServerProcess([*flags, "--log-level", "warning", *(["--async-scheduling"] if on else ["--no-async-scheduling"])],
                               env=env).start()
        try:
            import httpx

            served = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            http_rollout(server.url, "EMPTY", served, prompts[:2], 1, 4, args.temperature)  # warm-up
            result[key] = http_rollout(server.url, "EMPTY", served, prompts, args.n, args.max_tokens,
                                       args.temperature, args.requests,
                                       trace_after=TIMELINE_SKIP if args.timeline else None)
            progress("HTTP" + (" async" if on else ""), result[key])
        finally:
            server.stop()
        stalls = [line for line in server.log_text().splitlines() if ("engine step" in line and "took" in line)
                  or "did not read its channel" in line or "event loop was blocked" in line]
        result[key]["server_stall_warnings"] = stalls
        for line in stalls:
            print("  server:", line.strip(), flush=True)

    from server import LLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    measured = Device.measure(device, dtype)  # before the engine takes the device's memory
    llm = LLM(model=folder, device=args.device, load_format="dummy" if load else "auto",
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kv_cache_memory=kv)
    cost = ModelCost.of(llm.engine.model)
    roofs: dict[str, tuple[float, list]] = {}
    for on in modes:
        key = "engine_async" if on else "engine"
        llm.engine.set_async_scheduling(on)
        in_thread(engine_rollout, llm, prompts[:2], 1, 4, args.temperature)  # warm-up
        recorder = StepRecorder(llm.engine)
        sampler = StepSampler(lambda: len(recorder.steps))
        result[key] = in_thread(engine_rollout, llm, prompts, args.n, args.max_tokens, args.temperature, args.profile,
                                args.out if args.timeline else None)
        result[key]["step_samples"] = sampler.close()
        recorder.close()
        progress("in-process" + (" async" if on else ""), result[key])
        roofs[key] = (recorder.roofline_seconds(cost, measured), recorder.steps)
    result["hardware"] = hardware(device)
    llm.close()

    # The roofline of the steps the (first) engine run took; each run against its own steps too.
    first = "engine" if "engine" in roofs else "engine_async"
    roof_s, steps = roofs[first]
    result["roofline"] = {"seconds": roof_s, "tok_s": result[first]["tokens"] / roof_s, "steps": len(steps),
                          "memory_bandwidth_GBs": measured.bandwidth / 1e9, "matmul_TFLOPs": measured.gemm_flops / 1e12,
                          "weight_bytes": cost.weight_bytes, "expert_bytes": cost.expert_bytes,
                          "kv_bytes_per_token": cost.kv_bytes_per_token,
                          "largest_batch": max((shape.seqs for shape in steps), default=0)}
    for key in ("http", "engine", "http_async", "engine_async"):
        if key not in result:
            continue
        result[key]["fraction_of_roofline"] = roof_s / result[key]["seconds"]
        if "hf" in result:
            result[key]["x_vs_hf"] = result[key]["tok_s"] / result["hf"]["tok_s"]
    for suffix in ("", "_async"):
        if "http" + suffix in result and "engine" + suffix in result:
            result["http" + suffix]["http_over_engine"] = result["http" + suffix]["tok_s"] / result["engine" + suffix]["tok_s"]
    if "engine_async" in roofs:
        own_s, own_steps = roofs["engine_async"]
        result["engine_async"]["own_roofline_fraction"] = own_s / result["engine_async"]["seconds"]
        result["engine_async"]["steps"] = len(own_steps)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out, f"rollout-{name}-{args.device}", result)
    plot(result, args.out / f"rollout-{name}-{args.device}.png")
    report(result)


def progress(path: str, res: dict) -> None:
    """One line per finished path: a run cut short by a time limit still leaves its figures."""
    print(f"{path}: {res['sequences']} sequences in {res['seconds']:.2f} s, {res['tok_s']:.0f} tok/s", flush=True)
    if res.get("step_samples"):
        print(f"  seconds per 512 engine steps: {wave_seconds(res['step_samples'])}", flush=True)
    if "body_received_s" in res:
        first, last = res["first_step_s"], res["last_step_s"]
        print(f"  engine steps from {first if first is not None else float('nan'):.2f} s to "
              f"{last if last is not None else float('nan'):.2f} s (to 0.2 s), last body received at "
              f"{res['body_received_s']:.2f} s, client JSON decoding {res['client_decode_s']:.2f} s", flush=True)
    trace = res.get("engine_trace")
    if trace is not None:
        share = trace.get("device_busy_share")
        print(f"  engine process traced over {trace['steps'] or 'the last'} steps ({trace['seconds']:.2f} s): device busy "
              f"{'-' if share is None else f'{100 * share:.0f}%'}; trace: {trace['trace']}", flush=True)


def report(r: dict) -> None:
    roof = r["roofline"]
    print(f"\nrollout ({r['model']}, {r['device']}, {r['prompts']} prompts x n={r['n']}, {r['max_tokens']} new tokens, "
          f"temperature {r['temperature']}, {r['date']})")
    rows = []
    http_label = f"HTTP /v1/completions ({r['requests']} request(s), as TRL)"
    for key, label in (("http", http_label), ("http_async", http_label + ", async scheduling"),
                       ("engine", "in-process engine"), ("engine_async", "in-process engine, async scheduling"),
                       ("hf", "transformers generate")):
        if key in r:
            x = r[key]
            rows.append([label, x["sequences"], f"{x['seconds']:.2f}", f"{x['tok_s']:.0f}",
                         f"{100 * x['fraction_of_roofline']:.0f}%" if "fraction_of_roofline" in x else "-",
                         f"{x['x_vs_hf']:.1f}x" if "x_vs_hf" in x else "-"])
    rows.append(["roofline (steps the engine took)", "", f"{roof['seconds']:.2f}", f"{roof['tok_s']:.0f}", "100%", ""])
    share, speedup = ("40%", "20x") if r["model"] in MOE_SHAPES else ("50%", "10x")  # the issues' targets
    print(table(rows, ["path", "sequences", "seconds", "tok/s", f"of roofline (target >= {share})",
                       f"vs transformers (target >= {speedup})"]))
    print(f"roofline: {roof['steps']} steps (largest batch {roof['largest_batch']}), memory "
          f"{roof['memory_bandwidth_GBs']:.0f} GB/s, matmul {roof['matmul_TFLOPs']:.1f} TFLOP/s, weights "
          f"{roof['weight_bytes'] / 1e9:.2f} GB"
          + (f" (experts {roof['expert_bytes'] / 1e9:.2f} GB: read as uniform routing picks them)"
             if roof.get("expert_bytes") else "") + f", KV {roof['kv_bytes_per_token'] / 1024:.0f} KiB/token; " +
          "; ".join(f"HTTP / in-process{' (async)' if s else ''} {r['http' + s]['http_over_engine']:.2f}"
                    for s in ("", "_async") if "http_over_engine" in r.get("http" + s, {})))
    for path in ("http", "engine"):
        if path in r and path + "_async" in r:
            print(f"async scheduling on / off, {path}: {r[path + '_async']['tok_s'] / r[path]['tok_s']:.2f}x "
                  f"({r[path]['tok_s']:.0f} -> {r[path + '_async']['tok_s']:.0f} tok/s)")


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("http", "http_async", "engine", "engine_async", "hf") if k in r]
    labels = {"http": "HTTP (TRL batch)", "http_async": "HTTP, async", "engine": "in-process",
              "engine_async": "in-process, async", "hf": "transformers"}
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([labels[k] for k in keys], [r[k]["tok_s"] for k in keys], color=["C0", "C3", "C1", "C4", "C2"][:len(keys)])
    ax.axhline(r["roofline"]["tok_s"], color="k", ls="--", lw=1, label="roofline of the engine's steps")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"rollout {r['prompts']}x{r['n']}, {r['max_tokens']} tokens: {r['model']} on "
                 f"{r['hardware'].split(',')[0]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
