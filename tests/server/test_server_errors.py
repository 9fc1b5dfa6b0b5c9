"""User mistakes are 400 (401, 404, 413) with an OpenAI-style error body, never a 500 or FastAPI's 422."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.fake_scheduler import ServerProcess

CONTEXT = 256


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--context-length", str(CONTEXT)).wait_healthy()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


def assert_error(resp: httpx.Response, status: int, param: str | None = "any", type_: str | None = None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status
    assert err["type"] == (type_ or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                                     413: "RequestTooLargeError"}[status])
    if param != "any":
        assert err["param"] == param, err
    return err


CMPL = {"prompt": "hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

BAD_COMPLETIONS = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": CONTEXT}, "max_tokens"),
    ({"prompt": "word " * (CONTEXT + 10)}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": 1.5}, "n"),
    ({"stop": ""}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": 5}, "any"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 10}, "min_tokens"),
    ({"seed": 2**70}, "seed"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
]


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS, ids=[str(c) for c, _ in BAD_COMPLETIONS])
def test_completions_400(server, model, change, param):
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": model, **CMPL, **change}, timeout=10)
    assert_error(resp, 400, param)


def test_missing_prompt_and_wrong_body(server, model):
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"model": model}, timeout=10), 400, "prompt")
    for content in (b"{not json", b"[1, 2]", b"", b"null", b'{"prompt": "x", "temperature": NaN}'):
        resp = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=10)
        assert_error(resp, 400)
    # curl's default form encoding still reads as JSON.
    resp = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x", "max_tokens": -3}',
                      headers={"content-type": "application/x-www-form-urlencoded"}, timeout=10)
    assert_error(resp, 400, "max_tokens")


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "any"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"messages": "hello"}, "messages"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_tokens": CONTEXT}, "max_tokens"),
    ({"max_completion_tokens": CONTEXT}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "word " * (CONTEXT + 10)}], "max_tokens": None}, "messages"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    ({"temperature": -1}, "temperature"),
    ({"n": 100}, "n"),
]


@pytest.mark.parametrize("change,param", BAD_CHAT, ids=[str(c)[:60] for c, _ in BAD_CHAT])
def test_chat_400(server, model, change, param):
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, **CHAT, **change}, timeout=10)
    assert_error(resp, 400, param)


def test_generate_400(server):
    url = f"{server.url}/generate"
    assert_error(httpx.post(url, json={"sampling_params": {}}, timeout=10), 400, "text")
    assert_error(httpx.post(url, json={"text": "x", "input_ids": [1]}, timeout=10), 400, "text")
    assert_error(httpx.post(url, json={"text": "x", "sampling_params": {"max_new_tokens": -1}}, timeout=10),
                 400, "sampling_params.max_new_tokens")
    assert_error(httpx.post(url, json={"text": "x", "sampling_params": {"max_new_tokens": CONTEXT}},
                            timeout=10), 400, "sampling_params.max_new_tokens")
    assert_error(httpx.post(url, json={"input_ids": [-5]}, timeout=10), 400, "input_ids")


def test_openai_client_sees_typed_errors(server, model):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=25)


def test_unknown_model_and_route_404(server):
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"model": "nope", **CMPL}, timeout=10),
                 404, "model")
    assert_error(httpx.get(f"{server.url}/v1/models/nope", timeout=10), 404, "model")
    assert_error(httpx.get(f"{server.url}/v1/nothing-here", timeout=10), 404)
    resp = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert resp.status_code == 405 and resp.json()["error"]["code"] == 405


# ---- API key and body size ----------------------------------------------------------------------------

KEY = "sk-test-secret"
LIMIT = 4096


@pytest.fixture(scope="module")
def guarded():
    srv = ServerProcess("--api-key", KEY, "--max-request-bytes", str(LIMIT)).wait_healthy()
    yield srv
    srv.stop()


def test_api_key(guarded):
    url = guarded.url
    good = {"Authorization": f"Bearer {KEY}"}
    generate = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", CMPL),
                               ("POST", "/v1/chat/completions", CHAT), ("POST", "/generate", generate),
                               ("POST", "/flush_cache", None), ("GET", "/server_info", None)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            assert_error(httpx.request(method, url + path, json=body, headers=headers, timeout=10), 401)
        assert httpx.request(method, url + path, json=body, headers=good, timeout=30).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=2).choices


def test_body_too_large(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    big = {"prompt": "x" * (LIMIT + 100), "max_tokens": 1}
    assert_error(httpx.post(f"{guarded.url}/v1/completions", json=big, headers=headers, timeout=10), 413)

    def chunks():  # no Content-Length: chunked upload, caught while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    resp = httpx.post(f"{guarded.url}/v1/completions", content=chunks(),
                      headers={**headers, "content-type": "application/json"}, timeout=10)
    assert_error(resp, 413)
    ok = {"prompt": "x" * 100, "max_tokens": 1}
    assert httpx.post(f"{guarded.url}/v1/completions", json=ok, headers=headers, timeout=10).status_code == 200


def test_anthropic_routes_take_x_api_key_and_answer_in_their_shape(guarded):
    """Anthropic's clients send the key as x-api-key; the /v1/messages routes' 401 and 413 have Anthropic's
    error body (the OpenAI routes keep theirs)."""
    import anthropic

    url = guarded.url
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong", "x-api-key": KEY}):
        resp = httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=10)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error", resp.text
    chat = f"{url}/v1/chat/completions"
    assert_error(httpx.post(chat, json=CHAT, headers={"x-api-key": "wrong"}, timeout=10), 401)
    assert httpx.post(chat, json=CHAT, headers={"x-api-key": KEY}, timeout=30).status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(model="m", **body)
    assert set(e.value.body) == {"type", "error"}
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    model = httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}, timeout=10).json()["data"][0]["id"]
    assert client.messages.create(model=model, **body).usage.output_tokens > 0
    big = {"messages": [{"role": "user", "content": "x" * (LIMIT + 100)}], "max_tokens": 2}
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(model=model, **big)
    assert e.value.status_code == 413 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "request_too_large"
    assert "--max-request-bytes" in e.value.body["error"]["message"]
