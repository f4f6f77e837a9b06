"""A per-step roofline for the benchmarks: the least time a step can take on this device, from what
it must read (weights + the KV of every context token) at the measured memory bandwidth and what it
must compute (GEMM and attention FLOPs) at the measured dense-matmul throughput, whichever is larger.

Both device figures are measured in the same run (not taken from a datasheet), so the fraction of
the roofline a run reaches compares like with like.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.common import copy_bandwidth, timed


@dataclass(frozen=True)
class Device:
    bandwidth: float     # bytes/s, read + write, of a large device-to-device copy
    gemm_flops: float    # FLOP/s of a large dense matmul in the model's dtype

    @classmethod
    def measure(cls, device: torch.device, dtype: torch.dtype) -> "Device":
        measured = cls(memory_bandwidth(device), matmul_flops(device, dtype))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # give the test matrices back before an engine sizes its cache
        return measured


def memory_bandwidth(device: torch.device) -> float:
    if device.type == "cuda":
        return copy_bandwidth(device)
    a = torch.empty(64 << 20, dtype=torch.float32).normal_()  # 256 MiB: well past every CPU cache
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(timed(lambda: b.copy_(a), device) for _ in range(5))
    return 2 * a.numel() * a.element_size() / best


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 10 if device.type == "cuda" else 3
    best = min(timed(lambda: a @ b, device) for _ in range(reps))
    return 2 * n ** 3 / best


@dataclass(frozen=True)
class ModelCost:
    """What one forward step reads and computes, from the model's shape. Mixture of experts: a token is
    multiplied by the k experts it is routed to, and a step reads the distinct experts its tokens picked,
    taken as uniform routing: E (1 - (1 - k/E)^tokens) per sparse layer (all of them, within 1%, from
    ~72 tokens a step at Qwen3-30B-A3B's 8 of 128, (15/16)^72 < 0.01: an RL batch's decode; bench/moe.py
    counts the experts really routed instead)."""
    weight_bytes: int          # every parameter once (a tied embedding is read once, by the LM head)
    matmul_params: int         # parameters multiplied per token (layers' linears), without the LM head
    head_params: int           # vocab x hidden: multiplied only for rows that are sampled
    kv_bytes_per_token: int    # K and V of every layer
    attn_flops_per_pair: int   # FLOPs of one (query token, context token) pair over all layers
    expert_bytes: int = 0      # of weight_bytes, the routed experts' (0: a dense model)
    experts: int = 0           # per sparse layer
    top_k: int = 0             # experts per token

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelCost":
        c = model.config
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        embed = c.vocab_size * c.hidden_size
        layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
        expert = [p for n, p in model.named_parameters() if ".experts." in n]
        experts, top_k = getattr(c, "num_experts", 0), getattr(c, "num_experts_per_tok", 0)
        idle = sum(p.numel() for p in expert) * (1 - top_k / experts) if experts else 0
        elem = next(model.parameters()).element_size()
        return cls(weight_bytes=weight_bytes, matmul_params=round(layer_params - idle), head_params=embed,
                   kv_bytes_per_token=2 * c.num_layers * c.num_kv_heads * c.head_dim * elem,
                   attn_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
                   expert_bytes=sum(p.numel() * p.element_size() for p in expert), experts=experts, top_k=top_k)

    def expert_share_read(self, tokens: int) -> float:
        """The share of the experts' bytes a step of `tokens` tokens reads (uniform routing)."""
        return 1.0 - (1.0 - self.top_k / self.experts) ** tokens if self.experts else 1.0

    def step(self, shape: "StepShape") -> tuple[float, float]:
        """(bytes, FLOPs) of a step of that shape."""
        kv_read = shape.kv_tokens * self.kv_bytes_per_token
        weights = self.weight_bytes - self.expert_bytes * (1.0 - self.expert_share_read(shape.tokens))
        flops = (2 * self.matmul_params * shape.tokens + 2 * self.head_params * shape.sampled
                 + self.attn_flops_per_pair * shape.pairs)
        return weights + kv_read, flops

    def step_seconds(self, shape: "StepShape", device: Device) -> float:
        nbytes, flops = self.step(shape)
        return max(nbytes / device.bandwidth, flops / device.gemm_flops)


@dataclass(frozen=True)
class StepShape:
    """What the roofline needs of one step, summed over its sequences (one small object per step: a list
    per step of a pair per sequence was a million tuples over a rollout, which the collector walked on the
    engine's thread)."""
    seqs: int        # sequences in the step
    tokens: int      # new tokens computed
    kv_tokens: int   # context tokens read (each sequence's cached tokens plus its new ones)
    pairs: int       # (query token, context token) pairs attended: each new token to every token up to itself
    sampled: int     # rows sampled (the LM head's)

    @classmethod
    def of(cls, items: list[tuple[int, int]], sampled: int) -> "StepShape":
        """items: (tokens already in the cache, new tokens) per sequence."""
        return cls(len(items), sum(n for _, n in items), sum(start + n for start, n in items),
                   sum(n * start + n * (n + 1) // 2 for start, n in items), sampled)

    @classmethod
    def decode(cls, contexts: int, seqs: int) -> "StepShape":
        """One new token for each of `seqs` sequences whose cached tokens add up to `contexts`."""
        return cls(seqs, seqs, contexts + seqs, contexts + seqs, seqs)


class StepRecorder:
    """Records the shape of every batch an EngineCore schedules (StepShape: its sums over the sequences), so
    the roofline of the steps a run really took can be summed afterwards. Wraps the scheduler's
    schedule() and schedule_ahead() (async scheduling) of that one engine instance; benchmark-only."""

    def __init__(self, core):
        self.steps: list[StepShape] = []
        self._scheduler = core.scheduler
        schedule = core.scheduler.schedule

        def recording():
            batch = schedule()
            if batch:
                items = [(seq.num_computed, n) for seq, n in batch.items]
                sampled = sum(1 for seq, n in batch.items if seq.num_computed + n == seq.num_tokens)
                self.steps.append(StepShape.of(items, sampled))
            return batch

        core.scheduler.schedule = recording
        ahead = getattr(core.scheduler, "schedule_ahead", None)  # absent in trees from before async scheduling

        def recording_ahead(seqs, max_model_len, *more):
            got = ahead(seqs, max_model_len, *more)  # type: ignore[misc]
            if got is not None:  # one token per sequence at position num_tokens (the token in flight)
                items = got[0].items
                self.steps.append(StepShape.decode(sum([seq.num_tokens for seq, _ in items]), len(items)))
            return got

        if ahead is not None:
            core.scheduler.schedule_ahead = recording_ahead

    def roofline_seconds(self, cost: ModelCost, device: Device) -> float:
        return sum(cost.step_seconds(shape, device) for shape in self.steps)

    def close(self) -> None:
        """Stop recording: the scheduler's own schedule() again."""
        del self._scheduler.schedule
        self._scheduler.__dict__.pop("schedule_ahead", None)
