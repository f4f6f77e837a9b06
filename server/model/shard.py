"""Tensor parallelism for the Llama family (Megatron layout): which slice of each checkpoint tensor a
rank holds, and the two collectives the model calls.

Column-parallel (split the output rows): q/k/v (by KV-head group, so each rank's query heads read
its own KV heads), gate/up, the vocabulary of the embedding and of the LM head. Row-parallel (split
the input columns, partial sums added by one all-reduce): o_proj and down_proj. Norms are whole on
every rank. Mixture-of-experts layers (moe.py) cut every expert along its intermediate dimension:
gate/up rows (w13's two halves) and down columns; the router is whole on every rank. KV heads fewer than ranks are replicated (each rank holds the one its query heads read).
Sizes that do not divide evenly split into chunks that differ by at most one head or row (the
embedded SmolLM2 has 9 query and 3 KV heads); the vocabulary is padded to equal shards so the
logits gather in one all-gather.

With one rank every shard is None and every collective is the identity: the single-GPU model is
this same code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from server.model.config import ModelConfig


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's chunk when n items split into `world` contiguous chunks whose sizes
    differ by at most one (the first ranks take the larger)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class Shard:
    """This rank's part of one checkpoint tensor: [start, stop) of the full tensor along `dim`, held
    in a local dimension of `size` (>= stop - start: vocabulary shards are padded with zeros).
    `first_only`: a row-parallel bias, held by rank 0 (zeros elsewhere) so the all-reduce adds it once."""
    dim: int
    start: int
    stop: int
    full: int
    size: int
    first_only: bool = False
    rank: int = 0

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slice of the full tensor to read (safetensors' get_slice takes it)."""
        if self.first_only:
            return (slice(None),) * ndim
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.first_only else full.narrow(self.dim, self.start, self.stop - self.start)

    @torch.no_grad()
    def place(self, param: torch.Tensor, part: torch.Tensor) -> None:
        """Copy this rank's part (already sliced) into the local parameter; padding becomes zero."""
        if self.first_only and self.rank != 0:
            param.zero_()
            return
        n = part.shape[self.dim]
        param.narrow(self.dim, 0, n).copy_(part)
        if n < param.shape[self.dim]:
            param.narrow(self.dim, n, param.shape[self.dim] - n).zero_()


