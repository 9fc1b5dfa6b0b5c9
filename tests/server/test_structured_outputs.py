"""Structured outputs, tool calls, logit bias and the refusal of unsupported fields, through the official
`openai` client against a real server on the default model (SmolLM2-135M-Instruct, CPU): one server for
the module, started with no tool flags (tool calls in duet's default format: the model's template renders no
tools)."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.fake_scheduler import ServerProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}},
]
SUBJECTS = ["a pilot", "a cook", "a nurse", "a farmer", "a judge", "a poet", "a sailor", "a baker", "a miner",
            "a singer", "a teacher", "a doctor", "a painter", "a tailor", "a guard", "a monk", "a clerk",
            "a hunter", "a dancer", "a writer"]


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess("--max-total-tokens", "8192", model_dir=model_dir, fake=False).wait_healthy(timeout=300)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=1500)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, content: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_json_schema_outputs_parse_and_validate(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def one(subject):
        r = chat(client, model, f"Describe {subject} as a JSON record.", max_tokens=120, response_format=fmt)
        return r.choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(SUBJECTS)) as pool:
        choices = list(pool.map(one, SUBJECTS))
    for c in choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_and_regex_and_ebnf(client, model, server):
    r = chat(client, model, "Give a JSON object with the keys city and country for Paris.", max_tokens=200,
             response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = r"(yes|no), [0-9]{3}"
    c = client.completions.create(model=model, prompt="Is the sky blue? Answer and add a number:", max_tokens=20,
                                  temperature=0, extra_body={"regex": pattern})
    assert re.fullmatch(pattern, c.choices[0].text) and c.choices[0].finish_reason == "stop", c.choices[0].text
    g = httpx.post(f"{server.url}/generate", timeout=300, json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 10, "temperature": 0,
                                                                "ebnf": 'root ::= " Paris" | " London"'}}).json()
    assert g["text"] in (" Paris", " London") and g["meta_info"]["finish_reason"]["type"] == "stop", g


def _validate_call(call) -> None:
    spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])


def _streamed_calls(client, model, content: str, **kw) -> tuple[dict, str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, model, content, stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                if d.function is not None:
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_required_and_named(client, model, choice):
    prompt = "What is the weather in Oslo?"
    kw = {"parallel_tool_calls": False} if choice == "required" else {}  # one call: a shorter reply
    r = chat(client, model, prompt, max_tokens=120, tools=TOOLS, tool_choice=choice, **kw)
    msg = r.choices[0].message
    assert msg.tool_calls, msg
    for call in msg.tool_calls:
        _validate_call(call)
        assert call.id and call.type == "function"
    if choice != "required":
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        assert r.choices[0].finish_reason == "stop"
    else:
        assert r.choices[0].finish_reason == "tool_calls"
    streamed, finish = _streamed_calls(client, model, prompt, max_tokens=120, tools=TOOLS, tool_choice=choice,
                                       **kw)
    if kw:
        assert len(msg.tool_calls) == 1
    assert finish == r.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert all(c["id"] for c in streamed.values())


def test_tool_round_trip_through_the_template(client, model):
    """An assistant tool call and the tool's answer go back through the chat template."""
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].message.content is not None


