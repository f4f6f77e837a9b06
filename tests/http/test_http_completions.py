"""The completions surface RL trainers and evaluation harnesses use, through the real server: several
prompts per request (whole and streamed), token ids in responses, logprobs=0, echo with log-probs,
GET /v1/models/{id}, and the chat template options."""
from __future__ import annotations

import json

import pytest
from testkit.http_server import main_server

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):"]


@pytest.fixture(scope="module")
def client():
    with main_server().client() as c:
        yield c


def post(client, path: str, **body) -> dict:
    r = client.post(path, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, path: str, **body) -> list[dict]:
    with client.stream("POST", path, json={"temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_several_prompts_are_prompt_major_and_match_single_requests(client):
    body = post(client, "/v1/completions", prompt=PROMPTS, n=2, max_tokens=5, return_token_ids=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for p, prompt in enumerate(PROMPTS):
        single = post(client, "/v1/completions", prompt=prompt, max_tokens=5, return_token_ids=True)["choices"][0]
        for c in choices[2 * p:2 * p + 2]:
            assert (c["text"], c["token_ids"], c["prompt_token_ids"]) == \
                (single["text"], single["token_ids"], single["prompt_token_ids"])
    usage = body["usage"]
    assert usage["completion_tokens"] == 30
    assert usage["prompt_tokens"] == sum(len(c["prompt_token_ids"]) for c in choices[::2])


def test_token_id_prompts_batched(client):
    ids = [client.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS[:2]]
    by_ids = post(client, "/v1/completions", prompt=ids, max_tokens=4, return_token_ids=True)["choices"]
    by_text = post(client, "/v1/completions", prompt=PROMPTS[:2], max_tokens=4)["choices"]
    assert [c["prompt_token_ids"] for c in by_ids] == ids
    assert [c["text"] for c in by_ids] == [c["text"] for c in by_text]


def test_several_prompts_stream_with_indexes_token_ids_and_usage(client):
    whole = post(client, "/v1/completions", prompt=PROMPTS, n=2, max_tokens=4, return_token_ids=True)
    chunks = stream(client, "/v1/completions", prompt=PROMPTS, n=2, max_tokens=4, return_token_ids=True,
                    stream_options={"include_usage": True})
    *body, last = chunks
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    text, ids, prompt_ids, finish = {}, {}, {}, {}
    for c in body:
        (ch,) = c["choices"]
        i = ch["index"]
        text[i] = text.get(i, "") + ch["text"]
        ids[i] = ids.get(i, []) + ch["token_ids"]
        if "prompt_token_ids" in ch:
            assert i not in prompt_ids  # only on a choice's first chunk
            prompt_ids[i] = ch["prompt_token_ids"]
        finish[i] = ch["finish_reason"]
    for c in whole["choices"]:
        i = c["index"]
        assert (text[i], ids[i], prompt_ids[i], finish[i]) == \
            (c["text"], c["token_ids"], c["prompt_token_ids"], c["finish_reason"])


def test_logprobs_zero_returns_the_sampled_token(client):
    c = post(client, "/v1/completions", prompt=PROMPTS[0], max_tokens=4, logprobs=0,
             return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {tok: value} and value <= 0


def test_echo_with_logprobs_lists_the_prompt_tokens(client):
    c = post(client, "/v1/completions", prompt=PROMPTS[0], max_tokens=3, echo=True, logprobs=2,
             return_token_ids=True)["choices"][0]
    lp, n_prompt = c["logprobs"], len(c["prompt_token_ids"])
    assert len(lp["tokens"]) == n_prompt + 3
    assert "".join(lp["tokens"]) == c["text"] and c["text"].startswith(PROMPTS[0])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) in (2, 3) for t in lp["top_logprobs"][1:])  # top 2, plus the token when it ranks lower
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # The same prompt's vLLM-style prompt_logprobs carry the same numbers.
    v = post(client, "/v1/completions", prompt=PROMPTS[0], max_tokens=1, prompt_logprobs=0,
             return_token_ids=True)["choices"][0]
    assert v["prompt_logprobs"][0] is None and len(v["prompt_logprobs"]) == n_prompt
    scored = [e[str(t)]["logprob"] for e, t in zip(v["prompt_logprobs"][1:], v["prompt_token_ids"][1:])]
    assert scored == pytest.approx(lp["token_logprobs"][1:n_prompt], abs=1e-4)
    # Streamed: the first chunk carries the echo and the prompt's log-probs.
    chunks = stream(client, "/v1/completions", prompt=PROMPTS[0], max_tokens=3, echo=True, logprobs=2)
    tokens = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
    assert tokens == lp["tokens"] and "".join(ch["choices"][0]["text"] for ch in chunks) == c["text"]


def test_retrieve_model(client):
    r = client.get("/v1/models/smol")
    assert r.status_code == 200 and r.json()["id"] == "smol" and r.json()["object"] == "model"
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_token_ids_whole_and_streamed(client):
    msgs = [{"role": "user", "content": "Name a color."}]
    whole = post(client, "/v1/chat/completions", messages=msgs, max_tokens=5, return_token_ids=True, logprobs=True,
                 top_logprobs=0, return_tokens_as_token_ids=True)
    ids = client.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert whole["prompt_token_ids"] == ids
    choice = whole["choices"][0]
    assert [row["token"] for row in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(row["top_logprobs"] == [] for row in choice["logprobs"]["content"])
    chunks = stream(client, "/v1/chat/completions", messages=msgs, max_tokens=5, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == ids
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == choice["token_ids"]


def test_chat_continue_final_message_and_templates(client):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! My name is"}]
    cont = post(client, "/v1/chat/completions", messages=msgs, max_tokens=4, add_generation_prompt=False,
                continue_final_message=True, return_token_ids=True)
    ids = cont["prompt_token_ids"]
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("Hello! My name is")  # no end-of-turn after the assistant's prefill
    plain = post(client, "/v1/chat/completions", messages=msgs, max_tokens=4, return_token_ids=True)
    assert len(plain["prompt_token_ids"]) > len(ids)
    # A custom template, custom roles and documents reach the template.
    template = ("{% for d in documents %}[doc {{ d.title }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<go>")
    custom = post(client, "/v1/chat/completions", messages=[{"role": "narrator", "content": "Once"}], max_tokens=2,
                  chat_template=template, documents=[{"title": "A", "text": "x"}], return_token_ids=True)
    rendered = client.post("/detokenize", json={"tokens": custom["prompt_token_ids"]}).json()["prompt"]
    assert rendered == "[doc A]<narrator>Once<go>"
