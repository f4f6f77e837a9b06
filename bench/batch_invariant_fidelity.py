"""How far the bf16 paths' log-probs are from fp32 (issue 40), on real weights: the embedded SmolLM2-135M (the
default model, server/model/default_model.py), 12 prompts x 64 greedy tokens, all 12 requests in one batch.

Each system generates its own greedy sequences and reports its sampled tokens' log-probs; transformers in
fp32 then scores each system's very sequences (teacher-forced: one forward over prompt + output), and per
token |Δ log-prob| = |ours - fp32| and |Δp| = |exp(ours) - exp(fp32)| are averaged (and maxed) over every
generated token of every prompt. Systems:
- ours bf16, default mode: the sampled log-probs (decode), and the same sequences re-scored as prompts
  (prompt_logprobs);
- ours bf16, --batch-invariant: decode and re-scored (which should be bitwise the decode's: counted);
- transformers bf16: generate's scores, log-softmaxed.
Also how many of the 12 sequences each system generates token-identical to fp32's own greedy sequences.

Once a system's greedy sequence leaves fp32's (at a near tie), it is scored on other tokens than the others: the
rows above compare means over different tokens. So every system also scores the same sequences, fp32's greedy
ones, teacher-forced (ours: prompt_logprobs; transformers: one forward), and each of ours is compared with
transformers bf16 token by token on them: the mean of (|ours - fp32| - |transformers - fp32|) with a 95% interval
from resampling the prompts (a negative mean: ours closer to fp32 than transformers on those tokens).

    python bench/batch_invariant_fidelity.py                 # CUDA (the H200 run)
    python bench/batch_invariant_fidelity.py --small         # CPU, 2 prompts x 8 tokens: a smoke run
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.common import hardware, now_iso, table, write_json

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "List three primary colors:", "Translate to French: Good morning, how are you?", "The quick brown fox",
    "Explain photosynthesis in one sentence.", "1, 2, 3, 4, 5,", "Write a haiku about the sea.",
    "The best way to learn a new language is", "import numpy as np\n", "Q: What is 12 times 7?\nA:",
]


def hf_model(folder: Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


@torch.inference_mode()
def score(model, prompt: list[int], output: list[int], device: torch.device) -> list[float]:
    """The fp32 model's log-prob of each output token given everything before it."""
    ids = torch.tensor([prompt + output], device=device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lps = logits.log_softmax(-1)
    return lps.gather(1, torch.tensor(output, device=device)[:, None])[:, 0].tolist()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[tuple]:
    """transformers' greedy sequences and their log-probs (of its raw logits), one prompt at a time (no padding
    to account for), never stopping at EOS (as ours with ignore_eos: EOS is neither masked nor an end)."""
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        tokens = gen.sequences[0, len(p):].tolist()
        lps = [s[0].float().log_softmax(-1)[t].item() for s, t in zip(gen.logits, tokens)]
        out.append((tokens, lps))
    return out


def rescore(llm, prompts: list[list[int]], seqs: list[list[int]]) -> list[list[float]]:
    """Each sequence's tokens' log-probs after its prompt, as ours scores a prompt (prompt_logprobs), from scratch."""
    from server import SamplingParams

    llm.reset_prefix_cache()  # from scratch, not read back from earlier blocks
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([p + s for p, s in zip(prompts, seqs)], params)
    return [[e[t].logprob for e, t in zip(o.prompt_logprobs[len(p):], s)] for o, p, s in zip(outs, prompts, seqs)]


def ours(folder: Path, device: torch.device, invariant: bool, prompts: list[list[int]], new_tokens: int,
         common: list[list[int]]) -> tuple[list[tuple], list[list[float]], list[list[float]]]:
    """(each prompt's (greedy tokens, their sampled log-probs), the same sequences' re-scored log-probs, the
    `common` sequences' re-scored log-probs)."""
    from server import LLM, SamplingParams

    llm = LLM(model=str(folder), device=device.type, dtype="bfloat16", batch_invariant=invariant,
              kv_cache_memory="1GiB" if device.type == "cuda" else "256MiB", max_model_len=1024)
    try:
        # ignore_eos, not min_tokens: min_tokens masks EOS in the logits the log-probs are taken from
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
        gen = []
        for o in llm.generate(prompts, params):
            c = o.outputs[0]
            gen.append((list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]))
        return gen, rescore(llm, prompts, [g[0] for g in gen]), rescore(llm, prompts, common)
    finally:
        llm.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def deltas(reference, prompts: list[list[int]], seqs: list[list[int]], lps: list[list[float]],
           device: torch.device) -> dict:
    d_lp, d_p = [], []
    for p, s, lp in zip(prompts, seqs, lps):
        for a, b in zip(lp, score(reference, p, s, device)):
            d_lp.append(abs(a - b))
            d_p.append(abs(math.exp(a) - math.exp(b)))
    return {"mean_abs_dlogprob": sum(d_lp) / len(d_lp), "max_abs_dlogprob": max(d_lp),
            "mean_abs_dp": sum(d_p) / len(d_p), "tokens": len(d_lp)}


