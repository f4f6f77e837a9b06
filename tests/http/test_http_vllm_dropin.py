"""What vLLM's clients read, through the real server: TRL's VLLMClient (get_server_info, the HTTP side of
init_communicator), /collective_rpc reload_weights, /is_paused and vllm:engine_sleep_state as vLLM reports
them, query-parameter errors named `query.<name>`, weights left invalid after a level-2 sleep answered 503
at once, completion choices' prompt_logprobs, /tokenize's token_strs and chat-template fields, the vLLM
metric families, and weight updates holding NaN or Inf refused (the disk path; the transfer paths are in
test_weight_transfer.py, the GPU ones in tests/gpu/test_nonfinite_gpu.py).

One server: dev mode behind an admin key (no API key), a gloo weight-transfer engine, requests held while
asleep (the default) with a hold timeout far above what any 503 below may take.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from testkit.http_server import BASE_ARGS, ServerProcess, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(300)

ADMIN = "sk-dropin-admin"
NAME = "smol"
HOLD_TIMEOUT_S = 120.0  # a held request that waited this long would fail the "at once" checks below
PROMPT = "The capital of France is"
NORM = "model.layers.0.input_layernorm.weight"  # a small tensor of the default model


@pytest.fixture(scope="module")
def server():
    s = ServerProcess([*BASE_ARGS, "--served-model-name", NAME, "--dev-mode", "--admin-api-key", ADMIN,
                       "--held-request-timeout", str(HOLD_TIMEOUT_S),
                       "--weight-transfer-config", json.dumps({"backend": "gloo"})]).start()
    yield s
    s.stop()


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120, **kw)


def completion(server, **extra) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra})


def greedy(server) -> str:
    r = completion(server)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def state(server) -> dict:
    return admin(server, "GET", "/is_sleeping").json()


def metric(server, name: str, labels: dict[str, str] | None = None) -> float:
    want = {"model_name": NAME, "engine": "0", **(labels or {})}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in want.items()):
                return sample.value
    raise AssertionError(f"{name}{want} is not in /metrics")


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


# -- TRL's VLLMClient --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trl_client(server):
    """TRL's client as docs/rl-clients.md tells a user to make it: the admin key in its session's headers
    (TRL sends none itself). Its constructor refuses to run unless vLLM is importable (nothing of vLLM's
    runs in the HTTP paths tested here), so that one check is patched, and vLLM's get_ip (which
    init_communicator imports from vLLM to name the trainer's address) is given as the loopback address."""
    vllm_client = pytest.importorskip("trl.generation.vllm_client")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
        mp.setattr(vllm_client, "get_ip", lambda: "127.0.0.1", raising=False)
        client = vllm_client.VLLMClient(base_url=server.url, connection_timeout=60)
        client.session.headers["Authorization"] = f"Bearer {ADMIN}"
        yield client


def test_trl_get_server_info_reads_vllm_config(trl_client, server):
    config = trl_client.get_server_info()  # GET /server_info?config_format=json -> ["vllm_config"]
    assert config["weight_transfer_config"]["backend"] == "gloo"
    assert config["model_config"]["logprobs_mode"] in ("raw_logprobs", "processed_logprobs")
    assert config["model_config"]["max_model_len"] == 1024 and config["lora_config"] is None
    assert config["parallel_config"]["data_parallel_size"] == 1
    full = admin(server, "GET", "/server_info").json()  # ours stay where they were, beside vLLM's three keys
    assert full["weight_transfer_config"]["backend"] == "gloo" and full["world_size"] == 1
    assert {"vllm_config", "vllm_env", "system_env"} <= set(full)
    assert isinstance(full["vllm_config"], str)  # vLLM's default config_format=text
    assert not any("KEY" in k for k in full["vllm_env"])
    e = error(admin(server, "GET", "/server_info", params={"config_format": "yaml"}), 400)
    assert e["param"] == "query.config_format"


def test_trl_init_communicator_gets_past_its_http_calls(trl_client):
    """init_communicator reads get_server_info()["weight_transfer_config"] and /get_world_size, then needs a
    CUDA device for its NCCL group: on CPU it stops there, having passed both HTTP reads (the NCCL part runs
    on two GPUs, tests/gpu)."""
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        trl_client.init_communicator(device="cpu")


