"""What the batch-invariance tests share (CPU: tests/engine/test_batch_invariant.py and tests/http/; H200:
tests/gpu/test_batch_invariant_gpu.py): the other requests a target shares its batch with, and how a result
is compared, bit for bit.

A result is (token ids, each sampled token's log-prob entries): Logprob values are Python floats, so ==
compares them exactly, and a difference is printed with its size (1 ulp of fp32 shows as ~1e-7)."""
from __future__ import annotations

import random

from server import SamplingParams

# The targets: a greedy request and a seeded sampled one, both asking for log-probs (with their top 2).
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=6, logprobs=2, ignore_eos=True)
TARGET_PROMPTS = ["The capital of France is",
                  "Write a short story about a lighthouse keeper who finds a message in a bottle. It begins:"]


def others(n: int, vocab: int, seed: int = 0, longest: int = 48) -> tuple[list[list[int]], list[SamplingParams]]:
    """n other requests of other lengths (2..longest tokens) and other lengths of output (1..8 tokens, so the
    batch changes while the targets decode), greedy, seeded or unseeded, some with log-probs."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(100, vocab) for _ in range(rng.randint(2, longest))])
        kind = i % 3
        params.append(SamplingParams(temperature=0.0 if kind == 0 else 0.8, seed=i if kind == 1 else None,
                                     max_tokens=rng.randint(1, 8), logprobs=0 if i % 2 else None, ignore_eos=True))
    return prompts, params


def result(out) -> tuple[list[int], list[dict]]:
    """(token ids, each token's {id: (logprob, rank)}) of a RequestOutput's first choice."""
    o = out.outputs[0]
    return list(o.token_ids), [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in (o.logprobs or [])]


def explain(a, b) -> str:
    """Where two results first differ, and by how much."""
    if a[0] != b[0]:
        i = next(i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y)
        return f"tokens differ from index {i}: {a[0][i:]} vs {b[0][i:]}"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        if x != y:
            gap = max(abs(x[t][0] - y[t][0]) for t in x.keys() & y.keys()) if x.keys() & y.keys() else None
            return f"log-probs differ at token {i}: {x} vs {y} (largest gap {gap})"
    return "equal"


ALL_TARGETS = [(p, GREEDY) for p in TARGET_PROMPTS] + [(p, SEEDED) for p in TARGET_PROMPTS]


def alone_and_among(llm, n_others: int, seed: int = 0,
                    targets: list[tuple[str | list[int], SamplingParams]] = ALL_TARGETS) -> list[tuple[tuple, tuple]]:
    """Each target alone, then all of them among n_others other requests (placed in their middle): a list
    of (alone, among) results per target."""
    ids = [p if isinstance(p, list) else llm.tokenizer.encode(p) for p, _ in targets]
    alone = [result(llm.generate([i], [sp])[0]) for i, (_, sp) in zip(ids, targets)]
    prompts, params = others(n_others, llm.engine.model_config.vocab_size, seed)
    half = len(prompts) // 2
    outs = llm.generate(prompts[:half] + ids + prompts[half:],
                        params[:half] + [sp for _, sp in targets] + params[half:])
    among = [result(o) for o in outs[half:half + len(targets)]]
    return list(zip(alone, among))


def rescored(llm, prompt: str | list[int], params: SamplingParams) -> tuple[tuple, list[dict]]:
    """Generate, then score prompt + output as a prompt (prompt_logprobs): (the generated result, the
    re-scored entries of the output's tokens, in the same {id: (logprob, rank)} form)."""
    ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
    gen = result(llm.generate([ids], [params])[0])
    k = params.logprobs or 0
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    entries = llm.generate([ids + gen[0]], [score])[0].prompt_logprobs[len(ids):]
    return gen, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in entries]
