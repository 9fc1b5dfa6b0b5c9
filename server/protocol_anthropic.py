"""The Anthropic Messages API's request, response and error models (`POST /v1/messages`,
`POST /v1/messages/count_tokens`).

As in protocol.py, an unknown field is a 400 naming it. Accepted without effect: `metadata` (user_id),
`service_tier`, and `cache_control` (top level and on blocks and tools: this server caches every prompt prefix
by itself). Image and document blocks pass validation as they are: serving_messages reads a user message's
image blocks (a vision-language model's input) and refuses the rest by position with a clear message.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from server.protocol import _Request

ANTHROPIC_PATH = "/v1/messages"


def uses_anthropic_errors(path: str) -> bool:
    """Whether an error at this path is answered in Anthropic's shape (the /v1/messages routes)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


# What each status is called in Anthropic's error body.
ERROR_TYPES: dict[int, str] = {400: "invalid_request_error", 401: "authentication_error",
                               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                               429: "rate_limit_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`; the message starts with "<field>: " when it is about
    one."""
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")  # 5xx: api_error
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- content blocks ------------------------------------------------------------------------------


def _blocks(value):
    """A string is one text block; anything else but a list is refused here (one clear error, not one per
    member of a union)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "must be a string or a list of content blocks")
    return value


def _string_or_blocks(schema: dict) -> None:
    """The OpenAPI schema of a _blocks field: a string, or the array pydantic documents."""
    array = {k: schema.pop(k) for k in ("type", "items") if k in schema}
    schema["anyOf"] = [{"type": "string"}, array]


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict
    cache_control: CacheControl | None = None


class UnsupportedBlock(BaseModel):
    """An image block (read by serving_messages in user messages) or a document block (refused there)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]


ToolResultContent = Annotated[list[Annotated[TextBlock | UnsupportedBlock, Field(discriminator="type")]],
                              BeforeValidator(_blocks), Field(json_schema_extra=_string_or_blocks)]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: ToolResultContent = Field(default_factory=list)
    is_error: bool = False  # the result is rendered as "Error: <content>"
    cache_control: CacheControl | None = None


class ThinkingBlock(_Request):
    """An earlier reply's reasoning: accepted and, like chat's reasoning_content, not sent to the template."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
                         | UnsupportedBlock, Field(discriminator="type")]
MessageContent = Annotated[list[ContentBlock], BeforeValidator(_blocks),
                           Field(json_schema_extra=_string_or_blocks)]
SystemContent = Annotated[list[TextBlock], BeforeValidator(_blocks), Field(json_schema_extra=_string_or_blocks)]


class AnthropicMessage(_Request):
    role: Literal["user", "assistant", "system"]
    content: MessageContent


# ---- tools, thinking, metadata ----------------------------------------------------------------------


class AnthropicTool(_Request):
    type: Literal["custom"] | None = None  # server tools (web search, code execution...) are not implemented
    # The same names the chat API takes (the tool-call grammar and parsers use them as written).
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict
    strict: bool | None = None  # as chat's `strict`: the grammar enforces the schema whenever a tool is forced
    cache_control: CacheControl | None = None


class ToolChoiceAuto(_Request):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Request):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Request):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Request):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class ThinkingEnabled(_Request):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)  # must be below max_tokens; not enforced beyond it (thinking counts there)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Request):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Request):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class Metadata(_Request):
    user_id: str | None = None


# ---- requests ------------------------------------------------------------------------------------


class PromptFields(_Request):
    """What decides the prompt: the fields count_tokens shares with a message request."""

    model: str | None = None  # required by Anthropic; left out, the served model (as on every route)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: SystemContent | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None
    chat_template_kwargs: dict | None = None  # extension (vLLM's too): extra variables for the chat template


class AnthropicMessagesRequest(PromptFields):
    max_tokens: int = Field(ge=1)
    lora_path: str | None = None  # SGLang: the LoRA adapter (its name) the request runs with
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


class AnthropicCountTokensRequest(PromptFields):
    pass


# ---- responses -----------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicUsage(_Response):
    input_tokens: int  # the whole prompt, as count_tokens counts it (cached prefixes included)
    output_tokens: int


class AnthropicMessageResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict]  # text, thinking and tool_use blocks
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicTokenCount(_Response):
    input_tokens: int


class AnthropicErrorInfo(_Response):
    type: str
    message: str


class AnthropicErrorResponse(_Response):
    """The body of every 4xx/5xx answer of the /v1/messages routes (Anthropic's shape)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
