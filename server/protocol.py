"""The OpenAI-compatible (and SGLang-native) request and response models, and the API error type.

An unknown request field is a 400 naming it (``extra="forbid"``): nothing a client sends is silently
dropped. Fields with no effect on a single server (``NOOP_FIELDS``: user, store, metadata...) are accepted.
Shapes are validated here; ranges in ``SamplingParams.validate`` and in ``protocol_convert``.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 64  # choices per request; each one is a scheduler request
MAX_SUBREQUESTS = 256  # prompts x n per request


class ApiError(Exception):
    """An error that reaches the client as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES: ClassVar[dict[int, str]] = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
             404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or self.TYPES.get(status, "APIError")

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.type)


def error_body(status: int, message: str, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or ApiError.TYPES.get(status, "APIError"),
                      "param": param, "code": status}}


def _has_lone_surrogate(value) -> bool:
    """JSON may escape a lone surrogate ("\\ud800"), which Python decodes into a str that cannot be encoded
    as UTF-8: the tokenizer and the response encoder would fail on it (a 500). Strings in lists and dicts
    count too, at any depth (walked with a stack: a deeply nested value must not exhaust Python's recursion)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):  # e.g. content parts, which are plain dicts
            stack.extend(v)
            stack.extend(v.values())
    return False


# Fields that change nothing on a single server: accepted and otherwise unused (never checked further).
NOOP_FIELDS = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")
# What to say about an OpenAI field duet does not implement, beyond naming it.
UNSUPPORTED_HINTS = {
    "functions": "use tools",
    "function_call": "use tool_choice",
    "audio": "this server generates text only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "use chat_template_kwargs (e.g. enable_thinking) for models that support it",
    "web_search_options": "no built-in tools are implemented",
}


class _Request(BaseModel):
    # An unknown field is a 400 naming it (http_server's validation handler words it): a client that sends
    # a field must learn that it had no effect. NOOP_FIELDS are declared where they are accepted.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # Clients often send `"n": null`, `"stream": null`...: treat an explicit null as "not given".
        if isinstance(data, dict):
            for k, v in data.items():
                if k in cls.model_fields and k not in NOOP_FIELDS and _has_lone_surrogate(v):
                    raise ValueError(f"{k}: the string is not valid Unicode (it contains a lone surrogate "
                                     "escape such as \\ud800)")
            return {k: v for k, v in data.items() if v is not None}
        return data


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat; None means "the server's default"."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # No effect on a single server (NOOP_FIELDS).
    user: object | None = None
    store: object | None = None
    metadata: object | None = None
    service_tier: object | None = None
    safety_identifier: object | None = None
    prompt_cache_key: object | None = None
    # Extensions (vLLM and SGLang accept them too).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    regex: str | None = None  # SGLang: the output matches this regular expression
    ebnf: str | None = None  # SGLang: the output follows this EBNF grammar (GBNF dialect)
    # vLLM's output-text options: special tokens left out (true) or written; written ones set apart by
    # spaces (false: as the fast tokenizers write them, which is vLLM's and SGLang's output whatever this
    # says); the stop string that ended the output kept at its end.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    priority: int | None = None  # vLLM/SGLang: only 0 (this server schedules first come, first served)


class CompletionRequest(_SamplingFields):
    lora_path: str | None = None  # SGLang: the LoRA adapter (its name) the request runs with
    # A string, a list of token ids, or a batch of either.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # with logprobs: the prompt tokens' logprobs come first (the first one None)
    prompt_logprobs: int | None = None  # vLLM: each choice's prompt_logprobs, with this many alternatives
    best_of: int | None = None  # accepted when equal to n (the same thing); more is a 400
    suffix: str | None = None  # accepted when empty; insertion is not implemented


class FunctionCall(_Request):
    name: str
    arguments: str = ""


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string or content parts; parts are checked by serving_chat (only text parts are supported).
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant, from a reasoning parser; not sent to the template
    refusal: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    lora_path: str | None = None  # SGLang: the LoRA adapter (its name) the request runs with
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True  # the template's assistant-turn opening after the messages
    continue_final_message: bool = False  # the last message left open for the model to continue


class GenerateSamplingParams(_Request):
    """SGLang's native sampling parameters (`/generate`)."""

    max_new_tokens: int = 128
    temperature: float | None = None  # None: the model's default (--sampling-defaults), else OpenAI's
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None  # SGLang: the schema as a JSON string
    regex: str | None = None
    ebnf: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False
    no_stop_trim: bool = False  # SGLang: the stop string or stop token that ended the output is kept


class GenerateRequest(_Request):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt logprobs from this prompt position on (-1: none), in meta_info.input_token_logprobs.
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False  # each logprob entry carries its token's text
    priority: int | None = None  # SGLang: only 0 (this server schedules first come, first served)
    lora_path: str | None = None  # the LoRA adapter (its name) the request runs with


class LoadLoraAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # kept in the device pool: never evicted for another adapter


class UnloadLoraAdapterRequest(_Request):
    lora_name: str = Field(min_length=1)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Response):
    """The body of every 4xx/5xx answer (OpenAI's shape); documented in the OpenAPI spec for each route."""

    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict | None] | None = None  # vLLM's, when the request asks for them


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "duet"
    root: str | None = None
    max_model_len: int | None = None
    capabilities: dict | None = None
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
