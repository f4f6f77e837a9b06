"""What the structured-output token mask costs: decode tokens/s with a JSON-schema grammar on every
sequence, against the same run without it (same engine, prompts and token counts), at batch 1 and 32.

The grammar (an array of at least 1000 objects) cannot complete within the run, so every step of
every sequence is masked and both runs decode exactly the same number of tokens.

Besides the ratio, it prints where a decode step's mask time goes (MaskTimes: the engine thread's
time consuming tokens, computing masks and launching their application; the device's time to apply
them, timed alone).

    python bench/structured_mask.py --device cpu --model llama-tiny
    python bench/structured_mask.py --device cuda --model llama-1b --out $OUT
"""
from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a script from anywhere

from bench.common import hardware, now_iso, sync, table, write_json
from server.engine.grammar_masks import MaskTimes, apply_token_bitmask
from testkit.models import model_folder

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}}}}


def decode_rate(llm, batch: int, new_tokens: int, structured, device: torch.device, tag: str
                ) -> tuple[float, float, MaskTimes]:
    """(decode tokens/s, seconds per decode step, the mask's time split over those steps): first token
    of every request out → all done."""
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
    masks = core.runner.masks
    masks.times = MaskTimes()
    steps = 0
    t0 = time.perf_counter()
    while core.has_unfinished:
        core.step()
        steps += 1
    sync(device)
    elapsed = time.perf_counter() - t0
    assert all(len(s.output_token_ids) == new_tokens for r in reqs for s in r.seqs), "a run ended early"
    return batch * (new_tokens - 1) / elapsed, elapsed / steps, masks.times


