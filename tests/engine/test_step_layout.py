"""The step's one host-to-device copy (ModelRunner.to_device): every segment holds what the step says and
starts 16-byte aligned from the copy's start, whatever the batch's size. Triton compiles a kernel variant
per pointer alignment, so a segment whose alignment moved with the batch compiled on the GPU mid-serving
(~1 s, every stream stalled; tests/gpu/test_no_compile_mid_serving_gpu.py counts the variants there).
This is the layout's half of that rule, checked on the CPU."""
from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from server.engine.kv_cache import NULL_BLOCK
from server.engine.host_batch import HostBatch
from testkit.models import model_folder


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    llm = LLM(model=str(model_folder("llama-micro", tmp_path_factory.mktemp("models"))), device="cpu",
              load_format="dummy", kv_cache_memory="16MiB")
    yield llm.engine.runner
    llm.close()


def batch(decodes: int, prompts: list[int], bs: int) -> HostBatch:
    """`decodes` one-token rows (table lengths 1, 2, 3, ...) then one span per prompt length, all on made-up
    blocks: to_device only lays the numbers out."""
    hb = HostBatch([], [], [], [], [], [], [], [])
    for i in range(decodes):
        table = [NULL_BLOCK + 1 + b for b in range(1 + i % 3)]
        pos = len(table) * bs - 1
        hb.ids.append(100 + i)
        hb.positions.append(pos)
        hb.slots.append(table[-1] * bs + pos % bs)
        hb.decode_tables.append(table)
        hb.decode_lens.append(pos + 1)
        hb.sample_rows.append(i)
    for n in prompts:
        offset, table = len(hb.ids), [7 + b for b in range(-(-n // bs))]
        hb.ids.extend(range(200, 200 + n))
        hb.positions.extend(range(n))
        hb.slots.extend(table[p // bs] * bs + p % bs for p in range(n))
        hb.spans.append((offset, n, n, table))
        hb.sample_rows.append(offset + n - 1)
    return hb


@pytest.mark.parametrize("decodes,prompts", [(1, []), (2, []), (3, []), (5, [1, 2]), (0, [3]), (0, [5, 17]),
                                             (4, [9]), (7, [1, 1, 33])])
def test_every_segment_holds_its_values_and_starts_aligned(runner, decodes, prompts):
    hb = batch(decodes, prompts, runner.block_size)
    ids, positions, ctx, rows = runner.to_device(hb)
    base = ids.data_ptr()
    segments = {"positions": positions, "slots": ctx.slot_mapping, "lengths": ctx.context_lens,
                "tables": ctx.block_tables, "rows": rows}
    if ctx.prefill_plan is not None:
        segments |= {"plan tiles": ctx.prefill_plan.tiles, "plan tables": ctx.prefill_plan.tables}
    misaligned = {name: (t.data_ptr() - base) % 16 for name, t in segments.items() if (t.data_ptr() - base) % 16}
    assert not misaligned, f"segments not 16-byte aligned from the copy's start (bytes off): {misaligned}"

    assert ids.tolist() == hb.ids and positions.tolist() == hb.positions
    assert ctx.slot_mapping.tolist() == hb.slots and rows.tolist() == hb.sample_rows
    assert ctx.context_lens.tolist() == hb.decode_lens and ctx.num_decode_tokens == decodes
    assert ctx.block_tables.shape[0] == decodes
    for table, row in zip(hb.decode_tables, ctx.block_tables.tolist()):
        assert row[:len(table)] == table
    plan_tables = ctx.prefill_plan.tables.tolist() if ctx.prefill_plan is not None else []
    assert plan_tables == [b for *_, t in hb.spans for b in t]
    for span, (offset, n, ctx_len, table) in zip(ctx.prefills, hb.spans):
        assert (span.q_start, span.q_len, span.context_len) == (offset, n, ctx_len)
        assert span.block_table.tolist() == table
    assert ids.dtype == torch.long


@pytest.mark.parametrize("max_model_len,block_size", [(16, 16), (24, 16), (128, 128)])
def test_start_up_warm_up_fits_a_short_context(tmp_path, max_model_len, block_size):
    """The start-up's warm-up step (ModelRunner._warm_up, two blocks of prefill) stays inside the rotary tables
    of a context shorter than two blocks, and the engine then serves."""
    llm = LLM(model=str(model_folder("llama-micro", tmp_path)), device="cpu", load_format="dummy",
              kv_cache_memory="16MiB", max_model_len=max_model_len, block_size=block_size)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()