def test_trl_update_named_params_lands_the_weights_a_disk_load_gives(trl_client, server, default_model_folder,
                                                                      tmp_path, monkeypatch):
    """TRL's update_named_params (its start/update/finish calls, the update announced while the bytes go) over the
    server's gloo engine, the bytes through this package's trainer side in place of vLLM's
    (testkit/trl_trainer_side.py; TRL's init_communicator needs CUDA, so its two init steps are taken as it
    takes them): the server then answers token for token, log-prob for log-prob, as a disk load of the same
    weights, and not as before."""
    import torch
    from safetensors.torch import load_file

    from server.weight_transfer import rendezvous
    from testkit.models import write_trained_checkpoint
    from testkit.trl_trainer_side import init_like_trl, use_this_packages_trainer_side

    def scored() -> list:
        r = completion(server, logprobs=1)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["token_logprobs"]

    trained = write_trained_checkpoint(default_model_folder, tmp_path / "trained", seed=3)
    before = scored()
    assert admin(server, "POST", "/update_weights", json={"path": str(trained)}).status_code == 200
    expected = scored()
    assert expected != before
    try:
        assert admin(server, "POST", "/update_weights", json={"path": str(default_model_folder)}).status_code == 200
        assert scored() == before
        use_this_packages_trainer_side(monkeypatch, server.url, torch.device("cpu"), backend="gloo")
        init_like_trl(trl_client, rendezvous.free_port())
        named = list(load_file(str(trained / "model.safetensors")).items())
        metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named]
        trl_client.update_named_params(metadata, iter(named))
        assert scored() == expected
    finally:
        trl_client.close_communicator()
        admin(server, "POST", "/update_weights", json={"path": str(default_model_folder)})


def test_trl_keyed_client_from_the_docs(server):
    """docs/rl-clients.md's subclass for a server whose /v1 needs the key too: the header is in the session
    before the constructor's first request."""
    vllm_client = pytest.importorskip("trl.generation.vllm_client")

    class KeyedVLLMClient(vllm_client.VLLMClient):
        def __init__(self, *args, api_key: str, **kwargs):
            self._api_key = api_key
            super().__init__(*args, **kwargs)

        def check_server(self, *args, **kwargs):
            self.session.headers["Authorization"] = f"Bearer {self._api_key}"
            self.session.hooks["response"].append(record)  # the test's own eyes, not part of the recipe
            return super().check_server(*args, **kwargs)

    seen: list[tuple[str, str | None]] = []

    def record(r, *args, **kwargs):
        seen.append((r.request.path_url, r.request.headers.get("Authorization")))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
        client = KeyedVLLMClient(base_url=server.url, connection_timeout=60, api_key=ADMIN)
        assert ("/v1/models", f"Bearer {ADMIN}") in seen  # the constructor's own request carried the key
        assert client.get_server_info()["weight_transfer_config"] is not None
        assert client.generate([PROMPT], max_tokens=2, temperature=0.0)["completion_ids"][0]
    assert {key for _, key in seen} == {f"Bearer {ADMIN}"}


def test_trl_without_the_admin_key_is_refused(server):
    vllm_client = pytest.importorskip("trl.generation.vllm_client")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
        client = vllm_client.VLLMClient(base_url=server.url, connection_timeout=60)
    with pytest.raises(Exception, match="401"):
        client.get_server_info()


# -- /collective_rpc -----------------------------------------------------------------------------------

