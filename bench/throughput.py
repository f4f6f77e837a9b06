"""Decode throughput of sleepserve against Hugging Face transformers' generate, same model, same run.

CPU (default): the embedded SmolLM2-135M in fp32, 1 and 8 concurrent requests, against generate at
batch 1. CUDA: a ~1.2B bf16 Llama with random weights at batch 1, 8, 64 and 256, against generate at the
same batch sizes (up to --hf-max-batch) and against the HBM roofline (weight bytes / device copy bandwidth,
measured now); then the in-process ratio of 256 to 64 sequences at once (issue 15's workload: ~32-token
prompts, 256 new tokens, greedy, end to end).

--outputs says how the engine hands out its outputs: `final`, through LLM.generate (the in-process API:
one output per request at its end, as vLLM's LLM.generate); `every-step`, EngineCore.step() with an output
for every request at every step (what an in-process caller that reads along gets: RequestOutputs with the
whole so far, copied every step); `both`. Each batch runs --repeat times and keeps the median run.
--async-scheduling both runs every batch twice on the same engine, without and with async scheduling
(step t+1 launched before step t's tokens reach the host), so the roofline fraction of each is printed.

    python bench/throughput.py --device cpu
    python bench/throughput.py --device cuda --model llama-1b --out $OUT
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.common import copy_bandwidth, hardware, now_iso, sync, table, timed, write_json
from testkit.models import model_folder

PROMPT_LEN = 32


def prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Avoid the first ids (special tokens) so prompts look like ordinary text to the tokenizer.
    return torch.randint(1000, min(vocab, 40000), (batch, PROMPT_LEN), generator=g).tolist()


def engine_decode_rate(llm, batch: int, new_tokens: int, device: torch.device, outputs: str = "final") -> dict:
    """Tokens/s of the decode phase (first token of every request out → all done), and end to end.
    outputs: "final" runs LLM.generate; "every-step" steps the engine with an output per request per step."""
    from server import SamplingParams

    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    batch_prompts = prompts(batch, core.model_config.vocab_size, batch)
    if outputs == "final":
        t_start = time.monotonic()
        outs = llm.generate(batch_prompts, params)
        t_end = time.monotonic()  # its outputs are on the host: nothing of it is left on the device
        t_first = max(o.metrics.first_token_time for o in outs)  # the engine's time.monotonic()
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    else:
        ids = [f"bench-{batch}-{i}" for i in range(batch)]
        t_start = time.monotonic()
        for rid, p in zip(ids, batch_prompts):
            core.add_request(rid, prompt_token_ids=p, params=params)
        reqs = [core.requests[r] for r in ids]
        while any(r.first_token_time is None for r in reqs):
            core.step()
        t_first = max(r.first_token_time for r in reqs)
        while core.has_unfinished:
            core.step()
        sync(device)
        t_end = time.monotonic()
    return {"decode_tok_s": batch * (new_tokens - 1) / (t_end - t_first),
            "e2e_tok_s": batch * new_tokens / (t_end - t_start)}


def median_rate(llm, batch: int, new_tokens: int, device: torch.device, outputs: str, repeat: int) -> dict:
    """engine_decode_rate's median run by decode tok/s (the in-process engine moves by up to ~10% run to run)."""
    runs = sorted((engine_decode_rate(llm, batch, new_tokens, device, outputs) for _ in range(repeat)),
                  key=lambda r: r["decode_tok_s"])
    return runs[len(runs) // 2]


def hf_decode_rate(model, batch: int, new_tokens: int, vocab: int, device: torch.device) -> dict:
    ids = torch.tensor(prompts(batch, vocab, batch), device=device)
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        t_prefill = timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), device)
        t_full = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw),
                       device)
    return {"decode_tok_s": batch * (new_tokens - 1) / max(t_full - t_prefill, 1e-9),
            "e2e_tok_s": batch * new_tokens / t_full}


