"""Routed experts ("rollout routing replay"): the experts each token was routed to, per sparse layer.

Every sparse layer (model/moe.py) writes its top-k expert ids into its slice of one device buffer,
[max tokens of a step, sparse layers, top-k] int32, preallocated in the pool (tag `cuda_graph`: the
decode graphs capture the writes, and the buffer keeps its address through sleep). That write is all a
step pays when no request of it asked. When one did, the step's rows go to a pinned host buffer in one
copy queued behind the forward, which the host reads when it collects the step's sampled tokens (it
waits for those anyway): no host sync of its own. Each asking sequence keeps its rows by position
(grown as it goes, rewritten if a preemption recomputes them); its output gets rows
[0, prompt + generated - 1): the last sampled token never went through the model. That is vLLM's
layout, (tokens, layers, top-k), in uint8 when the model has at most 256 experts, else uint16.

Requests that ask reuse no prefix-cache hits (kv_cache.match_prefix): a hit's rows were never copied.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from server.wire.tags import CUDA_GRAPH
from server.model.moe import SparseMoeBlock

if TYPE_CHECKING:
    from server.engine.sequence import Sequence

# (sequence, its first row in the step's flat batch, the position of that row, rows)
RoutedItem = tuple["Sequence", int, int, int]
HOST_BUFFERS = 3  # a step's copy may be queued while the two before it are still read (async scheduling)


def expert_id_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


class RoutedExperts:
    def __init__(self, model: torch.nn.Module, pool, max_tokens: int):
        layers = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        if not layers:
            raise ValueError("--enable-return-routed-experts needs a mixture-of-experts model; "
                             f"{model.config.model_type} has no experts")
        self.num_layers, self.top_k = len(layers), layers[0].top_k
        self.dtype = expert_id_dtype(model.config.num_experts)
        self.max_tokens = max_tokens
        shape = (max_tokens, self.num_layers, self.top_k)
        self.rows = pool.empty(shape, torch.int32, CUDA_GRAPH)
        self.rows.zero_()
        for i, layer in enumerate(layers):
            layer.routed = self.rows[:, i]
        cuda = self.rows.device.type == "cuda"
        self.hosts = [torch.empty(shape, dtype=torch.int32, pin_memory=cuda) for _ in range(HOST_BUFFERS)]
        self.turn = 0

    def copy_out(self, num_tokens: int) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """Queue the copy of this step's rows to a host buffer (behind the forward that writes them)."""
        self.turn = (self.turn + 1) % len(self.hosts)
        host = self.hosts[self.turn][:num_tokens]
        cuda = self.rows.device.type == "cuda"
        host.copy_(self.rows[:num_tokens], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        return host, event

    def rows_of(self, host: torch.Tensor, event: "torch.cuda.Event | None",
                items: list[RoutedItem]) -> list[tuple[int, int, np.ndarray]]:
        """Once the step's tokens are on the host: (seq id, first position, rows) of each asking sequence, in
        the narrow dtype (Scheduler.update_from_output stores them in the sequence)."""
        if event is not None:
            event.synchronize()  # done already when the step sampled tokens (their copy was queued after it)
        rows = host.numpy()
        return [(seq.seq_id, start, rows[offset:offset + n].astype(self.dtype)) for seq, offset, start, n in items]


def store(seq: "Sequence", start: int, rows: np.ndarray) -> None:
    """Rows of positions [start, start + len(rows)) of seq, kept by position (a recomputation rewrites them)."""
    held = seq.routed_experts
    end = start + len(rows)
    if held is None or held.shape[0] < end:
        grown = np.zeros((max(end, seq.num_prompt_tokens + 16, 2 * (0 if held is None else held.shape[0])),
                          *rows.shape[1:]), dtype=rows.dtype)
        if held is not None:
            grown[:held.shape[0]] = held
        held = seq.routed_experts = grown
    held[start:end] = rows


__all__ = ["RoutedExperts", "RoutedItem", "expert_id_dtype", "store"]
