"""One rank of test_tensor_parallel_gpu's all-reduce check (run as `python this RANK WORLD PORT`, one
process per GPU): the server's own Group start (control group, NCCL communicator, symmetric memory
with its probe), then the same inputs all-reduced by the symmetric-memory path and by NCCL, eagerly
(copied into the buffer, and written there as a row-parallel layer does) and inside a CUDA graph
replayed with new data. Prints one JSON line: what matched."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.engine.parallel.group import Group  # noqa: E402
from server.engine.parallel.symm import SymmComm, buffer_bytes  # noqa: E402
from server.model.config import ModelConfig  # noqa: E402
from server.model.shard import TensorParallel  # noqa: E402

HIDDEN = 4096


def main(rank: int, world: int, port: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    cfg = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                      num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1e4,
                      rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False)
    group = Group(port, rank, world, device, TensorParallel(cfg, rank, world))
    group.start(all_reduce="symm", symm_bytes=buffer_bytes(world, 256, HIDDEN, 2))
    symm = group.comm
    out: dict = {"rank": rank, "backend": group.all_reduce_name}
    if not isinstance(symm, SymmComm):
        print(json.dumps(out), flush=True)
        group.close()
        return
    nccl = symm.nccl
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    checks = {}
    # Decode-sized messages (one-shot) and a prefill-sized one (above the buffer: NCCL).
    for rows in (1, 8, 64, 256, 1024):
        x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
        ints = torch.randint(-8, 8, (rows, HIDDEN), device=device, generator=gen).to(torch.bfloat16)
        a, b = symm.all_reduce(x.clone()), nccl.all_reduce(x.clone())
        ia, ib = symm.all_reduce(ints.clone()), nccl.all_reduce(ints.clone())
        torch.cuda.synchronize()
        checks[rows] = {"one_shot": symm.fits(x), "ints_equal": torch.equal(ia, ib),
                        "close": torch.allclose(a, b, rtol=2 ** -7, atol=1e-3),
                        "equal": torch.equal(a, b), "mismatches": int((a != b).sum())}
    # A row-parallel layer's output written straight into the buffer (TensorParallel.row_parallel).
    staged_ok = {}
    for rows in (1, 64, 256):
        ints = torch.randint(-8, 8, (rows, HIDDEN), device=device, generator=gen).to(torch.bfloat16)
        into = symm.staging(rows, HIDDEN, torch.bfloat16)
        into.copy_(ints)
        got = symm.reduce_staged(into)
        want = nccl.all_reduce(ints.clone())
        torch.cuda.synchronize()
        staged_ok[rows] = torch.equal(got, want)
    out["staged"] = staged_ok
    # Captured: the graph reads the buffer's address and the input's, replayed with new data each time.
    rows = 64
    x = torch.zeros(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        symm.all_reduce(x)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        symm.all_reduce(x)
    graph_ok = []
    for _ in range(3):
        new = torch.randint(-8, 8, (rows, HIDDEN), device=device, generator=gen).to(torch.bfloat16)
        x.copy_(new)
        graph.replay()
        want = nccl.all_reduce(new.clone())
        torch.cuda.synchronize()
        graph_ok.append(torch.equal(x, want))
    out.update(checks=checks, graph=graph_ok, limit=symm.limit, device_bytes=symm.device_bytes)
    print(json.dumps(out), flush=True)
    del graph
    group.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
