"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic` SDK
against the real server on the default model (the shared plain server, CPU): create, stream, stop sequences,
max_tokens, forced tool use and the tool_result round trip, count_tokens, errors in Anthropic's shape. Without
a server: the request's conversion to chat messages, and the streamed blocks equal to the whole reply's."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from scheduler.io_struct import FinishReason
from server.chat_tools import ChatFormat
from server.protocol import ApiError
from server.protocol_anthropic import AnthropicMessagesRequest
from server.serving_chat import ChatJob, ChoiceOutput, ToolPlan
from server.serving_messages import _Reply, _stop_reason, chat_messages, chat_request

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 16},
                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                            "required": ["city", "unit"]}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}


@pytest.fixture(scope="module")
def client(default_server):
    return anthropic.Anthropic(base_url=default_server.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(default_server):
    return httpx.get(f"{default_server.url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def answer(client, model):
    """The greedy reply to QUESTION, which several tests compare with."""
    return create(client, model)


@pytest.fixture(scope="module")
def forced(client, model):
    """A forced call of get_weather."""
    return create(client, model, max_tokens=60, messages=WEATHER_QUESTION, **FORCED)


def _kwargs(model: str, kw: dict) -> dict:
    # The SDK has no temperature argument: it goes in the body's extras, as clients send it.
    return {"model": model, "max_tokens": 24, "messages": QUESTION, "extra_body": {"temperature": 0}, **kw}


def create(client, model, **kw):
    return client.messages.create(**_kwargs(model, kw))


def stream(client, model, **kw):
    """(the raw events, the message the SDK assembles from them)."""
    with client.messages.stream(**_kwargs(model, kw)) as s:
        events = [e for e in s if e.type in ("message_start", "content_block_start", "content_block_delta",
                                             "content_block_stop", "message_delta", "message_stop")]
        return events, s.get_final_message()


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ---- against the server ---------------------------------------------------------------------------------


def test_create_answers(answer, model):
    r = answer
    assert r.type == "message" and r.role == "assistant" and r.model == model and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and "Paris" in r.content[0].text
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens > 10 and r.usage.output_tokens > 0


def test_stream_equals_create(client, model, answer, default_server):
    whole = answer
    events, final = stream(client, model)
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == text_of(whole) == text_of(final)
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert final.stop_reason == whole.stop_reason and final.usage == whole.usage
    # On the wire: each event's `event:` line names its data's type, and a ping follows message_start.
    body = {"model": model, "max_tokens": 4, "messages": QUESTION, "stream": True, "temperature": 0}
    raw = httpx.post(f"{default_server.url}/v1/messages", json=body, timeout=300)
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    names = []
    for event in raw.text.strip().split("\n\n"):
        name_line, data_line = event.split("\n")
        name = name_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def test_stop_sequences(client, model, answer):
    full = text_of(answer)
    words = full.split()
    stop = words[len(words) // 2]
    r = create(client, model, stop_sequences=["no such text", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert text_of(r) == full[:full.index(stop)]
    _, final = stream(client, model, stop_sequences=["no such text", stop])
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == (r.stop_reason, stop, text_of(r))


def test_max_tokens_stop_reason(client, model):
    r = create(client, model, max_tokens=3)
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None and r.usage.output_tokens == 3
    _, final = stream(client, model, max_tokens=3)
    assert final.stop_reason == "max_tokens" and text_of(final) == text_of(r)


def test_forced_tool_use(client, model, forced):
    r = forced
    assert r.stop_reason == "tool_use"
    [call] = r.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    events, final = stream(client, model, max_tokens=60, messages=WEATHER_QUESTION, **FORCED)
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    [streamed] = final.content
    assert (streamed.type, streamed.name, streamed.input) == ("tool_use", "get_weather", call.input)
    assert final.stop_reason == "tool_use"


def _round_trip(client, model, first, **kw):
    call = first.content[0]
    messages = [*WEATHER_QUESTION, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": "Sunny and 21 degrees Celsius."}]}]
    second = create(client, model, max_tokens=12, messages=messages, tools=[WEATHER], **kw)
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    return second


def test_tool_result_round_trip(client, model, forced):
    second = _round_trip(client, model, forced, tool_choice={"type": "none"})
    assert [b.type for b in second.content] == ["text"] and text_of(second).strip()


def test_tool_result_round_trip_with_auto_tool_choice(client, model, forced):
    """What agent clients send: the tools again, tool_choice left to its default (auto)."""
    second = _round_trip(client, model, forced)
    assert second.content


def test_count_tokens_equals_usage(client, model, answer, forced):
    def count(**kw) -> int:
        return client.messages.count_tokens(model=model, **kw).input_tokens

    assert count(messages=QUESTION) == answer.usage.input_tokens
    assert count(messages=WEATHER_QUESTION, **FORCED) == forced.usage.input_tokens
    system = "You answer in one short sentence."
    with_system = count(messages=QUESTION, system=system)
    assert with_system == create(client, model, max_tokens=1, system=system).usage.input_tokens
    assert with_system != answer.usage.input_tokens  # the system prompt is rendered


def _anthropic_error(exc_info, status: int, kind: str, field: str | None) -> str:
    e = exc_info.value
    assert e.status_code == status
    assert set(e.body) == {"type", "error"} and e.body["type"] == "error"
    assert set(e.body["error"]) == {"type", "message"} and e.body["error"]["type"] == kind
    message = e.body["error"]["message"]
    if field is not None:
        assert message.startswith(f"{field}: "), message
    return message


@pytest.mark.parametrize("kw,field", [
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages.0.role"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),  # no tools
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                 "content": "x"}]}]}, "messages.0.content.0.tool_use_id"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "The capital is"}]}, "messages.1.role"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "thinking"),  # no reasoning parser
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"temperature": -1}}, "temperature"),
    ({"extra_body": {"output_config": {"effort": "low"}}}, "output_config"),
    ({"stream": True, "max_tokens": 10**6}, "max_tokens"),  # refused before the stream starts
])
def test_bad_requests_are_anthropic_400s(client, model, kw, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, model, **kw)
    _anthropic_error(e, 400, "invalid_request_error", field)


