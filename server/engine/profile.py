"""Measure the activation memory of the largest step, so the KV cache gets the rest (CUDA only)."""
from __future__ import annotations

import torch

from server.model.attention import AttentionContext, PrefillSpan
from server.model.kv_layout import attach, kv_cache_shape
from server.model.llama import LlamaForCausalLM


@torch.inference_mode()
def measure_activation_peak(model: LlamaForCausalLM, num_tokens: int, block_size: int,
                            dtype: torch.dtype, num_logit_rows: int = 256) -> int:
    """Bytes above the current allocation that one forward over num_tokens (one prompt, the
    worst case for attention) plus sampling-sized logits needs. Its scratch cache is freed after."""
    dev = model.output_weight().device
    cfg = model.config
    n = min(num_tokens, model.max_positions)
    blocks = -(-n // block_size) + 1
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    scratch = torch.zeros(kv_cache_shape(cfg, blocks, block_size), dtype=dtype, device=dev)
    saved = [(l.self_attn.k_cache, l.self_attn.v_cache) for l in model.model.layers]
    attach(model.model.layers, scratch)
    saved_ops = model.ops
    if cfg.num_experts:  # the fused MoE's buffers ([tokens*k, I] and [tokens*k, H]) are the peak, not the reference's
        from server.model.fused_moe import moe

        model.ops = type("FusedMoeOps", (saved_ops,), {"moe": staticmethod(moe)})
    try:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        table = torch.arange(1, blocks, dtype=torch.int32, device=dev)
        slots = (table.long()[:, None] * block_size + torch.arange(block_size, device=dev)).flatten()[:n]
        ctx = AttentionContext(slot_mapping=slots, num_decode_tokens=0,
                               block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
                               context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
                               max_decode_context=0, prefills=[PrefillSpan(0, n, n, table)])
        ids = torch.randint(0, cfg.vocab_size, (n,), device=dev)
        hidden = model(ids, torch.arange(n, device=dev), ctx)
        logits = model.compute_logits(hidden[-min(n, num_logit_rows):])
        # Sampling at temperature > 0 with top-p holds about eight [rows, vocab] fp32 tensors at once
        # (scaled, sorted + order, the drop mask, probs, cumsum, noise): the sort plus four more.
        _ = logits.sort(-1, descending=True)
        _more = [torch.empty_like(logits) for _ in range(4)]
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    finally:
        model.ops = saved_ops
        for layer, (k, v) in zip(model.model.layers, saved):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        del scratch
        torch.cuda.empty_cache()
    return int(peak)
