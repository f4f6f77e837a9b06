"""CUDA IPC and NCCL weight transfer into a real server on the GPU (the CPU twins run in CI).

A llama-tiny checkpoint of random weights is served; a perturbed copy is loaded once from disk for
the reference greedy tokens; then the same tensors are pushed from this process (same GPU: IPC,
packed and per-tensor handles; second GPU: NCCL) and the greedy tokens must be the same.
"""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.models import model_folder
from server.weight_transfer import safe_pickle
from server.weight_transfer.sender import WeightSender
from tests.http_server import ServerProcess

pytestmark = pytest.mark.gpu
PROMPT_IDS = [[1, 450, 3014, 310, 3444, 338], [1, 822, 18755, 29898, 29876, 1125]]


def checkpoint(folder, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    from server.model.config import ModelConfig
    from server.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(ModelConfig.from_folder(folder), 1024)
    gen = torch.Generator().manual_seed(seed)
    # Large random weights: peaked logits, so greedy tokens do not hinge on rounding.
    return {n: (torch.ones(p.shape) if n.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * scale)
            .to(torch.bfloat16) for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from safetensors.torch import save_file

    base = model_folder("llama-tiny", tmp_path_factory.mktemp("models"), max_position_embeddings=1024)
    save_file(checkpoint(base, 0), str(base / "model.safetensors"))
    other = tmp_path_factory.mktemp("perturbed")
    perturbed = checkpoint(base, 1)
    save_file(perturbed, str(other / "model.safetensors"))
    return base, other, perturbed


def greedy(server) -> list[list[int]]:
    out = []
    for ids in PROMPT_IDS:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


def serve(folder, backend: str, env=None) -> ServerProcess:
    return ServerProcess([str(folder), "--device", "cuda", "--max-model-len", "512", "--kv-cache-memory", "1GiB",
                          "--dev-mode", "--weight-transfer-config", json.dumps({"backend": backend, "timeout_s": 60})],
                         env=env).start()


def reference(server, perturbed_folder) -> tuple[list, list]:
    original = greedy(server)
    assert httpx.post(server.url + "/update_weights", json={"path": str(perturbed_folder)}, timeout=300).status_code == 200
    expected = greedy(server)
    assert expected != original
    assert httpx.post(server.url + "/update_weights", json={}, timeout=300).status_code == 200
    assert greedy(server) == original
    return original, expected


def test_ipc_push_packed_and_per_tensor(folders):
    base, other, perturbed = folders
    server = serve(base, "ipc")
    try:
        original, expected = reference(server, other)
        named = [(n, t.cuda()) for n, t in perturbed.items()]
        sender = WeightSender(server.url, backend="ipc", bucket_bytes=4 << 20)
        sender.init()
        report = sender.send(named, weight_version="ipc-packed")
        assert report["server"]["weights_valid"] is True
        assert greedy(server) == expected
        assert httpx.post(server.url + "/update_weights", json={}, timeout=300).status_code == 200
        assert greedy(server) == original
        # vLLM's unpacked form: one handle per tensor.
        from torch.multiprocessing.reductions import reduce_tensor
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        update = {"names": [n for n, _ in named], "dtype_names": ["bfloat16"] * len(named),
                  "shapes": [list(t.shape) for _, t in named], "packed": False,
                  "ipc_handles_pickled": safe_pickle.dumps_b64([{uuid: reduce_tensor(t)[1]} for _, t in named])}
        r = httpx.post(server.url + "/update_weights", json={"update_info": update}, timeout=300)
        assert r.status_code == 200, r.text
        assert greedy(server) == expected
        sender.close()
    finally:
        server.stop()


def flat(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same tensors as views of one device buffer, back to back (a trainer's flat buffer)."""
    buf = torch.empty(sum(t.numel() * t.element_size() for _, t in named), dtype=torch.uint8, device=named[0][1].device)
    out, offset = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        out.append((name, buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)))
        offset += n
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL transfer needs two GPUs")
def test_nccl_push_from_another_gpu(folders):
    """Every receive path on real streams: buckets unpacked on the copy stream (4 MiB buckets of
    several tensors), buckets broadcast straight into the parameters (1-byte buckets: one tensor
    each), one broadcast per tensor (packed=False), and a trainer with a flat buffer (no packing).
    Each push is checked against a disk load of the same weights, from the original weights."""
    base, other, perturbed = folders
    server = serve(base, "nccl", env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        original, expected = reference(server, other)
        named = [(n, t.cuda(0)) for n, t in perturbed.items()]
        sender = WeightSender(server.url, backend="nccl", device="cuda:0", bucket_bytes=4 << 20, timeout_s=60)
        sender.init()
        cases = [("staged", dict(bucket_bytes=4 << 20, packed=True), named),
                 ("in place", dict(bucket_bytes=1, packed=True), named),
                 ("per tensor", dict(packed=False), named),
                 ("flat trainer", dict(bucket_bytes=4 << 20, packed=True), flat(named))]
        for what, settings, tensors in cases:
            for k, v in settings.items():
                setattr(sender, k, v)
            report = sender.send(tensors, weight_version=f"nccl-{what}")
            timings = report["update"]["timings"]
            assert report["server"]["weights_valid"] is True, (what, report)
            if what == "staged":
                assert timings["staged"] >= 1, timings
            elif what == "flat trainer":
                assert report["sender"]["staged"] == 0 and timings["staged"] >= 1, (report["sender"], timings)
            else:
                assert timings["staged"] == 0 and timings["direct"] == len(named), (what, timings)
            assert greedy(server) == expected, what
            assert httpx.post(server.url + "/update_weights", json={}, timeout=300).status_code == 200
            assert greedy(server) == original, what
        sender.close()
    finally:
        server.stop()