def test_tools_with_no_flags(client, model, server):
    """A plain server of the default model: tools with no tool_choice give a parsed call or text (never a 400),
    a named choice a parsed call, and the next turn with that call and its result is accepted."""
    caps = httpx.get(f"{server.url}/server_info", timeout=10).json()["capabilities"]
    assert (caps["tool_call_parser"], caps["tool_call_format"]) == ("hermes", "default")
    messages = [{"role": "user", "content": "What is the weather in Oslo? Use a tool."}]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        assert all(c.function.name and isinstance(json.loads(c.function.arguments), dict) for c in msg.tool_calls)
    else:
        assert msg.content and r.choices[0].finish_reason in ("stop", "length")
    forced = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = forced.choices[0].message.tool_calls
    _validate_call(call)
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 12, "unit": "c"}'}]
    r = client.chat.completions.create(model=model, messages=follow_up, tools=TOOLS, max_tokens=30, temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > forced.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_logit_bias_forces_and_bans(client, model, server):
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()
    forced = tok["tokens"][0]
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": r.choices[0].text, "add_special_tokens": False})
    assert ids.json()["tokens"] == [forced] * 3, r.choices[0].text
    plain = httpx.post(f"{server.url}/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}).json()["output_ids"][0]
    banned = httpx.post(f"{server.url}/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0, "logit_bias": {str(plain): -100}}}).json()["output_ids"][0]
    assert banned != plain


def test_tokenize_detokenize_round_trip(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] > 0
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"].endswith("Hello world")
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_ids["count"] > 2


CMPL = {"prompt": "x", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", dict(CMPL, best_of=2), "best_of"),
    ("/v1/completions", dict(CMPL, suffix="end"), "suffix"),
    ("/v1/completions", dict(CMPL, echo=True, logprobs=21), "logprobs"),
    ("/v1/completions", dict(CMPL, prompt_logprobs=21), "prompt_logprobs"),
    ("/v1/completions", dict(CMPL, prompt_logprobs=-1), "prompt_logprobs"),
    ("/v1/completions", dict(CMPL, prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("/v1/completions", dict(CMPL, zzz=1), "zzz"),
    ("/v1/completions", dict(CMPL, regex="[a-"), "regex"),
    ("/v1/completions", dict(CMPL, regex="a", ebnf='root ::= "a"'), "ebnf"),
    ("/v1/chat/completions", dict(CHAT, functions=[{"name": "f"}]), "functions"),
    ("/v1/chat/completions", dict(CHAT, function_call="auto"), "function_call"),
    ("/v1/chat/completions", dict(CHAT, audio={"voice": "x"}), "audio"),
    ("/v1/chat/completions", dict(CHAT, modalities=["audio"]), "modalities.0"),
    ("/v1/chat/completions", dict(CHAT, reasoning_effort="low"), "reasoning_effort"),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages.0.content.0"),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]), "messages.0.content.0"),
    ("/v1/chat/completions", dict(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), "response_format.json_schema.schema"),
    ("/v1/chat/completions", dict(CHAT, tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", dict(CHAT, tools=TOOLS, tool_choice={"type": "function",
                                                                  "function": {"name": "nope"}}), "tool_choice"),
    ("/v1/chat/completions", dict(CHAT, chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    ("/v1/chat/completions", dict(CHAT, presence_penalty=3), "presence_penalty"),
    ("/v1/chat/completions", dict(CHAT, logit_bias={"999999": 1}), "logit_bias"),
    ("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {"input_ids": [5, 6, 7], "logprob_start_len": 0}, "logprob_start_len"),
    ("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
])
def test_unsupported_or_invalid_fields_are_a_400_naming_them(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    named = [p for p in param.split(".") if not p.isdigit()][-1]
    assert err["param"] == param and named in err["message"], err


def test_noop_fields_are_accepted(server, client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       user="u", store=False, metadata={"k": "v"}, service_tier="auto")
    assert r.choices[0].finish_reason == "length"
    info = httpx.get(f"{server.url}/server_info").json()["capabilities"]
    assert "json_schema" in info["structured_outputs"] and "required" in info["tool_choice"]


def test_a_grammar_that_leads_nowhere_is_a_400(server):
    """A valid grammar whose language is empty after a prefix (xgrammar's mask allows "a", then nothing): the
    request cannot be completed as asked, a 400 naming the constraint (was a 500, "rejected token 0")."""
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "regex": r"a[^\s\S]"}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "regex constraint admits no token after 1 generated tokens" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "regex"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 8, "regex": r"[^\s\S]", "stream": True}, "regex"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                              "regex": r"[^\s\S]", "stream": True}, "regex"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 8, "regex": r"[^\s\S]"}, "stream": True},
     "sampling_params.regex"),
])
def test_a_stream_that_fails_before_any_output_is_an_http_400(server, path, body, param):
    """A streamed request whose grammar admits no first token: the 400 is the response's status with the
    OpenAI error body (its first chunk is awaited before the 200), not an error event inside a 200 stream
    (the fuzz's finding)."""
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert "regex constraint admits no token after 0 generated tokens" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == param


def test_a_stream_that_fails_after_output_ends_with_an_error_event(server):
    """After the 200 and the first token, a later dead end can only be an event in the stream, then [DONE]."""
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "regex": r"a[^\s\S]", "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 400 and "admits no token after 1 generated tokens" in err["message"]
    assert err["param"] == "regex"
