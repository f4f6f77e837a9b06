"""A mixture-of-experts model through the real server (one server, a small random Qwen3-MoE made with
transformers' own classes, started with --enable-return-routed-experts): greedy text equals transformers',
routed experts on both generation routes (whole and streamed, base64 of the array's bytes: docs/moe.md) equal
the top-k of transformers' router logits, an expert of the wrong shape in a weight update is a 400 naming it
with nothing written, and return_routed_experts of a dense model is a 400 naming the field."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.http_server import BASE_ARGS, ServerProcess, hold_server
from testkit.moe_models import NEW_TOKENS, PROMPTS, hf_greedy, hf_model, hf_routed, write_checkpoint

pytestmark = pytest.mark.timeout(600)
FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(FAMILY, tmp_path_factory.mktemp("http-moe"))


@pytest.fixture(scope="module")
def server(folder):
    proc = ServerProcess([str(folder), *BASE_ARGS, "--enable-return-routed-experts", "--dev-mode",
                          "--weight-transfer-config", json.dumps({"backend": "gloo"})]).start()
    yield proc
    proc.stop()


def decode(field: dict) -> np.ndarray:
    raw = base64.b64decode(field["data"])
    return np.frombuffer(raw, dtype=np.dtype(field["dtype"]).newbyteorder("<")).reshape(field["shape"])


def sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_greedy_text_equals_transformers(server, folder):
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"min_tokens": NEW_TOKENS})
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [tok.decode(r, skip_special_tokens=True) for r in hf_greedy(folder)]
    assert all(not hasattr(c, "routed_experts") or c.routed_experts is None for c in got.choices)  # not asked


def test_routed_experts_on_both_routes(server):
    model = hf_model(FAMILY)
    url = server.url
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_routed_experts": True,
            "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json={**body, "prompt": PROMPTS[:2]}, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        ids = choice["prompt_token_ids"] + choice["token_ids"]
        routed = decode(choice["routed_experts"])
        assert routed.dtype == np.uint8 and np.array_equal(routed, hf_routed(model, ids))
    # Streamed: on the choice's last chunk.
    chunks = sse(url + "/v1/completions", {**body, "prompt": PROMPTS[2]})
    ends = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    prompt_ids = next(c["choices"][0]["prompt_token_ids"] for c in chunks if c["choices"][0].get("prompt_token_ids"))
    ids = prompt_ids + [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert len(ends) == 1 and np.array_equal(decode(ends[0]["routed_experts"]), hf_routed(model, ids))
    # Chat, whole and streamed; and a request that does not ask gets no field.
    chat = {**body, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    whole = r.json()
    ids = whole["prompt_token_ids"] + whole["choices"][0]["token_ids"]
    assert np.array_equal(decode(whole["choices"][0]["routed_experts"]), hf_routed(model, ids))
    ends = [c["choices"][0] for c in sse(url + "/v1/chat/completions", chat)
            if c["choices"] and c["choices"][0].get("finish_reason")]
    assert np.array_equal(decode(ends[0]["routed_experts"]), decode(whole["choices"][0]["routed_experts"]))
    r = httpx.post(url + "/v1/completions", json={**body, "prompt": "Hi", "return_routed_experts": False}, timeout=120)
    assert all("routed_experts" not in c for c in r.json()["choices"])


def test_a_misshapen_expert_is_a_400_naming_it_and_nothing_is_written(server, folder, tmp_path):
    def greedy() -> str:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    before = greedy()
    bad_folder = tmp_path / "bad"
    bad_folder.mkdir()
    named = {n: (t * 1.5).contiguous() for n, t in load_file(str(folder / "model.safetensors")).items()}
    bad = "model.layers.0.mlp.experts.2.down_proj.weight"
    named[bad] = torch.zeros(64, 31)
    save_file(named, str(bad_folder / "model.safetensors"))
    r = httpx.post(server.url + "/update_weights", json={"path": str(bad_folder)}, timeout=120)
    assert r.status_code == 400 and bad in r.json()["error"]["message"], r.text
    # The weight-transfer body: names and shapes announced, refused before any rendezvous or byte.
    for name, shape in [(bad, [64, 31]), ("model.layers.0.mlp.experts.w13_weight", [8, 64, 63]),
                        ("model.layers.2.mlp.experts.gate_up_proj", [8, 63, 64])]:
        info = {"names": [name], "dtype_names": ["float32"], "shapes": [shape]}
        r = httpx.post(server.url + "/update_weights", json={"update_info": info}, timeout=120)
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/is_sleeping", timeout=30).json()["weights_valid"] is True
    assert greedy() == before


def test_return_routed_experts_of_a_dense_model_is_a_400_naming_the_field():
    for route, body in [("completions", {"prompt": "Hi"}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
        r = httpx.post(f"{hold_server().url}/v1/{route}", timeout=120,
                       json={**body, "max_tokens": 2, "return_routed_experts": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts", r.text