def test_collective_rpc_reload_weights_after_a_level_2_sleep(server):
    before = greedy(server)
    assert admin(server, "POST", "/sleep", params={"level": 2}).status_code == 200
    assert admin(server, "POST", "/wake_up", params={"tags": "weights"}).status_code == 200
    assert state(server)["weights_valid"] is False
    r = admin(server, "POST", "/collective_rpc", json={"method": "reload_weights"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["results"] == [None]  # one entry per worker (one rank), as vLLM's reload_weights returns
    assert body["state"]["weights_valid"] is True and body["report"]["tensors"] > 100
    assert admin(server, "POST", "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert greedy(server) == before


@pytest.mark.parametrize("body, param, words", [
    ({"method": "init_device"}, "method", "'init_device'"),
    ({"method": "reload_weights", "args": ["x"]}, "args", "no arguments"),
    ({"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}}, "kwargs", "no arguments"),
    ({"args": []}, "method", "method is required"),
    ({"method": 3}, "method", "method"),
    ({"method": "reload_weights", "timeout": -1}, "timeout", "timeout"),
    ({"method": "reload_weights", "args": "x"}, "args", "args"),
])
def test_collective_rpc_bad_bodies_answer_400(server, body, param, words):
    e = error(admin(server, "POST", "/collective_rpc", json=body), 400)
    assert e["param"] == param and words in e["message"], e
    assert e["type"] == "invalid_request_error"


def test_collective_rpc_malformed_and_unauthorized(server):
    e = error(httpx.post(server.url + "/collective_rpc", content=b"{not json", timeout=30,
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"}), 400)
    assert "not valid JSON" in e["message"]
    error(httpx.post(server.url + "/collective_rpc", json={"method": "reload_weights"}), 401)
    assert greedy(server)  # still serving


# -- pause and sleep as vLLM reports them ----------------------------------------------------------------

def sleep_state(server) -> dict[str, float]:
    return {s: metric(server, "vllm:engine_sleep_state", {"sleep_state": s})
            for s in ("awake", "weights_offloaded", "discard_all")}


def test_is_paused_during_a_sleep_until_the_full_wake(server):
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": False}
    assert admin(server, "POST", "/sleep", params={"level": 1}).status_code == 200
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": True}
    assert admin(server, "POST", "/wake_up", params={"tags": "weights"}).status_code == 200
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": True}  # the KV cache still sleeps
    assert admin(server, "POST", "/wake_up").status_code == 200
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": False}
    assert admin(server, "POST", "/sleep", params={"level": 0}).status_code == 200
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": True}
    assert sleep_state(server) == {"awake": 0, "weights_offloaded": 0, "discard_all": 0}  # vLLM's level 0
    assert admin(server, "POST", "/resume").status_code == 200
    assert admin(server, "GET", "/is_paused").json() == {"is_paused": False}
    assert sleep_state(server) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


@pytest.mark.parametrize("path, params, param", [
    ("/sleep", {"mode": "bogus"}, "query.mode"),
    ("/sleep", {"level": "abc"}, "query.level"),
    ("/sleep", {"level": 7}, "query.level"),
    ("/sleep", {"tags": "cuda_graph"}, "query.tags"),
    ("/pause", {"mode": "later"}, "query.mode"),
    ("/pause", {"clear_cache": "maybe"}, "query.clear_cache"),
    ("/wake_up", {"tags": "nothing"}, "query.tags"),
])
def test_query_parameter_errors_name_query_dot_name(server, path, params, param):
    e = error(admin(server, "POST", path, params=params), 400)
    assert e["param"] == param, e
    assert state(server)["is_sleeping"] is False  # nothing changed


def test_weights_invalid_after_a_level_2_wake_answers_503_at_once(server):
    """Held while asleep; once fully awake without new weights, nothing but an update can make requests
    servable: the held one and every new one answer 503 weights_invalid at once, not after the hold timeout."""
    assert admin(server, "POST", "/sleep", params={"level": 2}).status_code == 200
    answers: list[httpx.Response] = []
    held = threading.Thread(target=lambda: answers.append(completion(server)))
    held.start()
    wait_for(lambda: httpx.get(server.url + "/load").json()["held"] == 1, 30, what="the request to be held")
    assert admin(server, "POST", "/wake_up").status_code == 200
    started = time.monotonic()
    held.join(30)
    assert answers and time.monotonic() - started < 10
    assert error(answers[0], 503)["code"] == "weights_invalid"
    assert state(server)["is_sleeping"] is False and state(server)["weights_valid"] is False
    started = time.monotonic()
    r = completion(server)
    assert error(r, 503)["code"] == "weights_invalid" and time.monotonic() - started < 5
    assert "Retry-After" in r.headers
    assert sleep_state(server)["discard_all"] == 1
    # The update makes it servable again.
    assert admin(server, "POST", "/update_weights", json={}).status_code == 200
    assert greedy(server)


# -- fields vLLM's clients read ----------------------------------------------------------------------------

def test_completion_choices_carry_prompt_logprobs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    choice = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0).choices[0]
    assert choice.prompt_logprobs is None  # present, null: the attribute exists
    asked = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"prompt_logprobs": 1}).choices[0]
    assert asked.prompt_logprobs[0] is None and len(asked.prompt_logprobs) > 3


def tokenize(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/tokenize", json=body, timeout=60)


CONV = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]


@pytest.mark.parametrize("fields", [
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_generation_prompt": True, "messages": CONV[:1]},
    {"add_generation_prompt": False, "continue_final_message": True,
     "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"},
    {"add_generation_prompt": True, "messages": CONV[:1], "chat_template_kwargs": {"custom": "x"},
     "chat_template": "{{ custom }}{% for m in messages %}[{{ m.content }}]{% endfor %}"},
])
def test_tokenize_agrees_with_chat_completions(server, fields):
    body = {"messages": CONV, **fields}
    t = tokenize(server, **body)
    assert t.status_code == 200, t.text
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                      json={**body, "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    assert t.json()["tokens"] == chat.json()["prompt_token_ids"]
    assert t.json()["token_strs"] is None


def test_tokenize_continue_final_message_leaves_the_turn_open(server):
    open_turn = tokenize(server, messages=CONV, add_generation_prompt=False, continue_final_message=True).json()
    closed = tokenize(server, messages=CONV, add_generation_prompt=False).json()
    assert closed["count"] > open_turn["count"] and closed["tokens"][:open_turn["count"]] == open_turn["tokens"]


def test_tokenize_token_strs_and_bad_input(server):
    t = tokenize(server, prompt="Hello world", return_token_strs=True).json()
    assert len(t["token_strs"]) == t["count"] and all(isinstance(s, str) for s in t["token_strs"])
    assert "".join(t["token_strs"]).replace("Ġ", " ").endswith("Hello world")
    e = error(tokenize(server, messages=CONV, continue_final_message=True), 400)
    assert e["param"] == "continue_final_message"
    e = error(tokenize(server, messages=CONV, chat_template_kwargs={"tokenize": True}), 400)
    assert e["param"] == "chat_template_kwargs"
    e = error(tokenize(server, prompt="x", return_token_strs="yes please"), 400)
    assert e["param"] == "return_token_strs"


# -- metrics -----------------------------------------------------------------------------------------------

def test_vllm_metric_families(server):
    names = ["vllm:iteration_tokens_total_sum", "vllm:request_inference_time_seconds_count",
             "vllm:request_num_preemptions_count", "vllm:request_num_preemptions_sum"]
    before = {n: metric(server, n) for n in names}
    success = {r: _success(server, r) for r in ("length", "stop")}
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": [PROMPT, "def fibonacci(n):"], "max_tokens": 5, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    delta = {n: metric(server, n) - before[n] for n in names}
    # vLLM counts each request's whole prompt at its first-token step, plus every sampled token.
    assert delta["vllm:iteration_tokens_total_sum"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert delta["vllm:request_inference_time_seconds_count"] == 2
    assert delta["vllm:request_num_preemptions_count"] == 2 and delta["vllm:request_num_preemptions_sum"] == 0
    assert _success(server, "length") - success["length"] == 2 and _success(server, "stop") == success["stop"]
    assert metric(server, "vllm:num_requests_waiting_by_reason", {"reason": "capacity"}) == 0
    assert metric(server, "vllm:num_requests_waiting_by_reason", {"reason": "deferred"}) == 0
    kv = admin(server, "GET", "/server_info").json()["kv_cache"]["capacity_tokens"]
    info = metric(server, "vllm:cache_config_info", {"kv_cache_size_tokens": str(kv),
                                                     "kv_cache_max_concurrency": str(kv / 1024)})
    assert info == 1.0


def _success(server, reason: str) -> float:
    try:
        return metric(server, "vllm:request_success_total", {"finished_reason": reason})
    except AssertionError:  # no request ended that way yet
        return 0.0


# -- weights that are not numbers (the disk path) ---------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_checkpoint_is_refused_and_never_served(server, default_model_folder, tmp_path, bad):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    before = greedy(server)
    with safe_open(str(next(default_model_folder.glob("*.safetensors"))), "pt") as f:
        t = f.get_tensor(NORM).clone()
    t[3] = bad
    save_file({NORM: t}, str(tmp_path / "model.safetensors"))
    r = admin(server, "POST", "/update_weights", json={"path": str(tmp_path)})
    e = error(r, 400)
    assert e["code"] == "nonfinite_weights" and NORM in e["message"], e
    assert state(server)["weights_valid"] is False
    started = time.monotonic()
    assert error(completion(server), 503)["code"] == "weights_invalid"  # nothing served from them, and no wait
    assert time.monotonic() - started < 5
    # A partial good update is not enough (the rest may be anything the bad one left); the whole checkpoint is.
    t[3] = 1.0
    save_file({NORM: t}, str(tmp_path / "model.safetensors"))
    e = error(admin(server, "POST", "/update_weights", json={"path": str(tmp_path)}), 400)
    assert "missing tensors" in e["message"]
    assert admin(server, "POST", "/update_weights", json={}).status_code == 200
    assert state(server)["weights_valid"] is True
    assert greedy(server) == before
    del torch


def test_the_finite_check_can_be_turned_off():
    import torch

    from server.cli import build_parser, resolve_options, split_options
    from server.model.finite import FiniteCheck, NonFiniteWeightsError

    parser = build_parser()
    args = parser.parse_args(["serve", "--no-check-weights-finite"])
    assert split_options(resolve_options(args, {}, parser))[1]["check_weights_finite"] is False
    off = FiniteCheck(enabled=False)
    off.add("w", torch.tensor([float("nan")]))
    off.verify()  # nothing checked
    on = FiniteCheck()
    for name, value, dtype in (("a", 1.0, torch.float32), ("b", float("-inf"), torch.bfloat16),
                               ("c", 3e38, torch.bfloat16), ("d", float("nan"), torch.float32)):
        on.add(name, torch.full((4,), value, dtype=dtype))
    with pytest.raises(NonFiniteWeightsError, match="in d, b;") as caught:
        on.verify()
    assert caught.value.names == ("d", "b")  # 3e38 is finite: nothing overflows on finite values