def test_other_errors_have_anthropic_shape(client, model, default_server):
    with pytest.raises(anthropic.NotFoundError) as e:
        create(client, model="claude-sonnet-4-5")
    _anthropic_error(e, 404, "not_found_error", "model")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=model, messages=[{"role": "bot", "content": "hi"}])
    _anthropic_error(e, 400, "invalid_request_error", "messages.0.role")
    url = default_server.url
    # What the SDK cannot send: max_tokens missing, a body that is not JSON.
    r = httpx.post(f"{url}/v1/messages", json={"model": model, "messages": QUESTION}, timeout=60)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # The OpenAI routes keep their shape.
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "bot", "content": "x"}]},
                   timeout=60)
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["code"] == 400
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_accepted_fields_change_nothing(client, model, answer):
    plain = answer
    decorated = create(client, model, metadata={"user_id": "u-1"}, service_tier="auto",
                       messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"],
                                                               "cache_control": {"type": "ephemeral"}}]}],
                       thinking={"type": "disabled"})
    assert text_of(decorated) == text_of(plain) and decorated.usage == plain.usage


# ---- without a server -------------------------------------------------------------------------------------


def test_conversion_to_chat_messages():
    req = AnthropicMessagesRequest.model_validate({
        "model": "m", "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "unreachable", "is_error": True},
                {"type": "text", "text": "And tomorrow?"}]}]})
    got = [m.model_dump(exclude_none=True) for m in chat_messages(req)]
    assert got == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "t2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "t1"},
        {"role": "tool", "content": "Error: unreachable", "tool_call_id": "t2"},
        {"role": "user", "content": "And tomorrow?"}]


def test_blocks_in_the_wrong_role_are_refused():
    for role, block in (("user", {"type": "tool_use", "id": "t", "name": "f", "input": {}}),
                        ("user", {"type": "thinking", "thinking": "x"}),
                        ("system", {"type": "tool_use", "id": "t", "name": "f", "input": {}})):
        req = AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
            {"role": role, "content": [block]}, {"role": "user", "content": "hi"}]})
        with pytest.raises(ApiError) as e:
            chat_messages(req)
        assert e.value.status == 400 and e.value.param == "messages.0.content.0"


def _chat(**fields):
    return chat_request(AnthropicMessagesRequest.model_validate(
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}))


