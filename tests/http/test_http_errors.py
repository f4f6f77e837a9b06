"""Bad input never yields a 500: each answers a 4xx in OpenAI's error shape with a message saying what
to fix, and the server keeps serving afterwards."""
from __future__ import annotations

import httpx
import pytest
from testkit.http_server import main_server

pytestmark = pytest.mark.timeout(300)

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]

# (path, body: bytes sent as-is or a JSON value, status, words the message must contain, param)
CASES = [
    (C, b"{not json", 400, "not valid JSON", None),
    (C, b"", 400, "body is empty", None),
    (C, b"\xff\xfe{\"prompt\": 1}", 400, "not valid UTF-8", None),
    (C, '{"prompt": "caf\xe9"}'.encode("latin-1"), 400, "not valid UTF-8", None),
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "finite number", None),
    (C, [1, 2, 3], 400, "must be a JSON object", None),
    (C, "just a string", 400, "must be a JSON object", None),
    (C, {}, 400, "prompt is required", "prompt"),
    (C, {"prompt": ""}, 400, "prompt is empty", "prompt"),
    (C, {"prompt": []}, 400, "an empty list", "prompt"),
    (C, {"prompt": [1.5, 2]}, 400, "prompt[0] must be a string or a list of token ids", "prompt"),
    (C, {"prompt": ["a", ""]}, 400, "prompt[1] is empty", "prompt"),
    (C, {"prompt": ["a", [1, 10 ** 9]]}, 400, "prompt[1]: prompt token ids must be in", "prompt"),
    (C, {"prompt": ["a", "hello " * 1100]}, 400, "prompt[1]: the prompt has", "prompt"),
    (C, {"prompt": [10 ** 9]}, 400, "token ids must be in", "prompt"),
    (C, {"prompt": {"text": "x"}}, 400, "prompt must be", "prompt"),
    (C, {"prompt": "x", "max_tokens": "many"}, 400, "valid integer", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 10 ** 30}, 400, "lower max_tokens", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "max_tokens"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "valid number", "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    (C, {"prompt": "x", "top_k": 10 ** 20}, 400, "top_k", "top_k"),
    (C, {"prompt": "x", "n": 0}, 400, "n", "n"),
    (C, {"prompt": "x", "n": 10 ** 6}, 400, "n", "n"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    (C, {"prompt": "x", "prompt_logprobs": 101}, 400, "prompt_logprobs must be between 0 and 100", "prompt_logprobs"),
    (C, {"prompt": "x", "seed": 2 ** 70}, 400, "seed", "seed"),
    (C, {"prompt": "x", "seed": 2 ** 63}, 400, "signed 64-bit", "seed"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "only allowed with stream: true",
     "stream_options"),
    (C, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search is not supported", "use_beam_search"),
    (C, {"prompt": "x", "bad_words": ["no"]}, 400, "bad_words is not supported", "bad_words"),
    (C, {"prompt": "x", "allowed_token_ids": [1, 2]}, 400, "allowed_token_ids is not supported",
     "allowed_token_ids"),
    (C, {"prompt": "x", "logits_processors": ["a"]}, 400, "logits_processors is not supported", "logits_processors"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 5}, 400, "truncate_prompt_tokens is not supported",
     "truncate_prompt_tokens"),
    (C, {"prompt": "x", "length_penalty": 2.0}, 400, "length_penalty is not supported", "length_penalty"),
    (C, {"prompt": "x", "guided_regex": "[0-9"}, 400, "could not be compiled", "guided_regex"),
    (C, {"prompt": "x", "guided_json": "{not json"}, 400, "could not be compiled", "guided_json"),
    (C, {"prompt": "x", "structured_outputs": {"grammar": "start: ("}}, 400, "could not be compiled",
     "structured_outputs"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "exactly one of",
     "structured_outputs"),
    (C, {"prompt": "x", "structured_outputs": {"whitespace_pattern": " "}}, 400, "whitespace_pattern",
     "structured_outputs"),
    (C, {"prompt": "x", "structured_outputs": {"choice": "red"}}, 400, "list of strings", "structured_outputs"),
    (C, {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400, "both constrain", "guided_choice"),
    (C, {"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "needs", "response_format"),
    (C, {"prompt": "x", "response_format": {"type": "yaml"}}, 400, "'yaml' is not supported", "response_format"),
    (C, {"prompt": "x", "stop": 5}, 400, "expected str or list[str]", "stop"),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
    (C, {"prompt": "x", "stop_token_ids": [10 ** 9]}, 400, "token ids must be in", "stop_token_ids"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias keys must be token ids", "logit_bias"),
    (C, {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens", "min_tokens"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty must be in (0, 100]",
     "repetition_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 101}, 400, "repetition_penalty must be in (0, 100]",
     "repetition_penalty"),
    (C, {"prompt": "x", "stream": "yes please"}, 400, "valid boolean", "stream"),
    (C, {"prompt": "x", "suffix": "end"}, 400, "suffix", "suffix"),
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of", "best_of"),
    (CHAT, {"messages": []}, 400, "messages is empty", "messages"),
    (CHAT, {}, 400, "messages is required", "messages"),
    (CHAT, {"messages": "Hi"}, 400, "valid list", "messages"),
    (CHAT, {"messages": [{"content": "Hi"}]}, 400, "messages[0].role is required", "messages[0].role"),
    (CHAT, {"messages": [{"role": "", "content": "Hi"}]}, 400, "role is empty", "messages[0].role"),
    (CHAT, {"messages": MSG, "echo": True}, 400, "echo is not supported", "echo"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, 400, "add_generation_prompt: false",
     "continue_final_message"),
    (CHAT, {"messages": MSG, "continue_final_message": True, "add_generation_prompt": False}, 400,
     "assistant message last", "continue_final_message"),
    (CHAT, {"messages": MSG, "chat_template": "{% for m in messages %}{{ m.nope() }}{% endfor %}"}, 400,
     "chat template could not render", "messages"),
    (CHAT, {"messages": MSG, "reasoning_effort": "high"}, 400, "reasoning_effort is not supported",
     "reasoning_effort"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "content is required", "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, "expected str or list", "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "only text parts", "messages[0].content"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "needs logprobs", "top_logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools is not supported", "tools"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}], "tool_choice": "none"}, 400, "tools is not supported",
     "tools"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}, 400,
     "needs", "response_format"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a"}, 400,
     "both constrain", "guided_regex"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400, "may not set tokenize",
     "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -3}, 400, "max_completion_tokens must be at least 1",
     "max_completion_tokens"),
    ("/v1/nothing-here", {}, 404, "no route", None),
]


@pytest.fixture(scope="module")
def server():
    return main_server()


@pytest.mark.parametrize("path,body,status,words,param", CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_clear_4xx(server, path, body, status, words, param):
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    r = httpx.post(server.url + path, content=content, timeout=60,
                   headers={**server.headers(), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err["message"]
    assert err["param"] == param, err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_unknown_fields_are_ignored(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "metadata": {"a": 1},
                                            "store": False, "some_future_field": [1, 2]})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi", "extra": 1}],
                                                 "max_tokens": 2, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text


def test_form_encoded_body_without_content_type_still_parses(server):
    # curl -d sends application/x-www-form-urlencoded unless told otherwise; the body is JSON anyway.
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                   headers={**server.headers(), "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_wrong_method_is_405_in_openai_shape(server):
    r = httpx.get(server.url + "/v1/completions", headers=server.headers())
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_server_still_serves_after_bad_input(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "Traceback" not in server.log_text()
    assert '" 500 ' not in server.log_text()
