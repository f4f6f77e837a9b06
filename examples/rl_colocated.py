"""A colocated RL loop: one trainer process and one sleepserve share a device.

Each iteration: rollouts through HTTP (prompts sent concurrently, n samples each), POST
/sleep?level=2 (the server gives its memory back), a REINFORCE step with a real optimizer on the
served model's architecture (Hugging Face transformers), /wake_up?tags=weights, the new weights
pushed over CUDA IPC (shared memory on CPU) with WeightSender, /wake_up?tags=kv_cache, and a check
that the server now serves the trainer's new weights. Prints per-phase times and both processes'
memory, and draws a timeline PNG. Exits 1 if a check fails.

The check is teacher-forced: the server decodes the check prompts greedily (returning its token ids
and their log-probs); the trainer's model, with the weights exactly as pushed (rounded to the served
dtype, computed in float32), scores the same tokens in one forward pass. Every server token must be
the trainer's best or within a margin of it, and its log-prob must match the trainer's, both within
`tolerance` x the standard deviation of the trainer's logits at that position. Comparing free-running
continuations instead fails for the wrong reason: in bf16 near-ties flip the argmax between two
kernels, and the texts diverge from there. The tolerance (--tolerance) is 1e-3 for a float32 server:
the two sides run the same arithmetic in different kernels, while one AdamW step at lr 1e-5 moves the
log-probs of the embedded model by 0.004-0.012 of that deviation (measured), so a server left on the
previous weights fails. For bf16 it is 0.5: transformers' own bf16 forward differs from float32 by up
to 0.08 deviations on the 1.24B shape with random weights (measured on CPU), and a token the trainer's
model did not pick is typically 4 deviations below its best. In bf16 the check catches weights that
did not arrive or arrived wrong, not a push one step stale: one step at lr 1e-5 moves most weights by
less than a bf16 unit in the last place. --skip-push is the check's own test: the server reloads the
checkpoint it started from instead of receiving the trainer's weights, and the run must fail.

    python examples/rl_colocated.py                       # CPU: the embedded 135M model, shm
    python examples/rl_colocated.py --skip-push           # must exit 1: the server keeps old weights
    python examples/rl_colocated.py --device cuda --model llama-1b --out gpu-results/rlloop
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from server.weight_transfer.rendezvous import free_port  # noqa: E402
from server.weight_transfer.sender import WeightSender  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "List three fruits.", "What is the capital of Italy?",
           "Describe a cat in one sentence.", "Give me a number between 1 and 10.", "Name a color.",
           "Say hello in French.", "What do bees make?"]
CHECK_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHECK_TOKENS = 16
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5}  # x the std of the trainer's logits (see above)
ADMIN = "rl-example-admin"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def gpu_mib_by_pid() -> dict[int, float]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        used[int(pid)] = float(mib)
    return used


class Server:
    def __init__(self, args, folder: str, dummy: bool):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        backend = "ipc" if args.device == "cuda" else "shm"
        cmd = [sys.executable, "-m", "server", "serve", folder, "--device", args.device, "--port", str(self.port),
               "--max-model-len", "1024", "--kv-cache-memory", args.kv_cache, "--log-level", "warning",
               "--dev-mode", "--admin-api-key", ADMIN, "--weight-transfer-config", json.dumps({"backend": backend})]
        if dummy:
            cmd += ["--load-format", "dummy"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.log = open(Path(args.out) / "server.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        import httpx
        self.http = httpx.Client(base_url=self.url, timeout=600)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited while starting; see {self.log.name}")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start in 600 s")
            time.sleep(0.5)
        # The engine process holds the model's memory (the API process holds no device memory).
        info = self.http.get("/server_info", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        self.engine_pid = int(info["processes"]["engine_pid"])

    def admin(self, path: str, **params) -> dict:
        r = self.http.post(path, params=params, json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        r.raise_for_status()
        return r.json()

    def complete(self, prompt: str, **kw) -> dict:
        r = self.http.post("/v1/completions", json={"prompt": prompt, **kw})
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="a model folder, or llama-1b / llama-8b (random weights)")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--kv-cache", default="256MiB")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="the check's tolerance in standard deviations of the trainer's logits (default: 1e-3 "
                         "for a float32 server, 0.5 for bf16)")
    ap.add_argument("--skip-push", action="store_true",
                    help="test the check: never push; the server reloads its own checkpoint instead, and the "
                         "run must fail")
    ap.add_argument("--out", default="rl-results")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dummy = args.model in ("llama-1b", "llama-8b", "llama-tiny")
    if dummy:
        from testkit.models import model_folder
        folder = str(model_folder(args.model, Path(args.out) / "models"))
    elif args.model:
        folder = args.model
    else:
        from server.model.source import resolve_model
        folder = str(resolve_model(None).folder)
    serve_dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[serve_dtype]

    events: list[dict] = []
    t_start = time.perf_counter()

    def phase(name: str, it: int, fn):
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        events.append({"iteration": it, "phase": name, "start": t0 - t_start, "seconds": t1 - t0, **memory()})
        print(f"  iter {it} {name:<16} {t1 - t0:7.2f} s   trainer {events[-1]['trainer_mib']:8.0f} MiB   "
              f"server {events[-1]['server_mib']:8.0f} MiB", flush=True)
        return result

    server = Server(args, folder, dummy)

    def memory() -> dict:
        if device.type == "cuda":
            used = gpu_mib_by_pid()
            return {"trainer_mib": used.get(os.getpid(), torch.cuda.memory_reserved() / 2**20),
                    "server_mib": used.get(server.engine_pid, float("nan")), "unit": "device"}
        return {"trainer_mib": rss_mib(os.getpid()), "server_mib": rss_mib(server.engine_pid), "unit": "rss"}

    tok = AutoTokenizer.from_pretrained(folder)
    if dummy:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sender = WeightSender(server.url, backend="ipc" if device.type == "cuda" else "shm", api_key=ADMIN,
                          device=device, bucket_bytes=512 << 20)
    sender.init()

    def push(version: str) -> dict:
        if args.skip_push:  # the check's own test: the server reloads the checkpoint it started from
            server.admin("/update_weights")
            return {"bytes": 0, "gb_per_s": 0.0}
        named = [(n, p.detach().to(serve_dtype)) for n, p in model.named_parameters()]
        return sender.send(named, weight_version=version)

    def served_check() -> bool:
        """Teacher-forced (see the module's docstring): the trainer's model, with the weights as pushed,
        scores the server's greedy tokens; each must be within `tolerance` deviations of its best logit,
        with a log-prob within `tolerance` deviations of the trainer's."""
        ref = copy.deepcopy(model).eval()
        with torch.no_grad():
            for p in ref.parameters():  # exactly the values the server received, computed in float32
                p.copy_(p.to(serve_dtype).float())
        ok, exact, total, worst_margin, worst_lp = True, 0, 0, 0.0, 0.0
        for prompt in CHECK_PROMPTS:
            choice = server.complete(prompt, max_tokens=CHECK_TOKENS, temperature=0, ignore_eos=True, logprobs=0,
                                     return_token_ids=True)["choices"][0]
            prompt_ids, ids = choice["prompt_token_ids"], choice["token_ids"]
            served_lp = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
            with torch.no_grad():
                logits = ref(torch.tensor([prompt_ids + ids], device=device)).logits[0, len(prompt_ids) - 1:-1]
            logits = logits.double().cpu()
            tok = torch.tensor(ids)
            sigma = logits.std(-1)
            picked = logits.gather(-1, tok[:, None])[:, 0]
            margin = (logits.max(-1).values - picked) / sigma
            lp_gap = (logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0] - served_lp).abs() / sigma
            exact += int((logits.argmax(-1) == tok).sum())
            total += len(ids)
            m, g = float(margin.max()), float(lp_gap.max())
            worst_margin, worst_lp = max(worst_margin, m), max(worst_lp, g)
            if not (m <= tolerance and g <= tolerance):  # NaN fails too
                ok = False
                print(f"    {prompt!r}: the server's tokens are not the trainer's model's (worst margin {m:.3g}, "
                      f"worst log-prob gap {g:.3g} deviations)")
        print(f"    check: {exact}/{total} server tokens are the trainer's argmax; worst margin {worst_margin:.2g}, "
              f"worst log-prob gap {worst_lp:.2g} (in std of the trainer's logits; tolerance {tolerance:g})")
        del ref
        return ok

    results = {"device": args.device, "model": args.model or "embedded", "iterations": [], "checks": []}
    if dummy:  # the server's random weights are not the trainer's: start from the trainer's
        server.admin("/sleep", level=2)
        phase("wake_weights", 0, lambda: server.admin("/wake_up", tags="weights"))
        phase("push", 0, lambda: push("init"))
        phase("wake_kv_cache", 0, lambda: server.admin("/wake_up", tags="kv_cache"))

    prompts = PROMPTS[:args.prompts]
    for it in range(1, args.iterations + 1):
        def rollouts():
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(lambda p: server.complete(p, n=args.n, max_tokens=args.max_tokens,
                                                               temperature=1.0, seed=it), prompts))
        outs = phase("rollouts", it, rollouts)
        phase("sleep_level2", it, lambda: server.admin("/sleep", level=2))

        def train_step() -> float:
            # REINFORCE with a group baseline; the reward prefers short, vowel-rich answers (any reward would do).
            loss_total = 0.0
            opt.zero_grad()
            for prompt, out in zip(prompts, outs):
                texts = [c["text"] for c in out["choices"]]
                rewards = torch.tensor([sum(ch in "aeiou" for ch in t) / (1 + len(t)) - len(t) / 400 for t in texts])
                adv = rewards - rewards.mean()
                p_ids = tok(prompt).input_ids
                for text, a in zip(texts, adv):
                    ids = torch.tensor([p_ids + tok(text, add_special_tokens=False).input_ids], device=device)
                    if ids.shape[1] <= len(p_ids):
                        continue
                    logits = model(ids).logits[0, len(p_ids) - 1:-1].float()
                    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p_ids):, None]).mean()
                    loss = -a.to(device) * logp / (len(prompts) * args.n)
                    loss.backward()
                    loss_total += loss.item()
            opt.step()
            return loss_total
        loss = phase("train_step", it, train_step)
        phase("wake_weights", it, lambda: server.admin("/wake_up", tags="weights"))
        report = phase("push", it, lambda: push(f"step-{it}"))
        phase("wake_kv_cache", it, lambda: server.admin("/wake_up", tags="kv_cache"))
        same = phase("served_check", it, served_check)
        results["iterations"].append({"iteration": it, "loss": loss, "push_gb_per_s": report["gb_per_s"],
                                      "push_bytes": report["bytes"], "serves_trainer_weights": same})
        results["checks"].append(same)
        print(f"iter {it}: loss {loss:+.4f}, pushed {report['bytes'] / 2**30:.2f} GiB at {report['gb_per_s']:.2f} GB/s, "
              f"server serves the trainer's weights: {same}", flush=True)

    sender.close()
    server.stop()
    results["events"] = events
    (Path(args.out) / "rl_colocated.json").write_text(json.dumps(results, indent=2))
    draw(events, Path(args.out) / "rl_colocated_timeline.png", results)
    print(f"wrote {args.out}/rl_colocated.json and rl_colocated_timeline.png")
    if not all(results["checks"]):
        print(f"FAILED: the server did not serve the trainer's weights in {results['checks'].count(False)} of "
              f"{len(results['checks'])} iterations")
        return 1
    return 0


def draw(events: list[dict], path: Path, results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rollouts": "tab:blue", "sleep_level2": "tab:gray", "train_step": "tab:red", "wake_weights": "tab:olive",
              "push": "tab:green", "wake_kv_cache": "tab:cyan", "served_check": "tab:purple"}
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    for e in events:
        ax.barh(0, e["seconds"], left=e["start"], color=colors.get(e["phase"], "black"), edgecolor="white")
    ax.set_yticks([])
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
              ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 1.6))
    ends = [e["start"] + e["seconds"] for e in events]
    unit = events[0]["unit"] if events else "rss"
    mem.step(ends, [e["trainer_mib"] / 1024 for e in events], where="pre", label="trainer")
    mem.step(ends, [e["server_mib"] / 1024 for e in events], where="pre", label="server")
    mem.set_ylabel(f"GiB ({'device memory' if unit == 'device' else 'resident memory'})")
    mem.set_xlabel("seconds")
    mem.legend()
    fig.suptitle(f"colocated RL loop on {results['device']} ({results['model']})", y=0.99)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