def test_chat_request_fields():
    tools = {"tools": [WEATHER]}
    assert _chat(**tools).tool_choice is None  # chat's default for tools: auto
    assert _chat(**tools, tool_choice={"type": "auto"}).tool_choice == "auto"
    assert _chat(**tools, tool_choice={"type": "none"}).tool_choice == "none"
    forced = _chat(**tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert forced.tool_choice == "required" and forced.parallel_tool_calls is False
    assert _chat(**tools, tool_choice={"type": "tool", "name": "get_weather"}).tool_choice.function.name == \
        "get_weather"
    fn = _chat(**tools).tools[0].function
    assert (fn.name, fn.description) == ("get_weather", WEATHER["description"])
    assert fn.parameters == WEATHER["input_schema"]
    r = _chat(stop_sequences=["x"], temperature=0.5, top_p=0.9, top_k=5, max_tokens=7, stream=True)
    assert (r.stop, r.temperature, r.top_p, r.top_k, r.max_tokens, r.stream) == (["x"], 0.5, 0.9, 5, 7, True)
    # thinking -> the template's enable_thinking, unless chat_template_kwargs sets it
    assert _chat(thinking={"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}
    assert _chat(thinking={"type": "adaptive"}).chat_template_kwargs == {"enable_thinking": True}
    assert _chat(thinking={"type": "enabled", "budget_tokens": 4},
                 chat_template_kwargs={"enable_thinking": False, "x": 1}).chat_template_kwargs == {
        "enable_thinking": False, "x": 1}
    assert _chat().chat_template_kwargs is None
    with pytest.raises(ApiError) as e:
        _chat(thinking={"type": "enabled", "budget_tokens": 8})
    assert e.value.param == "thinking.budget_tokens"


def _accumulate(events: list[tuple[str, dict]]) -> list[dict]:
    """The blocks a client assembles from the events; checks that they are well formed on the way."""
    blocks, partial, open_index = [], {}, None
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = blocks[open_index], data["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                delta["type"]]
            if field == "partial_json":
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
            else:
                block[field] += delta[field]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            if open_index in partial:
                blocks[open_index]["input"] = json.loads(partial[open_index])
            open_index = None
    assert open_index is None
    return blocks


def _streamed_and_whole(plan: ToolPlan, pieces: list[str], reasoning: str | None = None,
                        parser: str | None = None, omit_thinking: bool = False, max_calls: int | None = None):
    def reply():
        job = ChatJob("m", [], [], [ChoiceOutput(plan, ChatFormat(tool_parser=parser, reasoning_parser=reasoning))],
                      None, "r", 0)
        return _Reply(job, omit_thinking, max_calls)

    streamed, whole = reply(), reply()
    events = []
    for piece in pieces:
        events += streamed.events(streamed.out.feed(piece))
        whole.out.feed(piece)
    events += streamed.close(streamed.out.finish())
    whole.out.finish()

    def without_ids(blocks):
        return [{k: v for k, v in b.items() if k != "id"} for b in blocks]

    return without_ids(_accumulate(events)), without_ids(whole.blocks())


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
TOOLS = [{"name": "get_weather", "parameters": WEATHER["input_schema"]}]


@pytest.mark.parametrize("plan,pieces,reasoning,parser,omit,max_calls,expected", [
    (ToolPlan("none"), ["Hel", "lo", " world"], None, None, False, None,
     [{"type": "text", "text": "Hello world"}]),
    (ToolPlan("none"), ["<thi", "nk>Let me", " think</think>\n\nIt is", " 4."], "qwen3", None, False, None,
     [{"type": "thinking", "thinking": "Let me think", "signature": ""}, {"type": "text", "text": "It is 4."}]),
    (ToolPlan("none"), ["<think>hmm</think>", "4"], "qwen3", None, True, None,
     [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "4"}]),
    (ToolPlan("none"), [" ", " "], None, None, False, None, [{"type": "text", "text": "  "}]),
    (ToolPlan("auto", TOOLS), ["\n", CALL[:15], CALL[15:]], None, "hermes", False, None,
     [{"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]),
    (ToolPlan("auto", TOOLS), ["Let me check.", "\n" + CALL, "\n" + CALL], None, "hermes", False, 1,
     [{"type": "text", "text": "Let me check.\n"},
      {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]),
    (ToolPlan("named", TOOLS, "get_weather"), ['{"city"', ': "Rome", ', '"unit": "f"}'], None, None, False,
     None,
     [{"type": "tool_use", "name": "get_weather", "input": {"city": "Rome", "unit": "f"}}]),
    (ToolPlan("required", TOOLS), ['[{"name": "get_weather", "parameters": {"city": "A", "unit": "c"}}, ',
                                   '{"name": "get_weather", "parameters": {"city": "B", "unit": "c"}}]'],
     None, None, False, None,
     [{"type": "tool_use", "name": "get_weather", "input": {"city": "A", "unit": "c"}},
      {"type": "tool_use", "name": "get_weather", "input": {"city": "B", "unit": "c"}}]),
])
def test_streamed_blocks_equal_the_whole_reply(plan, pieces, reasoning, parser, omit, max_calls, expected):
    streamed, whole = _streamed_and_whole(plan, pieces, reasoning, parser, omit, max_calls)
    assert streamed == whole == expected


def test_stop_reasons():
    assert _stop_reason(FinishReason("stop", matched=2), False) == ("end_turn", None)
    assert _stop_reason(FinishReason("stop", matched="END"), False) == ("stop_sequence", "END")
    assert _stop_reason(FinishReason("stop", matched=2), True) == ("tool_use", None)
    assert _stop_reason(FinishReason("length"), True) == ("max_tokens", None)
    with pytest.raises(ApiError):
        _stop_reason(FinishReason("abort", message="aborted"), False)