def device_apply_seconds(batch: int, vocab: int, device: torch.device, bit_values: torch.Tensor | None,
                         iters: int = 200) -> float:
    """The device's time to take one step's packed masks (pinned, on CUDA) and mask [batch, vocab]
    float32 logits with them: what apply() adds to the device's queue, timed alone."""
    pin = device.type == "cuda"
    packed = torch.full((batch, (vocab + 31) // 32), 0x55555555, dtype=torch.int32, pin_memory=pin)
    logits = torch.zeros(batch, vocab, device=device)
    for _ in range(5):
        apply_token_bitmask(logits, packed, bit_values)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            apply_token_bitmask(logits, packed, bit_values)
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    start.record()
    for _ in range(iters):
        apply_token_bitmask(logits, packed, bit_values)
    end.record()
    sync(device)
    return start.elapsed_time(end) / 1e3 / iters


def split_row(label: str, batch: int, plain_step: float, step: float, t: MaskTimes, device_apply: float) -> list:
    """Per decode step, in microseconds: the step, its extra over no mask, and where the mask's time went."""
    n = max(t.steps, 1)
    us = lambda x: f"{x / n * 1e6:,.0f}"  # noqa: E731
    return [label, batch, f"{plain_step * 1e6:,.0f}", f"{step * 1e6:,.0f}", f"{(step - plain_step) * 1e6:+,.0f}",
            us(t.advance), us(t.pack), us(t.fill), us(t.launch), f"{device_apply * 1e6:,.1f}"]


SPLIT_HEADER = ["variant", "batch", "no-mask step", "step", "extra", "advance", "pack", "fill", "launch",
                "device apply"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="a testkit/models.py shape with random weights (default: the "
                                                   "embedded SmolLM2-135M)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 64 on CPU, 256 on CUDA")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds of runs (without, with the mask) "
                                                           "per batch size; medians and the spread are printed")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    new_tokens = args.new_tokens or (256 if device.type == "cuda" else 64)

    from server import LLM
    from server.wire.params import StructuredOutputs

    kw: dict = dict(device=args.device, max_num_seqs=64, max_model_len=1024)
    if device.type == "cpu":
        kw["kv_cache_memory"] = "512MiB"
    model = None
    if args.model:
        folder = tempfile.mkdtemp(prefix="sleepserve-bench-")
        atexit.register(shutil.rmtree, folder, True)  # the model copy is the run's scratch
        model = str(model_folder(args.model, Path(folder)))
        kw["load_format"] = "dummy"
    llm = LLM(model=model, **kw)
    spec = StructuredOutputs(json=SCHEMA)
    # Compile once up front (as the server does off the engine thread) and warm both paths up.
    llm.engine.grammars.compile(spec)
    decode_rate(llm, 2, 8, None, device, "warm-plain")
    decode_rate(llm, 2, 8, spec, device, "warm-masked")
    # llguidance builds its lexer states lazily, kept by the compiled grammar (as a server keeps it for
    # every request with this schema): one full run of the largest batch first, so that no timed run
    # pays for them (greedy decoding takes the same path every time).
    decode_rate(llm, max(int(b) for b in args.batches.split(",")), new_tokens, spec, device, "warm-states")

    runner = llm.engine.runner
    # The variants, run in interleaved rounds (the order rotates), so drift in the machine's speed (other
    # work, clocks, caches) hits both alike; each round gives one ratio.
    variants = [("no mask", None), ("mask", spec)]
    rows, results, splits = [], [], []
    for batch in [int(b) for b in args.batches.split(",")]:
        runs: dict[str, list] = {label: [] for label, _ in variants}
        for r in range(args.repeats):
            for k in range(len(variants)):
                label, structured = variants[(k + r) % len(variants)]
                runs[label].append(decode_rate(llm, batch, new_tokens, structured, device, f"{r}-{label}"))
        plain = [rate for rate, _, _ in runs["no mask"]]
        plain_step = statistics.median(step for _, step, _ in runs["no mask"])
        apply_s = device_apply_seconds(batch, llm.engine.model_config.vocab_size, device, runner.masks.bit_values)
        for label, _ in variants[1:]:
            masked = [rate for rate, _, _ in runs[label]]
            ratios = [m / p for m, p in zip(masked, plain)]
            ratio = statistics.median(ratios)
            results.append({"batch": batch, "variant": label, "plain_tok_s": statistics.median(plain),
                            "masked_tok_s": statistics.median(masked), "ratio": ratio, "ratio_min": min(ratios),
                            "ratio_max": max(ratios), "plain_runs": plain, "masked_runs": masked,
                            "device_apply_s": apply_s})
            rows.append([label, batch, f"{statistics.median(plain):,.1f}", f"{statistics.median(masked):,.1f}",
                         f"{ratio:.3f} ({(1 - ratio) * 100:.1f}% cost)", f"{min(ratios):.3f}-{max(ratios):.3f}"])
            # The split of the median run (by tokens/s).
            mid = sorted(runs[label], key=lambda x: x[0])[len(masked) // 2]
            splits.append(split_row(label, batch, plain_step, mid[1], mid[2], apply_s))
            results[-1]["split_us_per_step"] = dict(zip(SPLIT_HEADER[2:], splits[-1][2:]))
    name = args.model or "SmolLM2-135M (embedded)"
    print(f"structured outputs mask cost: {name} on {hardware(device)}, {new_tokens} new tokens, greedy, "
          f"JSON schema on every sequence, {args.repeats} interleaved rounds per batch ({now_iso()})")
    print(table(rows, ["variant", "batch", "no mask tok/s (median)", "with mask tok/s (median)",
                       "with / without (median)", f"spread of {args.repeats} rounds"]))
    for r in results:
        print(f"structured mask ratio at batch {r['batch']}: {r['ratio']:.3f} "
              f"(min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f}, {args.repeats} interleaved rounds)")
    print("structured mask step split (microseconds per decode step; engine thread: advance = consuming the "
          "sampled tokens, pack = computing the masks in apply (fill = llguidance's part of it), launch = "
          "queuing the transfer and masking; device apply = the device's time for the transfer and masking, "
          "timed alone):")
    print(table(splits, SPLIT_HEADER))
    write_json(args.out, f"structured-mask-{device.type}", {"model": name, "device": hardware(device),
                                                            "new_tokens": new_tokens, "when": now_iso(),
                                                            "results": results})
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
