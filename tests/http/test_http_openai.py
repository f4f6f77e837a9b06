"""The OpenAI routes through the real server: completions, chat, streaming, usage, stop strings, n > 1,
logprobs, echo, token-id prompts, the `openai` client, auth, unknown model, over-context, metrics."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from testkit.http_server import MAIN_KEY, main_server

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=MAIN_KEY, max_retries=0, timeout=120)


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": "smol", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(response: httpx.Response) -> list[tuple[float, str]]:
    """(arrival time, data) for each SSE event, as they arrive."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append((time.monotonic(), line[len("data: "):]))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def test_completion_shape_and_usage(client):
    body = complete(client, prompt=PROMPT, max_tokens=6)
    assert body["object"] == "text_completion" and body["model"] == "smol" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"].strip()
    usage = body["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens"] == 5  # SmolLM2's tokenizer: "The capital of France is"
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6


def test_greedy_is_deterministic_and_token_prompt_matches_text(client):
    a = complete(client, prompt=PROMPT, max_tokens=6)["choices"][0]["text"]
    b = complete(client, prompt=[PROMPT], max_tokens=6)["choices"][0]["text"]
    assert a == b
    # The same prompt as token ids (from the server's own tokenizer) gives the same text.
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    tokens = complete(client, prompt=ids, max_tokens=6)
    assert tokens["usage"]["prompt_tokens"] == len(ids) == 5
    assert tokens["choices"][0]["text"] == a


