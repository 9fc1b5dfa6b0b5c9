"""/v1/responses (OpenAI's Responses API) through the official `openai` client's `client.responses`, against
the real server on the default model (tests/conftest.py's shared server), and the assembly of a choice's
deltas into output items without a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from server.chat_tools import ChatFormat
from server.protocol import ApiError
from server.protocol_responses import ResponsesRequest
from server.serving_common import ServingContext, usage_body
from server.serving_responses import ResponseAssembler, ResponseStore, items_to_messages, to_chat_request

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                         "required": ["city"]}},
         {"type": "function", "name": "get_time", "description": "The time in a time zone",
          "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                         "required": ["zone"]}}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def create(client, model, **kw):
    return client.responses.create(model=model, temperature=0, **kw)


def test_create_with_instructions_equals_chat(client, model):
    r = create(client, model, input="What is the capital of France?", instructions="Answer in one sentence.",
               max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert [item.type for item in r.output] == ["message"] and "Paris" in r.output_text
    assert r.instructions == "Answer in one sentence." and r.max_output_tokens == 24 and r.tools == []
    u = r.usage
    assert u.input_tokens > 10 and 0 < u.output_tokens <= 24 and u.total_tokens == u.input_tokens + u.output_tokens
    # The same conversation through chat: instructions are its system message.
    chat = client.chat.completions.create(model=model, temperature=0, max_completion_tokens=24, messages=[
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.output_text == chat.choices[0].message.content
    assert u.input_tokens == chat.usage.prompt_tokens and u.output_tokens == chat.usage.completion_tokens
    # Cut by max_output_tokens: incomplete, and why.
    cut = create(client, model, input="Write a long story about a dragon.", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5 and cut.output[0].status == "incomplete" and cut.output_text


def test_stream_equals_non_stream(client, model):
    kw = {"input": "Name three colors.", "max_output_tokens": 16}
    # The first call caches the prompt, so the two compared calls extend from the same cached prefix (in bfloat16 a
    # whole prefill and a cached one round apart and may pick other tokens).
    create(client, model, **kw)
    full = create(client, model, **kw)
    events = list(create(client, model, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert deltas > 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        f"response.{full.status}"])  # (completed, or incomplete at max_output_tokens)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text and events[-4].text == text
    done = events[-1].response
    assert done.output_text == full.output_text and done.status == full.status and done.id == events[0].response.id
    assert done.usage.output_tokens == full.usage.output_tokens and done.usage.input_tokens == full.usage.input_tokens


def test_function_call_round_trip(client, model):
    r = create(client, model, input=QUESTION, tools=TOOLS, tool_choice="required", max_output_tokens=60,
               parallel_tool_calls=False)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name in {"get_weather", "get_time"}
    assert isinstance(json.loads(calls[0].arguments), dict) and calls[0].call_id
    # The tool's result goes back with the conversation's items: the model answers in text.
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    answer = create(client, model, input=[{"role": "user", "content": QUESTION}, *r.output, *outputs],
                    tools=TOOLS, tool_choice="none", max_output_tokens=12)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text.strip()
    # A named function, streamed: the argument deltas make the call the non-streamed request makes.
    named = {"type": "function", "name": "get_weather"}
    full = create(client, model, input=QUESTION, tools=TOOLS, tool_choice=named, max_output_tokens=64)
    events = list(create(client, model, input=QUESTION, tools=TOOLS, tool_choice=named, max_output_tokens=64,
                         stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    call = full.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and args == call.arguments
    assert json.loads(call.arguments)["city"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and events[-1].response.output[0].arguments == args


def test_auto_tool_choice_follows_the_server_capabilities(client, model, server):
    """tool_choice auto (the default with tools): a call or text where the server says it reads calls, else a
    400 naming tool_choice."""
    caps = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["capabilities"]
    if "auto" not in caps["tool_choice"]:
        with pytest.raises(openai.BadRequestError) as e:
            create(client, model, input=QUESTION, tools=TOOLS, max_output_tokens=40)
        assert e.value.body["param"] == "tool_choice"
        return
    r = create(client, model, input=QUESTION, tools=TOOLS, max_output_tokens=60)
    assert r.status in ("completed", "incomplete") and r.output
    for item in r.output:
        if item.type == "function_call":
            assert item.name in {"get_weather", "get_time"} and isinstance(json.loads(item.arguments), dict)
        else:
            assert item.type == "message" and item.content[0].text


def test_json_schema_format_validates(client, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = create(client, model, input="Describe a pilot as a JSON record.", text={"format": fmt},
               max_output_tokens=60)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_previous_response_id_chain_retrieve_and_delete(client, model):
    first = create(client, model, input="My name is Bob.", instructions="You are terse.", max_output_tokens=8)
    second = create(client, model, input="What is my name?", previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id
    # The same as sending the conversation itself (the earlier instructions are not carried over).
    explicit = create(client, model, max_output_tokens=8, input=[
        {"role": "user", "content": "My name is Bob."}, *first.output, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == explicit.output_text and second.usage.input_tokens == explicit.usage.input_tokens
    got = client.responses.retrieve(second.id)
    assert got.model_dump() == second.model_dump()
    client.responses.delete(second.id)
    for call in (lambda: client.responses.retrieve(second.id),
                 lambda: create(client, model, input="x", previous_response_id=second.id, max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert second.id in e.value.body["message"]
    unstored = create(client, model, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unstored.id)
    assert e.value.body["param"] == "response_id"


BAD = [
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, 400, "input.0.type"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}, 400, "input.1.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400,
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, 400, "input.0.call_id"),
    ({"input": []}, 400, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, 400, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, 400, "tools.0.name"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice.type"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
     "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 10**9}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, 400, "temperature"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": "hi", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"model": "gpt-5"}, 400, "input"),
    ({"input": "hi", "model": "gpt-5"}, 404, "model"),
]


def test_errors_name_the_field(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, status, param in BAD:
            r = http.post("/v1/responses", json={"max_output_tokens": 4, **body})
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, r.text
            assert err["param"] == param and (param is None or param in err["message"]), (body, r.text)
        # metadata is echoed: a lone surrogate there is refused (it could not be encoded in the reply).
        r = http.post("/v1/responses", content=b'{"input": "hi", "metadata": {"k": "\\ud800"}}',
                      headers={"content-type": "application/json"})
        assert r.status_code == 400 and "metadata" in r.json()["error"]["message"], r.text
        assert http.get("/v1/responses/resp_unknown").status_code == 404
        assert http.delete("/v1/responses/resp_unknown").status_code == 404
        assert http.get("/health").status_code == 200


# ---- without a server ------------------------------------------------------------------------------


def assemble(deltas: list[dict], reason: str, summarize: bool = False) -> tuple[dict, list[dict]]:
    """deltas: ChoiceOutput's, the last one its finish()."""
    asm = ResponseAssembler({"id": "resp_1", "status": "in_progress", "output": []}, len, summarize)
    events = asm.start()
    for delta in deltas[:-1]:
        events += asm.feed(delta)
    events += asm.finish(deltas[-1], reason)
    return asm.complete(usage_body(7, 9, 2)), events + [asm.final_event()]


