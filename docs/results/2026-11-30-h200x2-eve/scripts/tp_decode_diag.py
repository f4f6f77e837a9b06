"""Decode-only step time at TP=1 and TP=2 (8B dummy): two generate lengths, the difference cancels prefill."""
import sys, time, statistics, json, os
from pathlib import Path
sys.path.insert(0, os.getcwd())
from bench.tensor_parallel import PROMPT
from tests.models import model_folder
from server import LLM, SamplingParams

world = int(sys.argv[1]); model = sys.argv[2] if len(sys.argv) > 2 else "llama-8b"
import tempfile
folder = model_folder(model, Path(tempfile.mkdtemp()))
llm = LLM(model=str(folder), device="cuda", load_format="dummy", max_model_len=4096, kv_cache_memory="20GiB",
          tensor_parallel_size=world)
out = {}
for batch in (1, 8, 64):
    prompts = [PROMPT + str(i) for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    t = {}
    for n in (16, 144):
        ts = []
        for _ in range(3):
            s = time.perf_counter(); llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)); ts.append(time.perf_counter() - s)
        t[n] = statistics.median(ts)
    step = (t[144] - t[16]) / 128
    out[batch] = {"step_ms": step * 1e3, "tok_s": batch / step, "t16": t[16], "t144": t[144]}
    print(f"TP={world} {model} batch {batch}: decode step {step*1e3:.3f} ms ({batch/step:.0f} tok/s); prefill+16 {t[16]*1e3:.0f} ms", flush=True)
json.dump(out, open(os.path.join(os.environ.get("R", "/tmp"), f"tpdecode-{world}.json"), "w"), indent=1)
llm.close()
