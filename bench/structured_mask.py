"""What the structured-output token mask costs: decode tokens/s with a JSON-schema grammar on every
sequence, against the same run without it (same engine, prompts and token counts), at batch 1 and 32.

The grammar (an array of at least 1000 objects) cannot complete within the run, so every step of
every sequence is masked and both runs decode exactly the same number of tokens.

    python bench/structured_mask.py --device cpu
    python bench/structured_mask.py --device cuda --model llama-1b --out $OUT
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.common import hardware, now_iso, sync, table, write_json
from tests.models import model_folder

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}}


def decode_rate(llm, batch: int, new_tokens: int, structured, device: torch.device, tag: str) -> float:
    """Decode tokens/s: first token of every request out → all done."""
    from server import SamplingParams

    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, structured_outputs=structured)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        core.add_request(rid, prompt=f"Request {i}: list some people as JSON.", params=params)
    reqs = [core.requests[r] for r in ids]
    while any(r.first_token_time is None for r in reqs):
        core.step()
    sync(device)
    t0 = time.perf_counter()
    while core.has_unfinished:
        core.step()
    sync(device)
    elapsed = time.perf_counter() - t0
    assert all(len(s.output_token_ids) == new_tokens for r in reqs for s in r.seqs), "a run ended early"
    return batch * (new_tokens - 1) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="a tests/models.py shape with random weights (default: the "
                                                   "embedded SmolLM2-135M)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 64 on CPU, 256 on CUDA")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved pairs of runs (without, with the mask) "
                                                           "per batch size; medians and the spread are printed")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    new_tokens = args.new_tokens or (256 if device.type == "cuda" else 64)

    from server import LLM
    from server.engine.params import StructuredOutputs

    kw: dict = dict(device=args.device, max_num_seqs=64, max_model_len=1024)
    if device.type == "cpu":
        kw["kv_cache_memory"] = "512MiB"
    model = None
    if args.model:
        model = str(model_folder(args.model, Path(tempfile.mkdtemp(prefix="sleepserve-bench-"))))
        kw["load_format"] = "dummy"
    llm = LLM(model=model, **kw)
    spec = StructuredOutputs(json=SCHEMA)
    # Compile once up front (as the server does off the engine thread) and warm both paths up.
    llm.engine.grammars.compile(spec)
    decode_rate(llm, 2, 8, None, device, "warm-plain")
    decode_rate(llm, 2, 8, spec, device, "warm-masked")

    rows, results = [], []
    for batch in [int(b) for b in args.batches.split(",")]:
        # Interleaved pairs (the order alternates), so drift in the machine's speed (other work, clocks,
        # caches) hits both sides alike; each pair gives one ratio, and the median and spread are reported.
        plain, masked = [], []
        for r in range(args.repeats):
            order = ((None, plain), (spec, masked)) if r % 2 == 0 else ((spec, masked), (None, plain))
            for structured, into in order:
                into.append(decode_rate(llm, batch, new_tokens, structured, device, f"{r}-{structured is None}"))
        ratios = [m / p for m, p in zip(masked, plain)]
        ratio = statistics.median(ratios)
        results.append({"batch": batch, "plain_tok_s": statistics.median(plain),
                        "masked_tok_s": statistics.median(masked), "ratio": ratio, "ratio_min": min(ratios),
                        "ratio_max": max(ratios), "plain_runs": plain, "masked_runs": masked})
        rows.append([batch, f"{statistics.median(plain):,.1f}", f"{statistics.median(masked):,.1f}",
                     f"{ratio:.3f} ({(1 - ratio) * 100:.1f}% cost)", f"{min(ratios):.3f}-{max(ratios):.3f}"])
    name = args.model or "SmolLM2-135M (embedded)"
    print(f"structured outputs mask cost: {name} on {hardware(device)}, {new_tokens} new tokens, greedy, "
          f"JSON schema on every sequence, {args.repeats} interleaved pairs per batch ({now_iso()})")
    print(table(rows, ["batch", "no mask tok/s (median)", "with mask tok/s (median)", "with / without (median)",
                       f"spread of {args.repeats} pairs"]))
    for r in results:
        print(f"structured mask ratio at batch {r['batch']}: {r['ratio']:.3f} "
              f"(min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f}, {args.repeats} interleaved pairs)")
    write_json(args.out, f"structured-mask-{device.type}", {"model": name, "device": hardware(device),
                                                            "new_tokens": new_tokens, "when": now_iso(),
                                                            "results": results})
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
