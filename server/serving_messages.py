"""/v1/messages and /v1/messages/count_tokens: the Anthropic Messages API, run as a chat completion.

A request becomes a ChatCompletionRequest (system and text blocks -> messages, tool_use blocks -> the
assistant's tool_calls, tool_result blocks -> tool messages, tool_choice auto/any/tool/none -> auto/required/
named/none, stop_sequences -> stop) and serving_chat.prepare_chat makes it ready: the same prompt, sampling,
grammars and tool-call parsing as /v1/chat/completions. This module converts the blocks in and the reply out:
content blocks (thinking, text, tool_use), stop_reason end_turn / max_tokens / stop_sequence (with the
sequence) / tool_use, usage, and the event stream (message_start, ping, content_block_start / delta / stop,
message_delta, message_stop; an error after the first event is an `error` event).

Field handling beyond the obvious: `thinking` enabled or adaptive needs a reasoning parser (else a 400); it
sets the template's `enable_thinking` (disabled: false), and the parser's reasoning becomes a `thinking`
block (`budget_tokens` must be below max_tokens and is not enforced beyond it).
`tool_choice.disable_parallel_tool_use` keeps one call. A tool_result's `is_error` is rendered as
"Error: <content>". Thinking blocks of earlier turns are not sent to the template (as chat's
reasoning_content). Image blocks of user messages (base64 or url sources) are chat's image_url parts, for a
vision-language model (docs/vision.md). A final assistant message (a prefill to continue), document blocks and
images elsewhere are refused by name. usage.input_tokens counts the whole prompt, prefix-cached tokens included (what
count_tokens returns).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from server.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)
from server.protocol_anthropic import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    PromptFields,
    TextBlock,
    ThinkingAdaptive,
    ThinkingEnabled,
    UnsupportedBlock,
    anthropic_error_body,
)
from server.serving_chat import ChatJob, prepare_chat
from server.serving_common import SSE_HEADERS, ServingContext, sse, start_stream, unless_disconnected

# Chat request fields -> the Anthropic fields they came from, for the errors prepare_chat raises.
_PARAMS = {"stop": "stop_sequences"}


# ---- request: Anthropic -> chat ------------------------------------------------------------------------


def _unsupported(block: UnsupportedBlock, where: str) -> ApiError:
    return ApiError(400, f"{block.type} blocks are not supported: this server serves a text-only model", where)


def _texts(blocks: list, where: str) -> str:
    parts = []
    for k, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            if isinstance(b, UnsupportedBlock):
                raise _unsupported(b, f"{where}.{k}")
            raise ApiError(400, f"only text blocks may appear here, not {b.type}", f"{where}.{k}")
        parts.append(b.text)
    return "\n".join(parts)


def _image_url(block: UnsupportedBlock, where: str) -> str:
    """An image block's source as an image URL: base64 data as a data: URL, a url source as it is."""
    source = getattr(block, "source", None)
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type")
        if media not in IMAGE_MEDIA_TYPES:
            raise ApiError(400, f"source.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}", where)
        return f"data:{media};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError(400, "an image block needs source {type: base64, media_type, data} or {type: url, url}", where)


# Anthropic's image media types
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def chat_messages(req: PromptFields, image_params: dict[str, str] | None = None) -> list[ChatMessage]:
    """The chat messages of the request; image blocks become image_url parts, whose chat error params map to
    the blocks' in image_params (chat's -> Anthropic's)."""
    out = []
    if req.system:
        out.append(ChatMessage(role="system", content=_texts(req.system, "system")))
    tool_ids: set[str] = set()
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role == "system":
            out.append(ChatMessage(role="system", content=_texts(m.content, f"{where}.content")))
            continue
        if i == last and m.role == "assistant":
            raise ApiError(400, "the last message is the assistant's: continuing a prefilled reply is not "
                                "supported; end with a user message", f"{where}.role")
        texts, calls, results, parts = [], [], [], []
        for j, b in enumerate(m.content):
            at = f"{where}.content.{j}"
            if isinstance(b, UnsupportedBlock) and b.type == "image" and m.role == "user":
                parts.append((at, {"type": "image_url", "image_url": {"url": _image_url(b, at)}}))
                continue
            if isinstance(b, UnsupportedBlock):
                raise _unsupported(b, at)
            if b.type == "text":
                texts.append(b.text)
                parts.append((at, {"type": "text", "text": b.text}))
            elif b.type == "tool_use":
                if m.role != "assistant":
                    raise ApiError(400, "tool_use blocks belong in assistant messages", at)
                arguments = json.dumps(b.input)
                calls.append(ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=arguments)))
                tool_ids.add(b.id)
            elif b.type == "tool_result":
                if m.role != "user":
                    raise ApiError(400, "tool_result blocks belong in user messages", at)
                if b.tool_use_id not in tool_ids:
                    raise ApiError(400, f"no earlier tool_use block has the id {b.tool_use_id!r}",
                                   f"{at}.tool_use_id")
                text = _texts(b.content, f"{at}.content")
                results.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                           content=f"Error: {text}" if b.is_error else text))
            elif m.role != "assistant":  # thinking, redacted_thinking: not rendered (see the module's doc)
                raise ApiError(400, f"{b.type} blocks belong in assistant messages", at)
        out.extend(results)  # tool results answer the assistant turn before them: ahead of the user's text
        if results and not texts and len(parts) == len(texts):
            continue
        if len(parts) > len(texts):  # with images: the parts in order
            for k, (at, part) in enumerate(parts):
                if image_params is not None:
                    image_params[f"messages.{len(out)}.content.{k}"] = at
            out.append(ChatMessage(role=m.role, content=[part for _, part in parts], tool_calls=calls or None))
            continue
        out.append(ChatMessage(role=m.role, content="\n".join(texts), tool_calls=calls or None))
    return out


