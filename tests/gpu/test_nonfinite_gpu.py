"""Weight updates holding NaN or Inf over CUDA IPC (packed buckets, per-tensor handles, SGLang's
/update_weights_from_tensor) and NCCL (from a second GPU): each is refused with 400 naming the tensor,
nothing is served afterwards (503 weights_invalid), and a good push brings the server back. The CPU
twins (gloo, shm, disk) are tests/test_weight_transfer.py and tests/test_http_vllm_dropin.py.
"""
from __future__ import annotations

import httpx
import pytest
import torch
import torch.multiprocessing  # noqa: F401 (registers the CUDA tensor reductions for the SGLang route)

from server.weight_transfer import safe_pickle
from server.weight_transfer.sender import WeightSender, WeightSendError
from tests.gpu.test_weight_transfer_gpu import base, checkpoint, greedy, launch  # noqa: F401 (base: a fixture)

pytestmark = pytest.mark.gpu
BAD = "model.layers.0.self_attn.q_proj.weight"


def poisoned(tensors: dict[str, torch.Tensor], value: float, device: str) -> list[tuple[str, torch.Tensor]]:
    out = []
    for n, t in tensors.items():
        t = t.to(device)
        if n == BAD:
            t = t.clone()
            t.view(-1)[12345] = value
        out.append((n, t))
    return out


def refused_and_not_served(server, answer: httpx.Response | WeightSendError) -> None:
    if isinstance(answer, WeightSendError):
        assert answer.status == 400 and BAD in str(answer), answer
    else:
        assert answer.status_code == 400, answer.text
        body = answer.json()["error"]
        assert body["code"] == "nonfinite_weights" and BAD in body["message"], body
    assert httpx.get(server.url + "/is_sleeping").json()["weights_valid"] is False
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "weights_invalid", r.text


def test_ipc_pushes_of_nan_and_inf_are_refused(base):  # noqa: F811
    server = launch(base, "ipc")
    try:
        good = checkpoint(base, 3)
        server.wait_ready()
        sender = WeightSender(server.url, backend="ipc", bucket_bytes=4 << 20)
        sender.init()
        report = sender.send([(n, t.cuda()) for n, t in good.items()], weight_version="good")
        assert report["server"]["weights_valid"] is True
        expected = greedy(server)
        for value in (float("nan"), float("inf")):
            with pytest.raises(WeightSendError) as caught:
                sender.send(poisoned(good, value, "cuda"))
            refused_and_not_served(server, caught.value)
            # per-tensor handles, one plain update
            from torch.multiprocessing.reductions import reduce_tensor
            named = poisoned(good, value, "cuda")
            uuid = str(torch.cuda.get_device_properties(0).uuid)
            update = {"names": [n for n, _ in named], "dtype_names": ["bfloat16"] * len(named),
                      "shapes": [list(t.shape) for _, t in named], "packed": False,
                      "ipc_handles_pickled": safe_pickle.dumps_b64([{uuid: reduce_tensor(t)[1]} for _, t in named])}
            refused_and_not_served(server, httpx.post(server.url + "/update_weights", json={"update_info": update},
                                                      timeout=300))
            # SGLang's route: [(name, tensor)] pickled with torch's CUDA IPC reductions (as SGLang's trainers do)
            import base64
            from multiprocessing.reduction import ForkingPickler

            blob = base64.b64encode(bytes(ForkingPickler.dumps(named))).decode("ascii")
            refused_and_not_served(server, httpx.post(server.url + "/update_weights_from_tensor",
                                                      json={"serialized_named_tensors": [blob]}, timeout=300))
            report = sender.send([(n, t.cuda()) for n, t in good.items()], weight_version="good-again")
            assert report["server"]["weights_valid"] is True
            assert greedy(server) == expected
        sender.close()
    finally:
        server.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL transfer needs two GPUs")
