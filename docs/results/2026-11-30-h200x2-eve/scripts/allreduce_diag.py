"""All-reduce latency inside a CUDA graph on 2 GPUs: NCCL (torch.distributed) vs torch symmetric memory
one-shot / two-shot (peer loads, no multicast). Run: python -m torch.distributed.run --nproc-per-node 2 this."""
import os, time, json, sys
import torch, torch.distributed as dist

rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank); dev = torch.device("cuda", rank)
dist.init_process_group("nccl", device_id=dev)
group_name = dist.group.WORLD.group_name
res = {}
N_OPS = 64

def time_graph(fn, x, label):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): fn(x)
    torch.cuda.synchronize(); dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(N_OPS): fn(x)
    for _ in range(3): g.replay()
    torch.cuda.synchronize(); dist.barrier()
    ts = []
    for _ in range(10):
        dist.barrier(); torch.cuda.synchronize()
        t = time.perf_counter(); g.replay(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    us = sorted(ts)[len(ts)//2] / N_OPS * 1e6
    res[label] = us
    if rank == 0: print(f"{label}: {us:.1f} us per op", flush=True)

for rows in (1, 8, 64, 256):
    n = rows * 4096
    x = torch.ones(n, dtype=torch.bfloat16, device=dev)
    time_graph(lambda t: dist.all_reduce(t), x, f"nccl rows={rows}")
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(buf, group_name)
        buf.fill_(1.0)
        out = torch.empty_like(buf)
        chk = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
        torch.cuda.synchronize()
        if rank == 0: print("one_shot correct:", bool((chk == world).all()), flush=True)
        time_graph(lambda t: torch.ops.symm_mem.one_shot_all_reduce_out(t, "sum", group_name, out), buf, f"symm one_shot rows={rows}")
        try:
            time_graph(lambda t: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group_name), buf, f"symm two_shot rows={rows}")
        except Exception as e:
            if rank == 0: print("two_shot failed:", type(e).__name__, str(e)[:300], flush=True)
    except Exception as e:
        if rank == 0: print("symm_mem failed:", type(e).__name__, str(e)[:500], flush=True)
if rank == 0:
    json.dump(res, open(os.path.join(os.environ.get("R", "/tmp"), "allreduce.json"), "w"), indent=1)
dist.destroy_process_group()
