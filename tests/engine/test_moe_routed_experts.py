"""Routed experts (--enable-return-routed-experts): the experts each token was routed to, per sparse layer,
top-k, in vLLM's layout [prompt + generated - 1, sparse layers, k]. They equal the top-k of transformers' own
router logits for the same tokens (over HTTP: tests/http/test_http_moe.py); a request that does not ask gets
none, and asking a dense model or an engine without the flag is refused naming return_routed_experts."""
from __future__ import annotations

import numpy as np
import pytest
from testkit.moe_models import PROMPTS, hf_model, hf_routed, write_checkpoint

from server import LLM, SamplingParams
from server.wire.params import InvalidRequestError

pytestmark = pytest.mark.timeout(600)
ARGS = dict(device="cpu", kv_cache_memory="32MiB", max_model_len=512)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    return {f: write_checkpoint(f, root) for f in ("qwen3_moe", "mixtral")}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routed_experts_equal_transformers_router_top_k(family, folders):
    model = hf_model(family)
    # 8 tokens a step: prompts are prefilled in chunks over several steps (steps that sample nothing).
    with LLM(model=str(folders[family]), enable_return_routed_experts=True, max_num_batched_tokens=8, **ARGS) as llm:
        greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        sampled = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=10, ignore_eos=True))
        quiet = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, return_routed_experts=False))
    layers = len(model.config.mlp_only_layers) if family == "qwen3_moe" else 0
    for out in [*greedy, *sampled]:
        for o in out.outputs:
            ids = out.prompt_token_ids + o.token_ids
            routed = o.routed_experts
            assert routed.dtype == np.uint8 and routed.shape == (len(ids) - 1, 3 - layers, 2)
            assert np.array_equal(routed, hf_routed(model, ids)), f"{family}: {out.prompt!r} seq {o.index}"
    assert quiet[0].outputs[0].routed_experts is None


def test_asking_without_the_flag_or_of_a_dense_model_is_refused(folders, llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, return_routed_experts=True))
    assert e.value.param == "return_routed_experts" and "no experts" in str(e.value)
    with LLM(model=str(folders["mixtral"]), **ARGS) as plain:
        assert plain.generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].outputs[0].routed_experts is None
        with pytest.raises(InvalidRequestError, match="--enable-return-routed-experts") as e:
            plain.generate(PROMPTS[0], SamplingParams(max_tokens=2, return_routed_experts=True))
        assert e.value.param == "return_routed_experts"


def test_the_flag_on_a_dense_model_fails_at_start(default_model_folder):
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(model=str(default_model_folder), enable_return_routed_experts=True, **ARGS)
