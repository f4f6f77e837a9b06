"""TRL's VLLMClient weight sync where vLLM is not installed: TRL makes every HTTP call itself (get_server_info,
get_world_size, init_weight_transfer_engine, start_weight_update, update_weights, finish_weight_update), and
the two vLLM functions it calls for the bytes (vLLM >= 0.28's nccl_common.trainer_init and
packed_tensor.packed_nccl_broadcast_producer) are stood in for by this package's trainer side: the same
rendezvous (the trainer hosts the store, rank 0), the same NCCL group, the same packed buckets
(server/weight_transfer/sender.py). A GPU test of the issue "TRL's weight sync end to end" uses it on two
GPUs; vLLM's own modules need vLLM's compiled package, which the device machines do not have."""
from __future__ import annotations

from types import SimpleNamespace

import torch


def use_this_packages_trainer_side(monkeypatch, server_url: str, device: torch.device, backend: str = "nccl",
                                   timeout_s: float = 60.0) -> None:
    """Point trl.generation.vllm_client's vLLM calls at this package's sender, as vLLM >= 0.28 is called. backend:
    the server's weight-transfer backend (gloo: a CPU test of the same flow; TRL's own init_communicator
    refuses a CPU device, so such a test makes its two init steps itself: see init_like_trl)."""
    import trl.generation.vllm_client as vllm_client

    from server.weight_transfer import rendezvous
    from server.weight_transfer.group import open_group
    from server.weight_transfer.sender import WeightSender

    class Endpoint:
        """What trainer_init returns as TRL uses it: `.group` (its close_communicator clears store and socket).
        It keeps one sender on the group, so its packing buffers serve every update, as a trainer's do."""

        def __init__(self, init_info: dict):
            world = init_info["world_size"]
            store = rendezvous.host_store(init_info["master_address"], init_info["master_port"], world, timeout_s)
            self.sender = WeightSender(server_url, backend=backend, device=device, timeout_s=timeout_s)
            self.sender.group = open_group(backend, store, 0, world, device, timeout_s)
            self.group = SimpleNamespace(store=store, socket=None)

    def producer(iterator, group: Endpoint, src: int, post_iter_func) -> None:
        assert src == 0, src
        group.sender._broadcast([post_iter_func(item) for item in iterator])  # the packed buckets, vLLM's layout

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)  # its constructor's check only
    monkeypatch.setattr(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", True)
    monkeypatch.setattr(vllm_client, "open_trainer_endpoint", Endpoint, raising=False)
    monkeypatch.setattr(vllm_client, "packed_nccl_broadcast_producer", producer, raising=False)
    monkeypatch.setattr(vllm_client, "get_ip", lambda: "127.0.0.1", raising=False)


def init_like_trl(client, port: int) -> None:
    """VLLMClient.init_communicator's steps past its CUDA-device check, as TRL takes them (vLLM >= 0.28): the
    init POST on a thread while the trainer hosts the rendezvous (open_trainer_endpoint, patched above)."""
    from concurrent.futures import ThreadPoolExecutor

    import trl.generation.vllm_client as vllm_client

    init_info = {"master_address": vllm_client.get_ip(), "master_port": port, "rank_offset": 1,
                 "world_size": client.get_world_size() + 1, "packed": True}
    with ThreadPoolExecutor(max_workers=1) as executor:
        future = executor.submit(client._post, f"{client.base_url}/init_weight_transfer_engine",
                                 json={"init_info": init_info})
        client.communicator = vllm_client.open_trainer_endpoint(init_info)
        future.result()
