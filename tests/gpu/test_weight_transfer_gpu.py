"""CUDA IPC and NCCL weight transfer into a real server on the GPU (the CPU twins run in CI).

A llama-tiny checkpoint of random weights is served (its decode steps replay CUDA graphs, so a push
that moved a parameter would show); two other weight sets, A and B, are loaded once each from disk
for the reference greedy tokens; then pushes alternate between A and B (same GPU: IPC, packed and
per-tensor handles; second GPU: NCCL, every receive path), each checked against the disk load of the
same weights. Alternating makes every push change the weights, so a push that landed nothing fails.
Lean on purpose (one server per backend, started while the weight sets are made; one request per
check; a decode batch of at most 4 sequences, so 3 graphs to capture): the stage has ~60 s.
"""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from testkit.models import model_folder
from server.weight_transfer import safe_pickle
from server.weight_transfer.sender import WeightSender
from testkit.http_server import ServerProcess

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


def save(tensors: dict[str, torch.Tensor], folder) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = model_folder("llama-tiny", tmp_path_factory.mktemp("models"), max_position_embeddings=1024)
    save(checkpoint(folder, 0), folder)
    return folder


def weight_sets(base, tmp_path_factory) -> dict[str, tuple]:
    """{"A": (folder, tensors), "B": ...}: two other weight sets, each also on disk for its reference."""
    out = {}
    for name, seed in (("A", 1), ("B", 2)):
        folder = tmp_path_factory.mktemp(f"weights-{name}")
        tensors = checkpoint(base, seed)
        save(tensors, folder)
        out[name] = (folder, tensors)
    return out


def greedy(server) -> list[list[str]]:
    """Both prompts in one request: 8 greedy tokens each."""
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["logprobs"]["tokens"] for c in choices]


def launch(folder, backend: str, env=None) -> ServerProcess:
    return ServerProcess([str(folder), "--device", "cuda", "--max-model-len", "512", "--kv-cache-memory", "1GiB",
                          "--max-num-seqs", "4", "--dev-mode",
                          "--weight-transfer-config", json.dumps({"backend": backend, "timeout_s": 60})],
                         env=env).launch()


def references(server, sets) -> dict[str, list]:
    """Greedy tokens after a disk load of each weight set; they must differ (or no push could be told)."""
    refs = {}
    for name, (folder, _) in sets.items():
        r = httpx.post(server.url + "/update_weights", json={"path": str(folder)}, timeout=300)
        assert r.status_code == 200, r.text
        refs[name] = greedy(server)
    assert refs["A"] != refs["B"]
    return refs


def test_ipc_push_packed_and_per_tensor(base, tmp_path_factory):
    server = launch(base, "ipc")
    try:
        sets = weight_sets(base, tmp_path_factory)
        server.wait_ready()
        refs = references(server, sets)  # B is served now
        named = {k: [(n, t.cuda()) for n, t in tensors.items()] for k, (_, tensors) in sets.items()}
        sender = WeightSender(server.url, backend="ipc", bucket_bytes=4 << 20)
        sender.init()
        report = sender.send(named["A"], weight_version="ipc-packed")
        assert report["server"]["weights_valid"] is True
        assert greedy(server) == refs["A"]
        # vLLM's unpacked form: one handle per tensor, in one plain update (a session of its own).
        from torch.multiprocessing.reductions import reduce_tensor
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        update = {"names": [n for n, _ in named["B"]], "dtype_names": ["bfloat16"] * len(named["B"]),
                  "shapes": [list(t.shape) for _, t in named["B"]], "packed": False,
                  "ipc_handles_pickled": safe_pickle.dumps_b64([{uuid: reduce_tensor(t)[1]} for _, t in named["B"]])}
        r = httpx.post(server.url + "/update_weights", json={"update_info": update}, timeout=300)
        assert r.status_code == 200, r.text
        assert greedy(server) == refs["B"]
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
def test_nccl_push_from_another_gpu(base, tmp_path_factory):
    """Every receive path on real streams, one server: buckets unpacked on the copy stream (4 MiB
    buckets of several tensors), buckets broadcast straight into the parameters (1-byte buckets: one
    tensor each), one broadcast per tensor (packed=False), and a trainer with a flat buffer (no
    packing, unpacked on the server). Each push is checked against a disk load of the same weights."""
    server = launch(base, "nccl", env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        sets = weight_sets(base, tmp_path_factory)
        named = {k: [(n, t.cuda(0)) for n, t in tensors.items()] for k, (_, tensors) in sets.items()}
        server.wait_ready()
        refs = references(server, sets)  # B is served now
        sender = WeightSender(server.url, backend="nccl", device="cuda:0", bucket_bytes=4 << 20, timeout_s=60)
        sender.init()
        cases = [("staged", dict(bucket_bytes=4 << 20, packed=True), "A", False),
                 ("in place", dict(bucket_bytes=1, packed=True), "B", False),
                 ("per tensor", dict(packed=False), "A", False),
                 ("flat trainer", dict(bucket_bytes=4 << 20, packed=True), "B", True)]
        for what, settings, which, flat_buffer in cases:
            for k, v in settings.items():
                setattr(sender, k, v)
            tensors = flat(named[which]) if flat_buffer else named[which]
            report = sender.send(tensors, weight_version=f"nccl-{what}")
            timings = report["update"]["timings"]
            assert report["server"]["weights_valid"] is True, (what, report)
            assert report["server"]["weight_version"] == f"nccl-{what}", (what, report)
            if what == "staged":
                assert timings["staged"] >= 1, timings
            elif what == "flat trainer":
                assert report["sender"]["staged"] == 0 and timings["staged"] >= 1, (report["sender"], timings)
            else:
                assert timings["staged"] == 0 and timings["direct"] == len(tensors), (what, timings)
            assert greedy(server) == refs[which], what
        sender.close()
    finally:
        server.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TRL's NCCL weight sync needs two GPUs")
def test_trl_vllm_client_weight_sync_from_another_gpu(base, tmp_path_factory, monkeypatch):
    """TRL's own VLLMClient (trl 1.16) against the server on GPU 1 with the NCCL backend: init_communicator, then
    update_named_params of a whole weight set from GPU 0; the server then answers as a disk load of the same
    weights, twice (A, then B). TRL makes every HTTP call; the bytes go through this package's trainer side in
    place of vLLM's (testkit/trl_trainer_side.py: vLLM is not installed on the device machines)."""
    from trl.generation.vllm_client import VLLMClient

    from server.weight_transfer import rendezvous
    from testkit.trl_trainer_side import use_this_packages_trainer_side

    server = launch(base, "nccl", env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        sets = weight_sets(base, tmp_path_factory)
        server.wait_ready()
        refs = references(server, sets)  # B is served now
        use_this_packages_trainer_side(monkeypatch, server.url, torch.device("cuda", 0))  # before the constructor
        client = VLLMClient(base_url=server.url, group_port=rendezvous.free_port(), connection_timeout=60)
        client.init_communicator(device=0)
        for which in ("A", "B"):
            named = [(n, t.cuda(0)) for n, t in sets[which][1].items()]
            metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named]
            client.update_named_params(metadata, iter(named))
            info = httpx.get(server.url + "/server_info", timeout=30).json()
            assert info.get("weights_valid", True) is not False, info
            assert greedy(server) == refs[which], which
        client.close_communicator()
    finally:
        server.stop()
