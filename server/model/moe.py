"""The sparse MLP of Qwen3-MoE and Mixtral: a router picks top-k of E experts per token, each a SwiGLU
MLP, and their outputs are summed with the router's weights.

The experts of a layer are two stacked tensors, so they live in the pool (tag `weights`) like every
other parameter and a fused kernel reads them as one grouped GEMM:
    experts.w13_weight [E, 2*I, H]   gate rows then up rows, per expert (vLLM's name and layout)
    experts.w2_weight  [E, H, I]     down
Checkpoints name the experts one by one (Qwen3-MoE `mlp.experts.{e}.gate_proj/up_proj/down_proj`,
Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2`); those names are views of the stacks
(ExpertStack.views), so loading and weight updates stay a by-name copy, and the stacked names (and
transformers 5's `experts.gate_up_proj` / `experts.down_proj`, the same layout) are accepted too.

With tensor parallelism every rank holds every expert, cut along the intermediate dimension (its
w13 rows of gate and of up, its w2 columns); the router is replicated and the partial sums are
all-reduced, as a dense MLP's down_proj is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.model.config import ModelConfig

# Per family: the module name of the sparse MLP in checkpoints, and its experts' gate, up, down names.
EXPERT_NAMES = {
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
# transformers 5 holds the experts stacked under these names (its in-memory model, what a trainer sends).
HF_STACKED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


class ExpertStack(nn.Module):
    """Every expert of one layer. `intermediate` is this rank's share of each expert's width."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, names: tuple[str, str, str]):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_name, self.up_name, self.down_name = names

    def views(self, prefix: str) -> dict[str, torch.Tensor]:
        """The checkpoint's per-expert names (prefix: this module's name, '...experts') -> views of the stacks."""
        I = self.intermediate
        out: dict[str, torch.Tensor] = {}
        for e in range(self.num_experts):
            out[f"{prefix}.{e}.{self.gate_name}.weight"] = self.w13_weight[e, :I]
            out[f"{prefix}.{e}.{self.up_name}.weight"] = self.w13_weight[e, I:]
            out[f"{prefix}.{e}.{self.down_name}.weight"] = self.w2_weight[e]
        return out

    def expert_names(self, prefix: str, stacked: str) -> list[str]:
        """The per-expert names one stacked tensor (w13_weight or w2_weight) holds."""
        parts = (self.gate_name, self.up_name) if stacked == "w13_weight" else (self.down_name,)
        return [f"{prefix}.{e}.{p}.weight" for e in range(self.num_experts) for p in parts]


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token goes through (cut like a dense MLP at tensor
    parallelism; its partial sums join the experts' before the one all-reduce)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # gate|up side by side (the loader's fused group)
        self.gate_up_bias: torch.Tensor | None = None

    def fused_groups(self) -> dict[str, list[nn.Linear]]:
        return {"gate_up": [self.gate_proj, self.up_proj]}


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp, layer: int):
        super().__init__()
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        # Qwen3-MoE rounds the routing weights to the model dtype before scaling; Mixtral scales in fp32.
        self.round_weights = cfg.model_type != "mixtral"
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = ExpertStack(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                   EXPERT_NAMES[cfg.model_type][1])
        self.layer = layer
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # [max tokens, top_k] int32 rows of the routed-experts buffer (server/engine/routed_experts.py):
        # set when the server captures them; every forward then writes its top-k ids there.
        self.routed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        """x: the post-attention-normed hidden states [T, H] -> the experts' weighted sum [T, H]."""
        out = ops.moe(x, self)
        if self.shared_expert is not None:  # Qwen2-MoE: + sigmoid(gate(x)) * shared(x), as transformers adds it
            shared = ops.project(ops.gate_up_act(self.shared_expert, x), self.shared_expert.down_proj.weight)
            out = out + ops.sigmoid(ops.project(x, self.shared_expert_gate.weight)) * shared
        return self.tp.all_reduce(out)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] holding gate | up -> silu(gate) * up, as Hugging Face's experts compute it."""
    I = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :I]) * gate_up[:, I:]


def moe_torch(x: torch.Tensor, block: SparseMoeBlock, project=F.linear, silu_mul_packed=silu_mul) -> torch.Tensor:
    """The sparse MLP as Hugging Face computes it: route, record the ids if asked, the experts' sum. project
    (x @ w.T) and silu_mul_packed ([n, 2I] gate|up -> [n, I]) are an ops set's: the batch-invariant mode's
    keep each row's bits whatever the number of rows (batch_invariant.py)."""
    ids, weights = route_torch(x, block.gate.weight, block.top_k, block.norm_topk_prob, block.round_weights,
                               project)
    if block.routed is not None:
        block.routed[:x.shape[0]].copy_(ids)
    return experts_torch(x, block.experts.w13_weight, block.experts.w2_weight, ids, weights, project,
                         silu_mul_packed)


def route_torch(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool,
                round_weights: bool, project=F.linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's router: softmax over the experts' logits in fp32, the top k, renormalized if asked.
    Returns (expert ids [T, k] int32, weights [T, k]: fp32, or the model dtype when round_weights). Each
    row's softmax and top-k are its own: a row's result follows the logits' row only."""
    probs = torch.softmax(project(x, gate).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), (weights.to(x.dtype) if round_weights else weights)


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, project=F.linear, silu_mul_packed=silu_mul) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = ids[t, k]: the reference (and
    the CPU path), expert by expert over the tokens routed to it, in Hugging Face's order of summation (a
    token's experts in id order, whatever else the batch holds)."""
    out = torch.zeros_like(x)
    flat = ids.view(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        sel = order[start:start + n]
        start += n
        tokens, slot = sel // ids.shape[1], sel % ids.shape[1]
        h = project(x[tokens], w13[e])
        y = project(silu_mul_packed(h), w2[e]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out