def test_assembler_reasoning_blank_text_and_calls():
    r, events = assemble([{"reasoning_content": "Think"}, {"reasoning_content": "ing."}, {"content": "\n"},
                          {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                           "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}],
                         "tool_calls", summarize=True)
    assert [item["type"] for item in r["output"]] == ["reasoning", "function_call"]  # the blank is no message
    reasoning, call = r["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Thinking."}]
    assert call["call_id"] == "call_a" and call["arguments"] == '{"x": 1}' and call["status"] == "completed"
    assert r["status"] == "completed" and r["usage"]["output_tokens_details"]["reasoning_tokens"] == len("Thinking.")
    assert (r["usage"]["input_tokens"], r["usage"]["output_tokens"], r["usage"]["total_tokens"]) == (7, 9, 16)
    assert r["usage"]["input_tokens_details"] == {"cached_tokens": 2}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in [e["type"] for e in events]
    # Only blanks and no call: the reply is a message of those blanks; cut short, it is incomplete.
    r, _ = assemble([{"content": " "}, {}], "length")
    assert r["output"][0]["content"][0]["text"] == " " and r["output"][0]["status"] == "incomplete"
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}


def test_items_to_messages_groups_calls_into_one_assistant_turn():
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]},
             {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
             {"type": "reasoning"},
             {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "b", "output": "2"},
             {"type": "function_call_output", "call_id": "a", "output": "1"}]
    messages = items_to_messages(items, 0)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] is None and [c["id"] for c in messages[1]["tool_calls"]] == ["a", "b"]
    assert messages[2] == {"role": "tool", "tool_call_id": "b", "content": "2"}


def test_to_chat_request_maps_the_fields():
    ctx = ServingContext(None, SimpleNamespace(), {}, "m", ChatFormat(reasoning_parser="qwen3"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ResponsesRequest.model_validate({
        "input": [{"role": "developer", "content": [{"type": "input_text", "text": "be brief"},
                                                    {"type": "input_text", "text": "and kind"}]},
                  {"type": "message", "role": "user", "content": "hi"}],
        "instructions": "sys", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"},
        "parallel_tool_calls": False, "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
        "reasoning": {"effort": "none"}})
    plan = to_chat_request(ctx, ResponseStore(), req)
    chat = plan.chat
    assert [(m.role, m.content) for m in chat.messages] == [("system", "sys"), ("developer", "be brief\nand kind"),
                                                            ("user", "hi")]
    assert [t.function.name for t in chat.tools] == ["get_weather", "get_time"]
    assert chat.tools[0].function.parameters == TOOLS[0]["parameters"]
    assert chat.tool_choice.function.name == "get_time" and chat.parallel_tool_calls is False
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (7, 0.5, 0.9)
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert plan.tool_choice == {"type": "function", "name": "get_time"}
    # Without a reasoning parser, `reasoning` is refused by name.
    ctx.chat_format = ChatFormat(reasoning_parser=None)
    with pytest.raises(ApiError) as e:
        to_chat_request(ctx, ResponseStore(), req)
    assert e.value.param == "reasoning"