def test_nccl_pushes_of_nan_and_inf_are_refused(base):  # noqa: F811
    server = launch(base, "nccl", env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        good = checkpoint(base, 3)
        server.wait_ready()
        sender = WeightSender(server.url, backend="nccl", device="cuda:0", bucket_bytes=4 << 20, timeout_s=60)
        sender.init()
        report = sender.send([(n, t.cuda(0)) for n, t in good.items()])
        expected = greedy(server)
        for value in (float("nan"), float("-inf")):
            for packed in (True, False):
                sender.packed = packed
                with pytest.raises(WeightSendError) as caught:
                    sender.send(poisoned(good, value, "cuda:0"))
                refused_and_not_served(server, caught.value)
                report = sender.send([(n, t.cuda(0)) for n, t in good.items()])  # the group is still usable
                assert report["server"]["weights_valid"] is True
                assert greedy(server) == expected
        sender.close()
    finally:
        server.stop()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_and_check_in_one_pass_on_the_gpu(dtype):
    """FiniteCheck.copy on CUDA (the fused kernel): the bytes copied exactly, NaN/Inf named, wherever they sit
    in a tensor of more than 2^31 bytes; a tensor of another dtype falls back to copy + min/max."""
    from server.model.finite import FiniteCheck

    n = (1 << 31) // torch.tensor([], dtype=dtype).element_size() + 4099
    src = torch.randn(n, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    check = FiniteCheck()
    check.copy("good", dst, src)
    assert check.bad() == [] and torch.equal(dst, src)
    for at, value in ((0, float("nan")), (n - 1, float("inf")), (n // 3, float("-inf"))):
        src[at] = value
        check.copy(f"bad@{at}", dst, src)
        check.copy("cast", torch.empty(8, device="cuda", dtype=torch.float64), src[:8].double())
        names = check.bad()
        assert set(names) == {f"bad@{at}"} | ({"cast"} if at == 0 else set()), names
        assert torch.equal(dst[at].isnan(), src[at].isnan()) and (value != value or dst[at] == value)
        src[at] = 0


def test_a_bucket_is_copied_and_checked_by_one_launch_per_dtype():
    """FiniteCheck.copy_many as a receive unpacks a bucket: bf16 and fp32 tensors of many sizes (one launch per
    dtype), a float64, a non-contiguous and a misaligned one (the copy, then min/max); exactly the poisoned ones
    are named and every byte lands, over two buckets (their flags in host memory the kernel writes)."""
    from server.model.finite import FiniteCheck

    torch.manual_seed(0)
    sizes = [1, 100, 8192, 8192 * 3 + 5, 1 << 20]
    sources = [(f"bf16.{n}", torch.randn(n, device="cuda", dtype=torch.bfloat16)) for n in sizes]
    sources += [(f"fp32.{n}", torch.randn(n, device="cuda")) for n in sizes]
    sources += [("fp64", torch.randn(64, device="cuda", dtype=torch.float64)),
                ("strided", torch.randn(64, 2, device="cuda")[:, 0]),
                ("unaligned", torch.randn(65, device="cuda", dtype=torch.bfloat16)[1:])]  # 2 bytes off: not fused
    poisoned = {"bf16.8192": (8191, float("inf")), "fp32.24581": (24580, float("nan")), "fp64": (0, float("-inf")),
                "unaligned": (5, float("nan"))}
    for name, (at, value) in poisoned.items():
        dict(sources)[name][at] = value
    check = FiniteCheck()
    triples = [(name, torch.empty_like(src), src) for name, src in sources]
    check.copy_many(triples[:6])
    check.copy_many(triples[6:])
    assert sorted(check.bad()) == sorted(poisoned)
    for _, dst, src in triples:
        assert torch.equal(dst.isnan(), src.isnan()) and torch.equal(dst.nan_to_num(), src.nan_to_num())


@pytest.mark.parametrize("enabled", [True, False])
def test_a_packed_bucket_is_copied_by_address_as_its_views_would_be(enabled):
    """FiniteCheck.copy_packed on a CUDA bucket (a received IPC bucket's path): the kernel reads each aligned
    tensor in place, the others go through their views; every byte lands as UncheckedCopy's view copies land
    it, and, checked, exactly the poisoned tensors are named (one the kernel read, one copied from its view)."""
    from server.model.finite import FiniteCheck
    from server.weight_transfer.protocol import TensorMeta, pack_into, view_at
    from server.weight_transfer.unchecked_copy import UncheckedCopy

    torch.manual_seed(0)
    specs = [("a", torch.bfloat16, (8192 * 3 + 8,)), ("b", torch.float32, (64, 4)), ("skipped", torch.bfloat16, (8,)),
             ("c", torch.float16, (1 << 20,)), ("f64", torch.float64, (2,)), ("odd", torch.bfloat16, (3,)),
             ("misaligned", torch.float32, (9,)), ("g", torch.bfloat16, (33,))]
    metas = [TensorMeta(name, dtype, shape) for name, dtype, shape in specs]
    sources = [torch.randn(shape, device="cuda").to(dtype) for _, dtype, shape in specs]
    sources[0][-1], sources[6][2] = float("nan"), float("inf")
    bucket = torch.empty(sum(m.nbytes for m in metas), dtype=torch.uint8, device="cuda")
    pack_into(bucket, sources)

    def targets():
        return {name: torch.full(shape, 7, dtype=dtype, device="cuda") for name, dtype, shape in specs
                if name != "skipped"}

    want, got, check = targets(), targets(), FiniteCheck(enabled)
    UncheckedCopy().copy_packed(bucket, metas, want, view_at)
    assert sorted(check.copy_packed(bucket, metas, got, view_at)) == sorted(got)
    assert sorted(check.bad()) == (["a", "misaligned"] if enabled else [])
    for name in got:
        assert torch.equal(got[name].nan_to_num(), want[name].nan_to_num()), name
