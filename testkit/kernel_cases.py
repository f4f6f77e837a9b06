"""Random paged-decode cases shared by the CPU (Triton interpreter) and GPU kernel tests."""
from __future__ import annotations

import random

import torch

from server.model.attention import decode_attention_torch
from server.model.kv_layout import layer_views

LAYERS = 3


# The interpreter runs fp32 and fp16 only (it mishandles bf16 matmuls; bf16 is checked on the GPU).
INTERPRETER_TOLERANCES = ((torch.float32, 1e-5), (torch.float16, 2e-3))


def worst_interpreted_errors(error_of, cases: list) -> dict[str, float]:
    """error_of(case, dtype, seed) for every case in each interpreter dtype, each under that dtype's
    tolerance (AssertionError naming the case otherwise); returns the worst error per dtype."""
    worst: dict[str, float] = {}
    for dtype, tol in INTERPRETER_TOLERANCES:
        for i, case in enumerate(cases):
            err = error_of(case, dtype, i)
            assert err < tol, f"{dtype} case {i}: relative error {err:.2e} over {tol:.0e}"
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
    return worst


def random_case(batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, max_len: int,
                dtype: torch.dtype, device: str, seed: int):
    """Caches with scattered pages (strided views of a block-major cache), block tables in random order, lengths that are often not a
    multiple of the block size, and an output poisoned with NaN so unwritten rows show."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, max_len) for _ in range(batch)]
    lens[0] = 1
    lens[-1] = max_len
    pages = [-(-n // block_size) for n in lens]
    num_blocks = sum(pages) + 8
    width = max(pages) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    for b, n in enumerate(pages):
        tables[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    # The engine's block-major layout (kv_layout.py): K and V are one middle layer's strided views.
    kv = torch.randn((num_blocks, LAYERS, 2, block_size, kv_heads, head_dim), generator=gen).to(dtype)
    k, v = layer_views(kv.to(device), LAYERS // 2)
    assert not k.is_contiguous() and k.stride(0) == LAYERS * 2 * block_size * kv_heads * head_dim
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return [q.to(device), k, v, tables.to(device), ctx.to(device)]


def relative_error(kernel, case, scale: float) -> float:
    q, k, v, tables, lens = case
    ref = decode_attention_torch(q.double(), k.double(), v.double(), tables, lens, scale)
    out = kernel(q, k, v, tables, lens, scale)
    assert not torch.isnan(out).any(), "the kernel left rows unwritten or produced NaN"
    return float((out.double() - ref).norm() / ref.norm())


def random_prefill_case(spans: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype, device: str, seed: int, decodes: int = 3):
    """A step's prefill spans, given as (new tokens, cached prefix tokens), behind `decodes` decode rows
    (the kernel must leave those alone): q [T, H, D], the new K/V already written into scattered pages
    of a block-major cache (as write_kv does before attention), the spans with their block tables."""
    from server.model.attention import AttentionContext, PrefillSpan, write_kv

    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: GPU cases are large

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    pages = [-(-(n + prefix) // block_size) for n, prefix in spans]
    num_blocks = sum(pages) + 4
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    kv = rnd(num_blocks, LAYERS, 2, block_size, kv_heads, head_dim)
    k_cache, v_cache = layer_views(kv, LAYERS // 2)
    T = decodes + sum(n for n, _ in spans)
    q, k, v = rnd(T, heads, head_dim), rnd(T, kv_heads, head_dim), rnd(T, kv_heads, head_dim)
    prefills, slots, offset = [], [], decodes
    for (n, prefix), count in zip(spans, pages):
        table = [free.pop() for _ in range(count)]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(prefix, prefix + n)]
        prefills.append(PrefillSpan(offset, n, prefix + n, torch.tensor(table, dtype=torch.int64, device=device)))
        offset += n
    write_kv(k_cache, v_cache, k[decodes:], v[decodes:], torch.tensor(slots, device=device))
    ctx = AttentionContext(slot_mapping=torch.tensor(slots, device=device), num_decode_tokens=decodes,
                           block_tables=torch.zeros((decodes, 1), dtype=torch.int64, device=device),
                           context_lens=torch.ones(decodes, dtype=torch.int32, device=device),
                           max_decode_context=1, prefills=prefills)
    return q, k, v, k_cache, v_cache, ctx


def prefill_error(kernel, case, scale: float) -> float:
    """Relative error of kernel's prefill rows against the PyTorch path in float64; the decode rows
    (NaN before the call) must stay untouched."""
    from server.model.attention import prefill_spans_torch

    q, k, v, k_cache, v_cache, ctx = case
    nd = ctx.num_decode_tokens
    ref = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    prefill_spans_torch(q.double(), k.double(), v.double(), k_cache.double(), v_cache.double(), ctx, scale, ref)
    out = torch.full_like(q, float("nan"))
    kernel(q, k, v, k_cache, v_cache, ctx, scale, out)
    assert torch.isnan(out[:nd]).all(), "the kernel wrote rows that are not prefill rows"
    got = out[nd:]
    assert not torch.isnan(got).any(), "the kernel left prefill rows unwritten or produced NaN"
    return float((got.double() - ref[nd:]).norm() / ref[nd:].norm())


ENGINE_PROMPTS = [list(range(1000, 1040)) + [2000 + i] * (3 + 7 * i) for i in range(3)] + [[3000]]


def engine_prefill_check(llm, reference_ops, kernel_ops, tol: float) -> tuple[float, int]:
    """An engine (built with max_num_batched_tokens=40) run with reference_ops, then with kernel_ops, which
    differ only in their prefill attention: prompts sharing a 40-token prefix, chunked by the step budget
    (later chunks read earlier ones from the cache), scored by prompt log-probs (every prompt position's
    logits) and decoded greedily; then with kernel_ops again once their prefixes are cached (prefix
    caching: spans that start after cached blocks). Asserts equal greedy tokens and log-probs within
    tol; returns (largest log-prob difference, tokens found cached)."""
    from server import SamplingParams

    def run(ops, scored: bool):
        llm.engine.model.ops = ops
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0 if scored else None)
        outs = llm.generate(ENGINE_PROMPTS, params)
        lps = [[e[t].logprob for e, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, ENGINE_PROMPTS)
               ] if scored else []
        return [o.outputs[0].token_ids for o in outs], lps, sum(o.num_cached_tokens for o in outs)

    ref, ref_lp, _ = run(reference_ops, True)
    got, got_lp, _ = run(kernel_ops, True)
    err = max(abs(a - b) for x, y in zip(ref_lp, got_lp) for a, b in zip(x, y))
    assert err < tol, f"prompt log-probs differ by {err:.2e}"
    assert got == ref, (got, ref)
    cached, _, hits = run(kernel_ops, False)
    assert hits >= 3 * 32, hits  # three prompts found (at least) their 2 shared blocks of 16 cached
    assert cached == ref, (cached, ref)
    return err, hits


def split_decode(counts: torch.Tensor):
    """triton_decode_attention with a context split over programs (decode_kernel.decode_splits), checking that
    the last split of each (sequence, KV head) left its count at 0 for the next launch."""
    from server.model.decode_kernel import triton_decode_attention

    def run(q, k, v, tables, lens, scale):
        out = triton_decode_attention(q, k, v, tables, lens, scale, split_counts=counts)
        assert not counts.any(), "a split count was left non-zero"
        return out
    return run
