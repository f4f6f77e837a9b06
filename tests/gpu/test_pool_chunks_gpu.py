"""Chunked tensors and prepared backups on the CUDA backend: a wake maps the first chunk, the rest come
in the background, addresses stay, pinned backups made ahead restore bit-exact, and an engine whose KV
cache wakes in chunks gives the same greedy outputs (graphs included)."""
from __future__ import annotations

import pytest
import torch

from allocator import create_pool
from server import LLM, SamplingParams
from testkit.models import model_folder

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def test_chunked_tensor_wakes_in_chunks_at_the_same_address():
    pool = create_pool("cuda")
    try:
        gran = pool.granularity
        blocks, rows, width = 16, 4, gran // 2  # bf16: a block is 4 granules
        bounds = [0, 2, 6, 16]
        t = pool.empty_chunked((blocks, rows, width), torch.bfloat16, "kv_cache", bounds=bounds)
        ptr = t.data_ptr()
        assert pool.tag_of(t) == "kv_cache" and pool.tag_of(t[-1, -1]) == "kv_cache"
        t.fill_(3)
        assert pool.stats().tags["kv_cache"].bytes == t.numel() * 2
        for _ in range(3):
            free_awake = torch.cuda.mem_get_info()[0]
            pool.sleep(discard_tags=["kv_cache"])
            assert torch.cuda.mem_get_info()[0] - free_awake >= t.numel() * 2 - 2 * gran
            assert pool.chunks_ready("kv_cache") == 0
            pool.wake_up()
            assert pool.chunks_ready("kv_cache") >= 1
            t[:bounds[1]].fill_(1)  # the first chunk is usable at once
            assert pool.wait_chunks("kv_cache", 3, timeout=60) == 3
            t[bounds[1]:].fill_(2)
            torch.cuda.synchronize()
            assert t.data_ptr() == ptr
            assert t.float().sum().item() == rows * width * (2 * 1 + 14 * 2)
    finally:
        pool.close()


def test_prepared_backup_restores_bit_exact():
    pool = create_pool("cuda")
    try:
        with pool.use("weights"):
            w = torch.randn(64 * MiB // 2, dtype=torch.bfloat16, device="cuda")
        expected = w.clone()
        assert pool.prepare_backups(["weights"], only_if_room=False) >= w.numel() * 2
        pool.wait_prepared()
        assert pool.prepare_error is None
        assert pool.stats().host_backup_bytes >= w.numel() * 2
        for _ in range(2):
            pool.sleep(offload_tags=["weights"])
            pool.wake_up()
            assert torch.equal(w, expected)
        del expected
    finally:
        pool.close()


def test_engine_with_a_chunked_kv_cache_keeps_its_outputs(tmp_path):
    folder = model_folder("llama-tiny", tmp_path)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=str(folder), device="cuda", load_format="dummy", kv_cache_memory="512MiB", max_num_seqs=8,
              kv_wake_chunk="32MiB", prepare_backups="on")
    try:
        core = llm.engine
        assert len(core.kv_plan.chunk_bounds) >= 3 and core.runner.kv_chunked
        # Block-major (server/model/kv_layout.py): each chunk is one physical handle up to 2 GiB, whatever the layers.
        assert core.pool.stats().tags["kv_cache"].allocations == len(core.kv_plan.chunk_bounds) - 1  # chunks < 2 GiB
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        for level in (1, 2, 1):
            llm.sleep(level=level)
            llm.wake_up()
            if level == 2:
                llm.update_weights()
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.close()