def load_hf(folder: Path, dtype: torch.dtype, device: torch.device, our_model=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if our_model is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    # Dummy weights: the same values as ours, copied by name, so both run the very same model.
    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {n: p for n, p in our_model.named_parameters()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    return model.eval()


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = [r["batch"] for r in rows]
    x = range(len(batches))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], [r["sleepserve_tok_s"] for r in rows], 0.4, label="sleepserve")
    ax.bar([i + 0.2 for i in x], [r["hf_tok_s"] for r in rows if r["hf_tok_s"] is not None] +
           [0] * sum(r["hf_tok_s"] is None for r in rows), 0.4, label="transformers generate")
    if result.get("roofline_tok_s_batch1"):
        ax.axhline(result["roofline_tok_s_batch1"], color="k", ls="--", lw=1, label="HBM roofline, batch 1")
    ax.set_xticks(list(x), [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{result['model']} on {result['hardware'].split(',')[0]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="llama-1b / llama-8b (dummy weights) or a folder; "
                                                  "default: the embedded SmolLM2 on CPU, llama-1b on CUDA")
    ap.add_argument("--batches", default=None, help="comma-separated; default 1,8 (CPU) or 1,8,64,256 (CUDA)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--async-scheduling", default="on", choices=["off", "on", "both"])
    ap.add_argument("--outputs", default="final", choices=["final", "every-step", "both"],
                    help="final: LLM.generate; every-step: an output per request per step (the module's docstring)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per batch, the median kept (default 3 on CUDA)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--hf-max-batch", type=int, default=64, help="transformers' generate up to this batch")
    ap.add_argument("--small-gemm", default="on", choices=["on", "both"],
                    help="both: first the same batches on an engine whose one-row matmuls are cuBLAS's with the "
                         "unfused kernels around them (server/model/small_gemm.py off), the reference")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]

    from server import LLM

    device = torch.device(args.device)
    batches = [int(b) for b in (args.batches or ("1,8" if device.type == "cpu" else "1,8,64,256")).split(",")]
    repeat = args.repeat or (1 if device.type == "cpu" else 3)
    kinds = ["final", "every-step"] if args.outputs == "both" else [args.outputs]
    new_tokens = args.new_tokens or (64 if device.type == "cpu" else 256)
    dummy = device.type == "cuda" and args.model in (None, "llama-1b", "llama-8b", "llama-tiny")
    name = args.model or ("llama-1b" if dummy else "SmolLM2-135M-Instruct")
    folder = model_folder(name, Path(tempfile.mkdtemp()), max_position_embeddings=131072) if dummy else None

    def build():
        if dummy:
            llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_num_seqs=max(batches),
                      max_model_len=2048)
        else:
            llm = LLM(model=args.model, device=args.device, max_num_seqs=max(batches))
        engine_decode_rate(llm, max(batches), 8, device)  # warm-up: allocator, kernels, graphs
        return llm

    small_off = {}
    if args.small_gemm == "both":
        from server.model import small_gemm

        rows_before, small_gemm.SMALL_ROWS = small_gemm.SMALL_ROWS, 0
        llm = build()
        llm.engine.set_async_scheduling(modes[-1])
        small_off = {b: median_rate(llm, b, new_tokens, device, kinds[0], repeat)["decode_tok_s"] for b in batches}
        llm.close()
        small_gemm.SMALL_ROWS = rows_before
        torch.cuda.empty_cache()
    llm = build()
    folder = folder or llm.engine.model_path
    dtype = llm.engine.dtype
    vocab = llm.engine.model_config.vocab_size

    hf = None if args.no_hf else load_hf(folder, dtype, device, llm.engine.model if dummy else None)
    hf_batches = [] if hf is None else [b for b in batches if b <= args.hf_max_batch] if device.type == "cuda" else [1]
    rows = []
    for b in batches:
        rates = {}
        for on in modes:
            llm.engine.set_async_scheduling(on)
            rates[on] = median_rate(llm, b, new_tokens, device, kinds[0], repeat)
        ours = rates[modes[-1]]
        every = median_rate(llm, b, new_tokens, device, "every-step", repeat) if len(kinds) > 1 else None
        ref = hf_decode_rate(hf, b, new_tokens, vocab, device) if b in hf_batches else None
        rows.append({"batch": b, "async_scheduling": modes[-1], "outputs": kinds[0],
                     "sleepserve_tok_s": ours["decode_tok_s"], "sleepserve_e2e_tok_s": ours["e2e_tok_s"],
                     "every_step_tok_s": every["decode_tok_s"] if every else None,
                     "every_step_e2e_tok_s": every["e2e_tok_s"] if every else None,
                     "hf_tok_s": ref["decode_tok_s"] if ref else None,
                     "sleepserve_sync_tok_s": rates[False]["decode_tok_s"] if False in rates else None,
                     "small_gemm_off_tok_s": small_off.get(b)})
    hf_b1 = next(r["hf_tok_s"] for r in rows if r["batch"] == 1) if 1 in hf_batches else None
    for r in rows:
        same = r["hf_tok_s"]
        r["x_vs_hf_same_batch"] = r["sleepserve_tok_s"] / same if same else None
        r["x_vs_hf_batch1"] = r["sleepserve_tok_s"] / hf_b1 if hf_b1 else None

    result = {"date": now_iso(), "hardware": hardware(device), "model": name, "dtype": str(dtype).split(".")[-1],
              "parameters": sum(p.numel() for p in llm.engine.model.parameters()), "new_tokens": new_tokens,
              "prompt_tokens": PROMPT_LEN, "repeat": repeat, "rows": rows}
    by_batch = {r["batch"]: r for r in rows}
    if 64 in by_batch and 256 in by_batch:  # issue 15: tok/s at 256 sequences >= 2.5x tok/s at 64
        result["x_256_over_64"] = {key: by_batch[256][key] / by_batch[64][key]
                                   for key in ("sleepserve_tok_s", "sleepserve_e2e_tok_s", "every_step_tok_s",
                                               "every_step_e2e_tok_s") if by_batch[64][key]}
    one = by_batch.get(1)  # the roofline fraction is batch 1's
    if device.type == "cuda" and one is not None:
        bw = copy_bandwidth(device)
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        result.update(copy_bandwidth_GBs=bw / 1e9, weight_bytes=weight_bytes, roofline_tok_s_batch1=bw / weight_bytes)
        result["batch1_fraction_of_roofline"] = one["sleepserve_tok_s"] / result["roofline_tok_s_batch1"]
        if small_off:
            result["batch1_fraction_of_roofline_small_gemm_off"] = one["small_gemm_off_tok_s"] / result["roofline_tok_s_batch1"]
        if one["sleepserve_sync_tok_s"] and len(modes) > 1:
            result["batch1_fraction_of_roofline_sync"] = one["sleepserve_sync_tok_s"] / result["roofline_tok_s_batch1"]
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out, f"throughput-{device.type}", result)
    plot(result, args.out / f"throughput-{device.type}.png")
    llm.close()

    print(f"\nthroughput ({result['model']}, {result['dtype']}, {result['hardware']}, {result['date']})")
    print(table([[r["batch"], f"{r['sleepserve_sync_tok_s']:.1f}" if r["sleepserve_sync_tok_s"] else "-",
                  f"{r['sleepserve_tok_s']:.1f}", f"{r['sleepserve_e2e_tok_s']:.1f}",
                  f"{r['every_step_tok_s']:.1f}" if r["every_step_tok_s"] else "-",
                  f"{r['small_gemm_off_tok_s']:.1f}" if r["small_gemm_off_tok_s"] else "-",
                  f"{r['hf_tok_s']:.1f}" if r["hf_tok_s"] else "-",
                  f"{r['x_vs_hf_same_batch']:.2f}x" if r["x_vs_hf_same_batch"] else "-",
                  f"{r['x_vs_hf_batch1']:.2f}x" if r["x_vs_hf_batch1"] else "-"] for r in rows],
                ["batch", "sync tok/s", f"sleepserve tok/s (async {'on' if modes[-1] else 'off'}, {kinds[0]})",
                 "end to end tok/s", "every-step outputs tok/s", "small_gemm off tok/s", "HF generate tok/s",
                 "vs HF same batch", "vs HF batch 1"]))
    if "x_256_over_64" in result:
        labels = {"sleepserve_tok_s": "decode", "sleepserve_e2e_tok_s": "end to end",
                  "every_step_tok_s": "every-step decode", "every_step_e2e_tok_s": "every-step end to end"}
        print("in process, 256 / 64 sequences at once: " + ", ".join(
            f"{labels[key]} {x:.2f}x" for key, x in result["x_256_over_64"].items()) + " (target >= 2.5x)")
    if "roofline_tok_s_batch1" in result:
        print(f"HBM roofline at batch 1: {result['roofline_tok_s_batch1']:.0f} tok/s "
              f"({result['weight_bytes'] / 1e9:.2f} GB of weights at {result['copy_bandwidth_GBs']:.0f} GB/s); "
              f"sleepserve reaches {100 * result['batch1_fraction_of_roofline']:.0f}% (target 60% for 1B, 80% for 8B)"
              + (f", {100 * result['batch1_fraction_of_roofline_sync']:.0f}% without async scheduling"
                 if "batch1_fraction_of_roofline_sync" in result else "")
              + (f", {100 * result['batch1_fraction_of_roofline_small_gemm_off']:.0f}% with small_gemm off"
                 if "batch1_fraction_of_roofline_small_gemm_off" in result else ""))


if __name__ == "__main__":
    main()
