"""Mixture-of-experts models at tensor parallelism 2 (gloo on CPU): every expert cut along its intermediate
dimension (w13's gate and up rows, w2's columns), the router whole on every rank, the partial sums
all-reduced. Two ranks give transformers' greedy tokens (and so one rank's), and a level-2 sleep with an
update in stacked names, or a folder in transformers 5's stacked names, lands on both ranks."""
from __future__ import annotations

import pytest
import torch
from testkit.moe_models import NEW_TOKENS, PROMPTS, hf_greedy, hf_model, hf_routed, write_checkpoint
from safetensors.torch import save_file

from server import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
ARGS = dict(device="cpu", kv_cache_memory="32MiB", max_model_len=512, tensor_parallel_size=2)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_two_ranks_give_one_ranks_tokens_through_sleep_and_updates(family, tmp_path):
    folder = write_checkpoint(family, tmp_path)
    ref = hf_greedy(folder)
    # Mixtral with routed experts on: rank 0 records them (the router is whole on every rank).
    llm = LLM(model=str(folder), enable_return_routed_experts=family == "mixtral", **ARGS)
    try:
        cfg = llm.engine.model.config
        assert cfg.moe_intermediate_size == (48 if family == "mixtral" else 16)
        assert cfg.shared_expert_intermediate_size == (24 if family == "qwen2_moe" else 0)
        assert tokens(llm) == ref
        if family == "qwen2_moe":
            return  # its shared expert is cut like a dense MLP: the parity above is the check
        if family == "mixtral":
            out = llm.generate(PROMPTS[0], GREEDY)[0]
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            assert (out.outputs[0].routed_experts == hf_routed(hf_model(family), ids)).all()
            return  # the update paths are the same code for both families (CI's time)
        llm.sleep(level=1)
        llm.wake_up()
        assert tokens(llm) == ref
        # A folder in transformers 5's in-memory names (what a GGUF conversion writes): stacked gate|up, read whole
        # by each rank, which keeps its rows of both halves (shard.GateUpShard).
        other = tmp_path / "stacked"
        other.mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (folder / f).is_file():
                (other / f).write_bytes((folder / f).read_bytes())
        trained = hf_model(family, seed=1)
        save_file({n: t.detach().contiguous() for n, t in trained.state_dict().items()},
                  str(other / "model.safetensors"))
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights(str(other))
        assert llm.engine.sleep_state.weights_valid
        trained_tokens = tokens(llm)
        assert trained_tokens != ref
        # The same weights as tensors (rank 0 slices them for the worker), then the served checkpoint again.
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights(named_tensors=((n, t.detach()) for n, t in trained.named_parameters()))
        assert llm.engine.sleep_state.weights_valid and tokens(llm) == trained_tokens
        llm.update_weights()
        assert tokens(llm) == ref
    finally:
        procs = [peer.proc for peer in llm.engine.runner.workers.peers.values()]
        llm.close()
        assert [p.wait(30) for p in procs] == [0]


def test_trained_weights_match_transformers_at_two_ranks(tmp_path):
    """The stacked update above served the seed-1 model: its tokens are transformers' for that model."""
    folder = write_checkpoint("qwen3_moe", tmp_path, seed=1)
    ref = hf_greedy(folder)
    with torch.no_grad():
        llm = LLM(model=str(folder), load_format="dummy", **ARGS)
    try:
        trained = hf_model("qwen3_moe", seed=1)
        llm.update_weights(named_tensors=((n, t.detach()) for n, t in trained.named_parameters()))
        assert tokens(llm) == ref
    finally:
        llm.close()