def _thinking(req: PromptFields) -> tuple[bool | None, bool]:
    """(enable_thinking for the template or None, whether the thinking text is omitted)."""
    t = req.thinking
    if t is None:
        return None, False
    if isinstance(t, ThinkingEnabled | ThinkingAdaptive):
        if isinstance(t, ThinkingEnabled) and isinstance(req, AnthropicMessagesRequest) \
                and t.budget_tokens >= req.max_tokens:
            raise ApiError(400, f"must be less than max_tokens ({req.max_tokens}), got {t.budget_tokens}",
                           "thinking.budget_tokens")
        return True, t.display == "omitted"
    return False, False


def chat_request(req: PromptFields, image_params: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat request that renders the same prompt and samples as asked (image_params: chat_messages')."""
    fields: dict = {"model": req.model, "messages": chat_messages(req, image_params)}
    if req.tools:
        fields["tools"] = [ToolDefinition(function=FunctionDefinition(name=t.name, description=t.description,
                                                                      parameters=t.input_schema, strict=t.strict))
                           for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            NamedToolChoice(function=NamedFunction(name=choice.name))
        if getattr(choice, "disable_parallel_tool_use", False):
            fields["parallel_tool_calls"] = False
    enable, _ = _thinking(req)
    kwargs = dict(req.chat_template_kwargs or {})
    if enable is not None:
        kwargs.setdefault("enable_thinking", enable)
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    if isinstance(req, AnthropicMessagesRequest):
        fields.update(lora_path=req.lora_path, max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stream=req.stream)
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:  # the blocks were checked: not expected, but a 400 rather than a 500
        err = e.errors()[0]
        raise ApiError(400, f"the request cannot be converted: {err['msg']}") from None


async def _prepare(ctx: ServingContext, req: PromptFields) -> ChatJob:
    image_params: dict[str, str] = {}
    chat = chat_request(req, image_params)
    try:
        job = await prepare_chat(ctx, chat)
    except ApiError as e:
        param = _PARAMS.get(e.param) or image_params.get(e.param)
        if param is not None:
            raise ApiError(e.status, e.message, param, e.type) from None
        raise
    if req.thinking is not None and req.thinking.type != "disabled" and job.outs[0].fmt.reasoning_parser is None:
        raise ApiError(400, f"type {req.thinking.type!r} needs a reasoning parser: start the server with "
                            "--reasoning-parser (qwen3 or deepseek-r1)", "thinking")
    return job


# ---- reply: chat -> Anthropic --------------------------------------------------------------------------


def _stop_reason(finish, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished request."""
    if finish.kind == "length":
        return "max_tokens", None
    if finish.kind != "stop":
        raise ApiError(503, f"the request was aborted: {finish.message or finish.kind}")
    if has_calls:
        return "tool_use", None
    if isinstance(finish.matched, str):
        return "stop_sequence", finish.matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class _Reply:
    """The one choice's output as Anthropic content blocks, streamed or whole. Text made only of whitespace
    is held until more text follows (a reply that turns out to be tool calls drops it, as chat's message
    does), so the streamed blocks always equal the non-streamed ones."""

    def __init__(self, job: ChatJob, omit_thinking: bool, max_calls: int | None):
        self.out = job.outs[0]
        self.omit_thinking = omit_thinking
        self.max_calls = max_calls
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.call_index: int | None = None  # the chat tool call it streams
        self.pending = ""  # leading whitespace of a text block not opened yet
        self.num_calls = 0

    # streaming: deltas (chat's shape) -> events

    def events(self, delta: dict) -> list[tuple[str, dict]]:
        ev: list[tuple[str, dict]] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                ev += self._start({"type": "thinking", "thinking": "", "signature": ""})
            if not self.omit_thinking:
                ev.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            text = self.pending + delta["content"]
            if self.open != "text" and not text.strip():
                self.pending = text
            else:
                self.pending = ""
                if self.open != "text":
                    ev += self._start({"type": "text", "text": ""})
                ev.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            fn = call["function"]
            if "id" in call:  # a new call
                if self.max_calls is not None and self.num_calls >= self.max_calls:
                    continue
                self.num_calls += 1
                self.pending = ""
                ev += self._start({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}})
                self.call_index = call["index"]
            elif self.open != "tool_use" or call["index"] != self.call_index:
                continue
            if fn.get("arguments"):
                ev.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return ev

    def close(self, finish_delta: dict) -> list[tuple[str, dict]]:
        ev = self.events(finish_delta)
        if self.pending and not self.out.calls:
            ev += self._start({"type": "text", "text": ""})
            ev.append(self._delta({"type": "text_delta", "text": self.pending}))
        if self.open is not None:
            ev.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None
        return ev

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        ev = []
        if self.open is not None:
            ev.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.index += 1
        self.open = block["type"]
        ev.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                           "content_block": block}))
        return ev

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    # whole: the finished output -> blocks

    def blocks(self) -> list[dict]:
        msg = self.out.message()
        out = []
        if self.out.reasoning_text:
            out.append({"type": "thinking", "thinking": "" if self.omit_thinking else self.out.reasoning_text,
                        "signature": ""})
        if msg["content"]:
            out.append({"type": "text", "text": msg["content"]})
        for call in self.out.calls[:self.max_calls]:
            value = _tool_input(call.arguments)
            if value is None:  # a forced call cut short (max_tokens): what was written, as text
                out.append({"type": "text", "text": call.arguments})
            else:
                out.append({"type": "tool_use", "id": call.id, "name": call.name, "input": value})
        return out


def _max_calls(req: PromptFields) -> int | None:
    return 1 if getattr(req.tool_choice, "disable_parallel_tool_use", False) else None


def _event(name: str, data: dict) -> str:
    return f"event: {name}\n{sse(data)}"


async def create_message(ctx: ServingContext, req: AnthropicMessagesRequest, request: Request):
    job = await _prepare(ctx, req)
    tm = ctx.tm
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    reply = _Reply(job, _thinking(req)[1], _max_calls(req))
    prompt_tokens = len(job.input_ids)

    if req.stream:
        generated = await start_stream(request, tm.generate(job.gen, rid))
        if isinstance(generated, Response):
            return generated

        async def stream() -> AsyncIterator[str]:
            try:
                yield _event("message_start", {"type": "message_start", "message": {
                    "id": rid, "type": "message", "role": "assistant", "model": job.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
                yield _event("ping", {"type": "ping"})
                async for c in generated:
                    events = reply.events(reply.out.feed(c.text)) if c.text else []
                    if c.finish:
                        events += reply.close(reply.out.finish())
                        stop_reason, stop_sequence = _stop_reason(c.finish, reply.num_calls > 0)
                        events.append(("message_delta", {
                            "type": "message_delta",
                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens}}))
                        events.append(("message_stop", {"type": "message_stop"}))
                    for name, data in events:
                        yield _event(name, data)
            except ApiError as e:
                yield _event("error", anthropic_error_body(e.status, e.message, e.param))

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect() -> dict:
        last = None
        async for c in tm.generate(job.gen, rid):
            if c.text:
                reply.out.feed(c.text)
            if c.finish:
                reply.out.finish()
                last = c
        content = reply.blocks()
        stop_reason, stop_sequence = _stop_reason(last.finish, any(b["type"] == "tool_use" for b in content))
        return {"id": rid, "type": "message", "role": "assistant", "model": job.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": last.prompt_tokens, "output_tokens": last.completion_tokens}}

    return await unless_disconnected(request, collect())


async def count_tokens(ctx: ServingContext, req: AnthropicCountTokensRequest) -> dict:
    """The prompt's tokens as /v1/messages renders it (its usage.input_tokens)."""
    job = await _prepare(ctx, req)
    return {"input_tokens": len(job.input_ids)}