def test_echo_prepends_the_prompt(client):
    plain = complete(client, prompt=PROMPT, max_tokens=4)["choices"][0]["text"]
    echoed = complete(client, prompt=PROMPT, max_tokens=4, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + plain


def test_stop_string_cuts_the_text(client):
    full = complete(client, prompt=PROMPT, max_tokens=8)["choices"][0]["text"]
    assert "." in full, full  # " Paris.\n\n..." on the default model
    cut = complete(client, prompt=PROMPT, max_tokens=8, stop=["."])["choices"][0]
    assert cut["text"] == full[: full.index(".")] and cut["finish_reason"] == "stop" and cut["stop_reason"] == "."
    kept = complete(client, prompt=PROMPT, max_tokens=8, stop=".", include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == full[: full.index(".") + 1]


def test_n_choices_with_seed(client):
    body = complete(client, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 15
    again = complete(client, prompt=PROMPT, max_tokens=5, n=3, temperature=1.0, seed=7)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]


def test_completion_logprobs(client):
    body = complete(client, prompt=PROMPT, max_tokens=4, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and len(top) == 3
        assert top[token] == pytest.approx(value)  # greedy: the chosen token is the best one
        assert max(top.values()) == pytest.approx(value)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_chat_completion_and_logprobs(client):
    r = client.post("/v1/chat/completions", json={
        "model": "smol", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 6
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert body["usage"]["prompt_tokens"] > 10  # the chat template added its turn markers


def test_openai_client_completion_chat_and_stream(oai):
    comp = oai.completions.create(model="smol", prompt=PROMPT, max_tokens=5, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 5
    chat = oai.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0)
    assert chat.choices[0].message.content
    stream = oai.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    models = oai.models.list()
    assert [m.id for m in models.data] == ["smol"]


STREAM_PROMPTS = ["The capital of France is", "\u4f60\u597d\uff0c\u4e16\u754c", "def add(a, b):\n",
                  "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_the_whole_text(oai, skip_special_tokens):
    """A stream without stop strings has its text made in the API process (SamplingParams.text_by_api), from
    the token ids the engine sends: streamed, it equals the whole answer the engine decodes, for completions
    and chat, with special tokens skipped or shown (the model ends its turn, ignore_eos goes on past it)."""
    extra = {"ignore_eos": True, "skip_special_tokens": skip_special_tokens}
    for prompt in STREAM_PROMPTS:
        whole = oai.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0,
                                       extra_body=extra).choices[0].text
        chunks = list(oai.completions.create(model="smol", prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                             extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks) == whole, prompt
        assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 5
        messages = [{"role": "user", "content": prompt}]
        whole = oai.chat.completions.create(model="smol", messages=messages, max_tokens=32, temperature=0,
                                            extra_body=extra).choices[0].message.content
        chunks = list(oai.chat.completions.create(model="smol", messages=messages, max_tokens=32, temperature=0,
                                                  stream=True, extra_body=extra))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole, prompt
    if not skip_special_tokens:  # the chat prompt's answer went past its <|im_end|>, which shows
        assert "<|im_end|>" in whole


def test_a_streamed_stop_string_still_stops(oai):
    """With a stop string the engine makes the text as it goes (it checks the string on it): streamed and
    whole end alike, before the stop string."""
    whole = oai.completions.create(model="smol", prompt=PROMPT, max_tokens=32, temperature=0, extra_body={
        "ignore_eos": True}).choices[0].text
    stop = whole.split()[2]  # a word the answer reaches
    stopped = oai.completions.create(model="smol", prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop])
    chunks = list(oai.completions.create(model="smol", prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop],
                                         stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == stopped.choices[0].text == whole[:whole.index(stop)]
    assert chunks[-1].choices[0].finish_reason == stopped.choices[0].finish_reason == "stop"


def test_stream_chunks_arrive_before_the_end(client):
    reference = complete(client, prompt=PROMPT, max_tokens=20, ignore_eos=True)["choices"][0]["text"]
    start = time.monotonic()
    with client.stream("POST", "/v1/completions", json={
            "model": "smol", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    end = time.monotonic()
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # Tokens arrive as they are made: the first long before the stream ends, and spread out in time.
    times = [t for t, _ in events]
    assert len(chunks) >= 10
    assert times[0] - start < 0.6 * (end - start), (times[0] - start, end - start)
    assert times[len(times) // 2] < times[-1] - 0.05


def test_stream_usage_and_n(client):
    with client.stream("POST", "/v1/completions", json={
            "model": "smol", "prompt": PROMPT, "max_tokens": 4, "n": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(c["usage"] is None for c in body)
    texts = {0: "", 1: ""}
    for c in body:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
    single = complete(client, prompt=PROMPT, max_tokens=4)["choices"][0]["text"]
    assert texts == {0: single, 1: single}  # greedy: both choices equal the single answer


def test_chat_stream_starts_with_role_and_ends_with_finish(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "stream": True}) as r:
        events = sse_events(r)
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_auth_guards_v1_but_not_health(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": MAIN_KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_model_is_404(client, oai):
    r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "smol" in err["message"]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "x"}])


def test_prompt_over_the_context_is_400(client):
    long_prompt = "hello " * 1100  # --max-model-len 1024
    for path, body in (("/v1/completions", {"prompt": long_prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]})):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "1024" in err["message"]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1020})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most 1019" in r.json()["error"]["message"]


def test_dev_routes_are_absent_without_dev_mode(server):
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/update_weights"), ("GET", "/memory")):
        r = httpx.request(method, server.url + path, headers=server.headers())
        assert r.status_code == 404, (path, r.text)
        assert "--dev-mode" in r.json()["error"]["message"]


def test_metrics_count_tokens_and_latencies(server, client):
    before = server.metric("sleepserve_generation_tokens_total")
    ttft_before = server.metric("sleepserve_time_to_first_token_seconds_count")
    complete(client, prompt=PROMPT, max_tokens=3)
    assert server.metric("sleepserve_generation_tokens_total") == before + 3
    assert server.metric("sleepserve_time_to_first_token_seconds_count") == ttft_before + 1
    assert server.metric("sleepserve_kv_cache_blocks_total") > 0
    assert server.metric("sleepserve_engine_state", '{state="awake"}') == 1
    assert server.metric("sleepserve_pool_bytes", '{state="awake",tag="weights"}') > 100e6
    assert 0 <= server.metric("sleepserve_prefix_cache_hit_rate") <= 1


def test_access_log_has_status_and_latency(server, client):
    client.get("/v1/models")
    line = [ln for ln in server.log_text().splitlines() if '"GET /v1/models HTTP/1.1" 200' in ln]
    assert line and line[-1].rstrip().endswith("ms"), line
    log = server.log_text()
    for needle in ("device cpu", "dtype float32", "KV cache:", "GiB", "max model len 1024", "dev routes: off"):
        assert needle in log, needle


def test_streamed_logprobs_match_non_streamed(client):
    whole = complete(client, prompt=PROMPT, max_tokens=5, logprobs=2)["choices"][0]["logprobs"]
    with client.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2, "stream": True}) as r:
        chunks = [json.loads(d) for _, d in sse_events(r)[:-1]]
    tokens, offsets = [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
    assert tokens == whole["tokens"] and offsets == whole["text_offset"]
    with client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "stream": True,
            "logprobs": True, "top_logprobs": 1}) as r:
        chunks = [json.loads(d) for _, d in sse_events(r)[:-1]]
    content = [row for c in chunks if c["choices"][0]["logprobs"] for row in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == 3 and all(len(row["top_logprobs"]) == 1 for row in content)
