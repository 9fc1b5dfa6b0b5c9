"""The OpenAI Responses API (`/v1/responses`): the request, its input items and tools, and the response object.

The request is checked in two steps. The body's own fields are declared here (an unknown field is a 400 naming
it, as everywhere). `input` items and `tools` are declared loosely (objects) and read by `parse_input` and
`parse_tools`, one item at a time by its `type`, so that a wrong item is a 400 naming its place
(`input.2.call_id`, `tools.0.type`) with a message about that kind of item, instead of a union's error list.

Items are kept as plain dicts in OpenAI's shape once read: the response's `output` is built from them, and
the in-memory store keeps them to continue a conversation (`previous_response_id`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from server.protocol import ApiError, _has_lone_surrogate, _Request, _Response

HOSTED_TOOL_HINT = "only 'function' tools are served (the client runs them); this server has no built-in tools"


def validation_error(e: ValidationError, prefix: str) -> ApiError:
    """A pydantic error in a part of the body read after the request (an input item, a tool) as the 400 that
    http_server's handler would give, its param the full path (prefix + the error's location)."""
    first = e.errors()[0]
    param = ".".join([prefix, *(str(p) for p in first.get("loc", ()))])
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"{param}: duet does not support this field; remove it from the request", param)
    return ApiError(400, f"{param}: {first.get('msg', 'invalid value')}", param)


def _read(model: type[BaseModel], value, prefix: str):
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise validation_error(e, prefix) from None


# ---- request -------------------------------------------------------------------------------------


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    model: str | None = None  # the base model, a LoRA adapter's name, or "base:adapter"
    lora_path: str | None = None  # SGLang: the LoRA adapter (its name) the request runs with
    # A string (one user message) or a list of items: messages, function_call, function_call_output,
    # reasoning. Items are read by parse_input.
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None  # read by parse_tools
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # read by parse_tool_choice
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    # Echoed in the response, otherwise without effect on a single server.
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Declared so that they are refused with a reason (serving_responses), not as unknown fields.
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _echoed_text_is_unicode(cls, data):
        # These fields come back in the response: a lone surrogate there could not be encoded (the base class
        # checks every other field).
        if isinstance(data, dict):
            for k in ("metadata", "user", "safety_identifier", "prompt_cache_key"):
                if _has_lone_surrogate(data.get(k)):
                    raise ValueError(f"{k}: the string is not valid Unicode (it contains a lone surrogate escape "
                                     "such as \\ud800)")
        return data


# ---- input items ---------------------------------------------------------------------------------


class _Item(_Request):
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict]
    phase: Literal["commentary", "final_answer"] | None = None


class TextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # output_text parts of an earlier response carry these
    logprobs: list | None = None


class ImagePart(_Request):
    """An input_image part (a vision-language model's input: docs/vision.md); file_id needs a Files API, which
    this server has not."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not used (as chat's detail)


class RefusalPart(_Request):
    type: Literal["refusal"]
    refusal: str


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[dict] = Field(default_factory=list)
    content: list[dict] | None = None
    encrypted_content: str | None = None


_ITEMS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                  "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def _text_of(parts: str | list[dict], param: str, allowed=("input_text", "output_text")) -> str:
    """Content parts -> their text, joined by newlines (as chat joins text parts)."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        where = f"{param}.{j}"
        if kind == "refusal" and "refusal" in allowed:
            texts.append(_read(RefusalPart, part, where).refusal)
        elif kind in allowed:
            texts.append(_read(TextPart, part, where).text)
        else:
            raise ApiError(400, f"{where}.type: content parts of type {kind!r} are not supported; this server "
                                f"reads text only ({', '.join(allowed)})", f"{where}.type")
    return "\n".join(texts)


def _parts_with_images(parts: list[dict], param: str) -> list[dict]:
    """A message's text and input_image parts, in order, as stored items keep them."""
    out = []
    for j, part in enumerate(parts):
        where = f"{param}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            image = _read(ImagePart, part, where)
            if image.image_url is None:
                raise ApiError(400, f"{where}.image_url: an input_image needs image_url (file_id: this server has no "
                                    "Files API)", f"{where}.image_url")
            out.append({"type": "input_image", "image_url": image.image_url, "detail": image.detail})
        elif kind in ("input_text", "output_text"):
            out.append({"type": "input_text", "text": _read(TextPart, part, where).text})
        else:
            raise ApiError(400, f"{where}.type: content parts of type {kind!r} are not supported here; only "
                                "input_text and input_image", f"{where}.type")
    return out


def parse_input(value: str | list[dict]) -> list[dict]:
    """The request's input as items in OpenAI's shape: messages carry their text as one text part."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not value:
        raise ApiError(400, "input: the list of input items is empty", "input")
    items = []
    for i, raw in enumerate(value):
        where = f"input.{i}"
        kind = raw.get("type", "message" if "role" in raw else None)
        model = _ITEMS.get(kind)
        if model is None:
            hint = "it has no type" if kind is None else f"items of type {kind!r} are not supported"
            raise ApiError(400, f"{where}.type: {hint}; input items are message, function_call, "
                                "function_call_output or reasoning", f"{where}.type")
        item = _read(model, raw, where)
        if isinstance(item, MessageItem) and item.role != "assistant" and isinstance(item.content, list) and any(
                isinstance(p, dict) and p.get("type") == "input_image" for p in item.content):
            items.append({"type": "message", "role": item.role,
                          "content": _parts_with_images(item.content, f"{where}.content")})
        elif isinstance(item, MessageItem):
            allowed = ("input_text", "output_text", "refusal") if item.role == "assistant" else ("input_text",
                                                                                               "output_text")
            text = _text_of(item.content, f"{where}.content", allowed)
            part = "output_text" if item.role == "assistant" else "input_text"
            items.append({"type": "message", "role": item.role, "content": [{"type": part, "text": text}]})
        elif isinstance(item, FunctionCallItem):
            items.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                          "arguments": item.arguments})
        elif isinstance(item, FunctionCallOutputItem):
            output = _text_of(item.output, f"{where}.output", ("input_text",))
            items.append({"type": "function_call_output", "call_id": item.call_id, "output": output})
        else:
            items.append({"type": "reasoning"})  # not sent to the template (as chat's reasoning_content)
    return items


# ---- tools ---------------------------------------------------------------------------------------


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


def parse_tools(tools: list[dict] | None) -> list[FunctionTool]:
    out = []
    for i, raw in enumerate(tools or ()):
        kind = raw.get("type")
        if kind != "function":
            raise ApiError(400, f"tools.{i}.type: tools of type {kind!r} are not supported; {HOSTED_TOOL_HINT}",
                           f"tools.{i}.type")
        out.append(_read(FunctionTool, raw, f"tools.{i}"))
    if len({t.name for t in out}) != len(out):
        raise ApiError(400, "tools: function names must be unique", "tools")
    return out


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str


def parse_tool_choice(choice: str | dict | None, tools: list[FunctionTool]) -> str | FunctionChoice:
    """"none" | "auto" | "required" | the named function; unset means auto with tools, else none."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise ApiError(400, f"tool_choice.type: {choice.get('type')!r} is not supported; give \"none\", \"auto\", "
                            "\"required\" or {\"type\": \"function\", \"name\": ...}", "tool_choice.type")
    named = _read(FunctionChoice, choice, "tool_choice")
    if named.name not in {t.name for t in tools}:
        raise ApiError(400, f"tool_choice names the function {named.name!r}, which is not in tools", "tool_choice")
    return named


# ---- response objects ----------------------------------------------------------------------------


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(_Response):
    """A function call the model made (an output item)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(_Response):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(_Response):
    """The response (also what `response.created` and `response.completed` events carry)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: dict | None = None
    model: str
    output: list[OutputMessage | FunctionCallOutput | ReasoningOutput]
    usage: ResponseUsage | None = None
    # The request's fields, echoed.
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict | None = None
    store: bool
    temperature: float | None = None
    top_p: float | None = None
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    background: bool = False
    service_tier: str | None = None


class DeletedResponse(_Response):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