_COLUMN_Q = re.compile(r"\.self_attn\.q_proj\.(weight|bias)$")
_COLUMN_KV = re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias)$")
_ROW_O = re.compile(r"\.self_attn\.o_proj\.(weight|bias)$")
_COLUMN_MLP = re.compile(r"\.mlp\.(gate|up)_proj\.(weight|bias)$")
_ROW_MLP = re.compile(r"\.mlp\.down_proj\.(weight|bias)$")
_COLUMN_SHARED = re.compile(r"\.mlp\.shared_expert\.(gate|up)_proj\.weight$")  # Qwen2-MoE's shared expert
_ROW_SHARED = re.compile(r"\.mlp\.shared_expert\.down_proj\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# Experts: one by one (the checkpoint's names), or stacked ([E, 2I, H] and [E, H, I]; vLLM's and transformers 5's names).
_COLUMN_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$")
_ROW_EXPERT = re.compile(r"\.experts\.\d+\.(down_proj|w2)\.weight$")
_STACKED_W13 = re.compile(r"\.experts\.(w13_weight|gate_up_proj)$")
_STACKED_W2 = re.compile(r"\.experts\.(w2_weight|down_proj)$")


@dataclass(frozen=True)
class GateUpShard:
    """This rank's part of a stacked gate|up tensor [E, 2I, H]: rows [start, stop) of the gate half and
    the same rows of the up half, side by side ([E, 2 * (stop - start), H]). Not one slice of the file:
    index() is None, and a reader takes it from the whole tensor."""
    start: int
    stop: int
    full: int   # I, one half's rows

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (local[0], 2 * self.full, *local[2:])

    def index(self, ndim: int) -> None:
        return None

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        n = self.stop - self.start
        return torch.cat([whole.narrow(1, self.start, n), whole.narrow(1, self.full + self.start, n)], dim=1)

    @torch.no_grad()
    def place(self, param: torch.Tensor, part: torch.Tensor) -> None:
        param.copy_(part)


class TensorParallel:
    """One rank's view: its layout (heads, rows, vocabulary it holds) and its collectives, which run on
    `comm`, the device communicator the engine sets at start (server/engine/parallel/comm.py)."""

    def __init__(self, cfg: ModelConfig, rank: int = 0, world: int = 1):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        self.rank, self.world, self.full_config = rank, world, cfg
        self.comm = None  # all_reduce(x) -> x, all_gather(x) -> [x of each rank], set once the group starts
        # --batch-invariant: every all-reduce sums the ranks' parts in rank order (an all-gather, then the
        # sum here), whatever the message's size: a ring or tree all-reduce's order follows its chunks.
        self.ordered_reduce = False
        H, KV = cfg.num_heads, cfg.num_kv_heads
        if H % KV:
            raise ValueError(f"{H} query heads do not group evenly over {KV} KV heads")
        group = H // KV
        if KV >= world:
            self.kv = split(KV, world, rank)
            self.q = (self.kv[0] * group, self.kv[1] * group)
        elif world % KV == 0 and H % world == 0:
            # Fewer KV heads than ranks: each is replicated on world / KV ranks, whose query heads read it.
            kv = rank * KV // world
            self.kv = (kv, kv + 1)
            self.q = split(H, world, rank)
        else:
            raise ValueError(f"--tensor-parallel-size {world} cannot split {KV} KV heads: use a size that "
                             f"divides {KV} evenly or that is at most {KV}")
        if cfg.intermediate_size < world:
            raise ValueError(f"--tensor-parallel-size {world} is larger than the MLP width {cfg.intermediate_size}")
        self.inter = split(cfg.intermediate_size, world, rank)
        if cfg.num_experts and cfg.moe_intermediate_size < world:
            raise ValueError(f"--tensor-parallel-size {world} is larger than the experts' width "
                             f"{cfg.moe_intermediate_size}")
        self.moe_inter = split(cfg.moe_intermediate_size, world, rank) if cfg.num_experts else (0, 0)
        self.shared_inter = split(cfg.shared_expert_intermediate_size, world, rank)
        self.vocab_shard = -(-cfg.vocab_size // world)
        v0 = rank * self.vocab_shard
        self.vocab = (v0, min(v0 + self.vocab_shard, cfg.vocab_size))
        # The config of this rank's modules: its heads and MLP rows (the vocabulary stays whole there:
        # tokens are validated against it; the embedding and LM head take vocab_shard rows).
        self.config = replace(cfg, num_heads=self.q[1] - self.q[0], num_kv_heads=self.kv[1] - self.kv[0],
                              intermediate_size=self.inter[1] - self.inter[0],
                              moe_intermediate_size=self.moe_inter[1] - self.moe_inter[0],
                              shared_expert_intermediate_size=self.shared_inter[1] - self.shared_inter[0])

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def shard(self, name: str) -> "Shard | GateUpShard | None":
        """How the checkpoint tensor `name` is split on this rank; None when every rank holds it whole."""
        if self.world == 1:
            return None
        cfg, D = self.full_config, self.full_config.head_dim
        r = self.rank
        if name in _VOCAB:
            return Shard(0, *self.vocab, cfg.vocab_size, self.vocab_shard, rank=r)
        if _COLUMN_Q.search(name):
            return Shard(0, self.q[0] * D, self.q[1] * D, cfg.num_heads * D, (self.q[1] - self.q[0]) * D, rank=r)
        if _COLUMN_KV.search(name):
            return Shard(0, self.kv[0] * D, self.kv[1] * D, cfg.num_kv_heads * D, (self.kv[1] - self.kv[0]) * D,
                         rank=r)
        if _COLUMN_MLP.search(name):
            return Shard(0, *self.inter, cfg.intermediate_size, self.inter[1] - self.inter[0], rank=r)
        if cfg.num_experts:
            lo, hi = self.moe_inter
            I = cfg.moe_intermediate_size
            if _COLUMN_EXPERT.search(name):
                return Shard(0, lo, hi, I, hi - lo, rank=r)
            if _ROW_EXPERT.search(name):
                return Shard(1, lo, hi, I, hi - lo, rank=r)
            if _STACKED_W13.search(name):
                return GateUpShard(lo, hi, I)
            if _STACKED_W2.search(name):
                return Shard(2, lo, hi, I, hi - lo, rank=r)
            lo, hi = self.shared_inter
            S = cfg.shared_expert_intermediate_size
            if _COLUMN_SHARED.search(name):
                return Shard(0, lo, hi, S, hi - lo, rank=r)
            if _ROW_SHARED.search(name):
                return Shard(1, lo, hi, S, hi - lo, rank=r)
        row = _ROW_O.search(name) or _ROW_MLP.search(name)
        if row:
            if name.endswith(".bias"):
                return Shard(0, 0, cfg.hidden_size, cfg.hidden_size, cfg.hidden_size, first_only=True, rank=r)
            lo, hi, full = ((self.q[0] * D, self.q[1] * D, cfg.num_heads * D) if _ROW_O.search(name)
                            else (*self.inter, cfg.intermediate_size))
            return Shard(1, lo, hi, full, hi - lo, rank=r)
        return None

    # -- collectives (identity with one rank) ------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial results of a row-parallel layer over the ranks, in place."""
        if self.world > 1:
            if self.ordered_reduce:
                from server.model.batch_invariant import ordered_all_reduce

                return ordered_all_reduce(self._comm(), x)
            self._comm().all_reduce(x)
        return x

    def row_parallel_to_norm(self, linear: torch.nn.Linear, x: torch.Tensor, ops):
        """row_parallel for an output the next norm reads first: on one device the ops set's linear_to_norm (which
        may leave the norm something to finish), across ranks its linear, summed over them."""
        return self.row_parallel(linear, x, ops.linear_to_norm if self.world == 1 else ops.linear)

    def row_parallel(self, linear: torch.nn.Linear, x: torch.Tensor, one_device=None) -> torch.Tensor:
        """linear(x) summed over the ranks (o_proj, down_proj: each rank holds some input columns).
        A communicator with a staging buffer (symmetric memory) gets the matmul's output written
        straight into it, saving the copy an all-reduce of a separate tensor needs. one_device(linear, x):
        the matmul without tensor parallelism (the ops set's)."""
        if self.world == 1:
            return linear(x) if one_device is None else one_device(linear, x)
        if self.ordered_reduce:
            return self.all_reduce(linear(x) if one_device is None else one_device(linear, x))
        comm = self._comm()
        staging = getattr(comm, "staging", None)
        out = None if staging is None or x.dim() != 2 else staging(x.shape[0], linear.out_features, x.dtype)
        if out is None:
            return comm.all_reduce(linear(x))
        torch.mm(x, linear.weight.t(), out=out)  # what F.linear computes without a bias
        if linear.bias is not None:
            out.add_(linear.bias)  # a row-parallel bias is held by rank 0 only (zeros elsewhere)
        return comm.reduce_staged(out)

    def _comm(self):
        if self.comm is None:
            raise RuntimeError("the tensor-parallel communicator is released (the engine sleeps); wake it first")
        return self.comm

    def min(self, value: int) -> int:
        """The smallest of every rank's value (e.g. how many KV blocks fit)."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)  # over the control group (gloo, CPU)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, vocab_shard] per rank -> [T, vocab] on every rank."""
        if self.world == 1:
            return logits
        return torch.cat(self._comm().all_gather(logits), dim=-1)[:, :self.full_config.vocab_size]


__all__ = ["GateUpShard", "Shard", "TensorParallel", "split"]
