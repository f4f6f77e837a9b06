"""Routed experts (--enable-return-routed-experts): the experts each token was routed to, per sparse layer,
top-k, in vLLM's layout [prompt + generated - 1, sparse layers, k]. They equal the top-k of transformers' own
router logits for the same tokens, in process and over HTTP (base64 of the array's bytes, docs/moe.md); a
request that does not ask gets none, and asking a dense model or a server without the flag is a 400 naming
return_routed_experts (over HTTP: test_moe.py's server, started without the flag)."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from testkit.http_server import BASE_ARGS, ServerProcess
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


def decode(field: dict) -> np.ndarray:
    raw = base64.b64decode(field["data"])
    return np.frombuffer(raw, dtype=np.dtype(field["dtype"]).newbyteorder("<")).reshape(field["shape"])


def test_routed_experts_over_http(folders):
    folder = folders["qwen3_moe"]
    model = hf_model("qwen3_moe")
    server = ServerProcess([str(folder), *BASE_ARGS, "--enable-return-routed-experts"]).start()
    try:
        url = server.url
        body = {"prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_routed_experts": True, "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": PROMPTS[:2]}, timeout=120)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            ids = r.json()["choices"][choice["index"]]["prompt_token_ids"] + choice["token_ids"]
            assert np.array_equal(decode(choice["routed_experts"]), hf_routed(model, ids))
        # Streaming: with the choice's last chunk.
        with httpx.stream("POST", url + "/v1/completions", json={**body, "prompt": PROMPTS[2], "stream": True},
                          timeout=120) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
        prompt_ids = next(c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"][0].get("prompt_token_ids"))
        ids = prompt_ids + [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
        assert len(ends) == 1 and np.array_equal(decode(ends[0]["routed_experts"]), hf_routed(model, ids))
        # Chat, whole and streamed; and a request that does not ask gets no field.
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "return_routed_experts": True, "return_token_ids": True}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        whole = r.json()
        ids = whole["prompt_token_ids"] + whole["choices"][0]["token_ids"]
        assert np.array_equal(decode(whole["choices"][0]["routed_experts"]), hf_routed(model, ids))
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
        assert np.array_equal(decode(ends[0]["routed_experts"]), decode(whole["choices"][0]["routed_experts"]))
        r = httpx.post(url + "/v1/completions", json={**body, "return_routed_experts": False}, timeout=120)
        assert all("routed_experts" not in c for c in r.json()["choices"])
    finally:
        server.stop()


def test_the_flag_on_a_dense_model_fails_at_start(default_model_folder):
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(model=str(default_model_folder), enable_return_routed_experts=True, **ARGS)