def paired(ours_lps: list[list[float]], theirs_lps: list[list[float]], fp32_lps: list[list[float]],
           resamples: int = 2000) -> dict:
    """Token by token on the same sequences: d = |ours - fp32| - |theirs - fp32|; its mean over every token, and a 95%
    interval of that mean from resampling the sequences (seeded: the same data give the same interval)."""
    import random

    per_seq = [[abs(a - f) - abs(b - f) for a, b, f in zip(o, t, r)] for o, t, r in zip(ours_lps, theirs_lps, fp32_lps)]
    flat = [d for seq in per_seq for d in seq]
    rng = random.Random(0)
    means = []
    for _ in range(resamples):
        pick = [per_seq[rng.randrange(len(per_seq))] for _ in per_seq]
        tokens = [d for seq in pick for d in seq]
        means.append(sum(tokens) / len(tokens))
    means.sort()
    return {"mean_diff": sum(flat) / len(flat), "ci95": [means[int(0.025 * resamples)], means[int(0.975 * resamples)]],
            "ours_mean_abs": sum(abs(a - f) for o, r in zip(ours_lps, fp32_lps) for a, f in zip(o, r)) / len(flat),
            "theirs_mean_abs": sum(abs(b - f) for t, r in zip(theirs_lps, fp32_lps) for b, f in zip(t, r)) / len(flat),
            "tokens": len(flat)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU, 2 prompts x 8 tokens")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (8 with --small)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    from server.model.source import resolve_model
    from server.model.tokenizer import load_tokenizer

    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    folder = resolve_model(None).folder
    tokenizer = load_tokenizer(folder)
    texts = PROMPTS[:2] if args.small else PROMPTS
    prompts = [tokenizer.encode(t) for t in texts]
    new_tokens = args.new_tokens or (8 if args.small else 64)

    reference = hf_model(folder, torch.float32, device)
    ref_seqs = [g[0] for g in hf_generate(reference, prompts, new_tokens, device)]
    ref_lps = [score(reference, p, s, device) for p, s in zip(prompts, ref_seqs)]  # fp32 on its own sequences
    systems: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
    on_common: dict[str, list[list[float]]] = {}  # every system on fp32's sequences
    agree = {}
    for invariant, label in ((False, "ours bf16 default"), (True, "ours bf16 batch-invariant")):
        gen, rescored, on_common[label] = ours(folder, device, invariant, prompts, new_tokens, ref_seqs)
        seqs = [g[0] for g in gen]
        systems[f"{label}, decode"] = (seqs, [g[1] for g in gen])
        systems[f"{label}, re-scored"] = (seqs, rescored)
        agree[label] = sum(g[1] == r for g, r in zip(gen, rescored))
    hf16 = hf_model(folder, torch.bfloat16, device)
    hf_gen = hf_generate(hf16, prompts, new_tokens, device)
    hf_common = [score(hf16, p, s, device) for p, s in zip(prompts, ref_seqs)]
    del hf16
    systems["transformers bf16"] = ([g[0] for g in hf_gen], [g[1] for g in hf_gen])

    rows = []
    for name, (seqs, lps) in systems.items():
        row = {"system": name, **deltas(reference, prompts, seqs, lps, device),
               "sequences_equal_to_fp32_greedy": sum(s == r for s, r in zip(seqs, ref_seqs))}
        rows.append(row)
    result = {"date": now_iso(), "hardware": hardware(device), "model": folder.name, "prompts": len(prompts),
              "new_tokens": new_tokens, "rows": rows,
              "decode_equals_rescored_bitwise": {k: f"{v} of {len(prompts)}" for k, v in agree.items()},
              "same_sequences_vs_transformers_bf16": {label: paired(lps, hf_common, ref_lps)
                                                      for label, lps in on_common.items()}}
    print(table([[r["system"], f"{r['mean_abs_dlogprob']:.4f}", f"{r['max_abs_dlogprob']:.3f}",
                  f"{r['mean_abs_dp']:.4f}", f"{r['sequences_equal_to_fp32_greedy']}/{len(prompts)}"] for r in rows],
                ["system", "mean |Δ log-prob|", "max |Δ log-prob|", "mean |Δp|", "= fp32 greedy"]))
    for k, v in result["decode_equals_rescored_bitwise"].items():
        print(f"{k}: decode and re-scored log-probs bitwise equal on {v} sequences")
    for label, p in result["same_sequences_vs_transformers_bf16"].items():
        print(f"{label} on fp32's sequences ({p['tokens']} tokens, teacher-forced): mean |Δ log-prob| "
              f"{p['ours_mean_abs']:.4f} against transformers bf16's {p['theirs_mean_abs']:.4f}; ours - theirs "
              f"{p['mean_diff']:+.4f} (95% {p['ci95'][0]:+.4f} .. {p['ci95'][1]:+.4f})")
    print(json.dumps(result))
    write_json(args.out, "batch_invariant_fidelity_small" if args.small else "batch_invariant_fidelity", result)
    return result


if __name__ == "__main__":
    main()
