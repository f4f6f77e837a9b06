"""Structured outputs through the real server: sampled (temperature 1) outputs always match the JSON
schema, regex, choice or grammar they were asked for, by every field name clients use."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from testkit.http_server import main_server

pytestmark = pytest.mark.timeout(600)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}}}


@pytest.fixture(scope="module")
def client():
    with main_server().client(timeout=600) as c:
        yield c


def texts(client, path: str, n: int, **body) -> list[str]:
    r = client.post(path, json={"temperature": 1.0, "n": n, "seed": 1, "max_tokens": 64, **body})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


def test_fifty_sampled_json_schema_completions_validate(client):
    # 2 prompts x n=25 in one request: 50 samples decoded as one batch.
    outs = texts(client, "/v1/completions", 25, prompt=["A person as JSON:", "Describe someone:"],
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert len(outs) == 50
    for text in outs:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(outs)) > 1  # sampled, not one answer repeated


def test_regex_and_choice_by_every_field_name(client):
    pattern = r"[0-9]{3}-[0-9]{4}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        for text in texts(client, "/v1/completions", 10, prompt="Phone number:", **body):
            assert re.fullmatch(pattern, text), text
    colors = ["red", "green", "blue"]
    for body in ({"structured_outputs": {"choice": colors}}, {"guided_choice": colors}):
        outs = texts(client, "/v1/completions", 10, prompt="Pick a color:", **body)
        assert set(outs) <= set(colors)


def test_chat_json_object_guided_json_and_grammar(client):
    msgs = [{"role": "user", "content": "Give me a JSON object about a cat."}]
    # Any object: sampled, a small model may nest forever; greedy closes it.
    for text in texts(client, "/v1/chat/completions", 1, messages=msgs, max_tokens=128, temperature=0,
                      response_format={"type": "json_object"}):
        assert isinstance(json.loads(text), dict)
    for text in texts(client, "/v1/chat/completions", 6, messages=msgs, guided_json=SCHEMA):
        jsonschema.validate(json.loads(text), SCHEMA)
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9]/'
    for text in texts(client, "/v1/completions", 6, prompt="Answer:", structured_outputs={"grammar": grammar}):
        assert re.fullmatch(r"yes|no|maybe [1-9]", text), text


def test_streamed_structured_output(client):
    with client.stream("POST", "/v1/completions", json={
            "prompt": "A person as JSON:", "max_tokens": 64, "temperature": 1.0, "seed": 4, "stream": True,
            "structured_outputs": {"json": SCHEMA}}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(d) for d in data[:-1]]
    jsonschema.validate(json.loads("".join(c["choices"][0]["text"] for c in chunks)), SCHEMA)
