"""/v1/responses (OpenAI's Responses API), run as a chat completion.

A Responses request becomes a chat request (`to_chat_request`): `instructions` a system message, input items
chat messages (`function_call` items an assistant message's tool_calls, `function_call_output` items tool
messages, `input_image` parts chat's image_url parts: docs/vision.md), function tools and `tool_choice` chat's, `text.format` a `response_format`, `max_output_tokens`
`max_completion_tokens`. serving_chat.prepare_chat makes it ready (the same prompt, sampling, grammars and
tool-call parsing as /v1/chat/completions) and its ChoiceOutput turns the text into deltas; one path
(`ResponseAssembler`) turns those deltas into output items and Responses events, streamed or not, so a streamed
response equals the same request not streamed. Errors chat raises name chat's fields: they are renamed to this
API's.

`store` (the default) keeps the response and its conversation (earlier turns, input and output items) in a
bounded in-memory store (the `STORE_SIZE` most recently used responses); `previous_response_id` continues
that conversation (its `instructions` are not carried over, as OpenAI does), and GET / DELETE
`/v1/responses/{id}` read and drop a stored response. The store lives in the HTTP process: a restart empties it.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from server.protocol import ApiError, ChatCompletionRequest
from server.protocol_responses import (
    DeletedResponse,
    FunctionChoice,
    ResponseObject,
    ResponsesRequest,
    parse_input,
    parse_tool_choice,
    parse_tools,
    validation_error,
)
from server.serving_chat import prepare_chat
from server.serving_common import (
    SSE_HEADERS,
    ServingContext,
    UsageTracker,
    sse,
    start_stream,
    unless_disconnected,
)
from server.tokenizer_manager import GenChunk

STORE_SIZE = 1024  # stored responses kept (least recently used dropped first)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the store -----------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    response: dict
    conversation: list[dict]  # the earlier turns' items, this input's and this output's (shared, never mutated)


class ResponseStore:
    """The most recently used `size` responses, by id."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> None:
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str = "response_id") -> StoredResponse:
        stored = self._items.get(rid)
        if stored is None:
            raise ApiError(404, f"{param}: no stored response with id {rid!r} (responses made with store=false "
                                f"are not kept, and this server keeps the {self.size} most recently used)",
                           param, "NotFoundError")
        self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]


# ---- request -> chat request ---------------------------------------------------------------------


def _refuse_unsupported(ctx: ServingContext, req: ResponsesRequest) -> None:
    def refuse(param: str, why: str):
        raise ApiError(400, f"{param}: {why}", param)

    if req.background:
        refuse("background", "background responses are not implemented; leave it unset or false")
    if req.conversation is not None:
        refuse("conversation", "conversations are not implemented; continue with previous_response_id")
    if req.prompt is not None:
        refuse("prompt", "stored prompt templates are not implemented; send input and instructions")
    if req.include:
        refuse("include", f"duet adds nothing to the output on request (got {req.include[0]!r}); leave it empty")
    if req.top_logprobs:
        refuse("top_logprobs", "logprobs are not implemented for responses; use /v1/chat/completions")
    if req.max_tool_calls is not None:
        refuse("max_tool_calls", "not implemented; use parallel_tool_calls=false for at most one call")
    if req.truncation == "auto":
        refuse("truncation", "automatic truncation is not implemented: an input longer than the context is a "
                             "400; leave it unset or 'disabled'")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        refuse("text.verbosity", "the model's verbosity cannot be steered; leave it unset or 'medium'")
    if req.stream_options is not None and not req.stream:
        refuse("stream_options", "only allowed together with stream=true")
    if req.reasoning is not None and ctx.chat_format.reasoning_parser is None:
        refuse("reasoning", "this model's chat template has no reasoning format (and no --reasoning-parser was given), so it cannot tell "
                            "reasoning from the answer")


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise ApiError(400, "text.format.schema: a format of type json_schema needs its schema",
                       "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "description": fmt.description, "strict": fmt.strict}}


def items_to_messages(items: list[dict], first: int, image_params: dict[str, str] | None = None,
                      base: int = 0) -> list[dict]:
    """Conversation items -> chat messages. first: the index of the request's own input in items (errors
    name `input.<i>`). image_params: filled with chat's param of each image part -> this API's (base: the
    messages that will go before these)."""
    messages: list[dict] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message" and any(p["type"] == "input_image" for p in item["content"]):
            parts = []
            for k, p in enumerate(item["content"]):
                if p["type"] == "input_image":
                    parts.append({"type": "image_url", "image_url": {"url": p["image_url"], "detail": p["detail"]}})
                    if image_params is not None:
                        image_params[f"messages.{base + len(messages)}.content.{k}"] = \
                            f"input.{i - first}.content.{k}" if i >= first else "previous_response_id"
                else:
                    parts.append({"type": "text", "text": p["text"]})
            messages.append({"role": item["role"], "content": parts})
        elif kind == "message":
            messages.append({"role": item["role"], "content": item["content"][0]["text"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            call_ids.add(item["call_id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls of one assistant turn
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in call_ids:
                param = f"input.{i - first}.call_id"
                raise ApiError(400, f"{param}: no function_call item with call_id {item['call_id']!r} comes "
                                    "before this output", param)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


@dataclass
class ResponsesPlan:
    chat: ChatCompletionRequest
    items: list[dict]  # the conversation so far: earlier turns and this input
    tools: list[dict]  # echoed
    tool_choice: str | dict  # echoed
    image_params: dict[str, str] = field(default_factory=dict)  # chat's param of an image part -> this API's


def to_chat_request(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest) -> ResponsesPlan:
    _refuse_unsupported(ctx, req)
    tools = parse_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice, tools)
    history = store.get(req.previous_response_id, "previous_response_id").conversation \
        if req.previous_response_id is not None else []
    items = history + parse_input(req.input)
    image_params: dict[str, str] = {}
    messages = items_to_messages(items, len(history), image_params, base=int(req.instructions is not None))
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise ApiError(400, "input: nothing to answer (only reasoning items)", "input")
    body = {
        "model": req.model, "lora_path": req.lora_path, "messages": messages, "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req),
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in tools] or None,
        "tool_choice": ({"type": "function", "function": {"name": choice.name}}
                        if isinstance(choice, FunctionChoice) else choice),
    }
    if req.reasoning is not None and req.reasoning.effort == "none":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # (what parse_* let through; named as chat names it)
        raise _renamed(validation_error(e, "request")) from None
    echoed_choice = choice.model_dump() if isinstance(choice, FunctionChoice) else choice
    return ResponsesPlan(chat, items, [t.model_dump() for t in tools], echoed_choice, image_params)


# Chat's names in its errors -> this API's.
_RENAMES = (("request.messages", "input"), ("request.", ""),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("the messages", "the input"), ("messages", "input"))


def _rename(text: str) -> str:
    for old, new in _RENAMES:
        text = text.replace(old, new)
    return text


def _renamed(e: ApiError, image_params: dict[str, str] | None = None) -> ApiError:
    param = e.param
    if image_params and param in image_params:
        return ApiError(e.status, f"{image_params[param]}: {e.message}", image_params[param], e.type)
    if param is not None:
        param = "input" if param.startswith(("messages", "request.messages")) else _rename(param)
    return ApiError(e.status, _rename(e.message), param, e.type)


# ---- chat deltas -> output items and events ------------------------------------------------------


class ResponseAssembler:
    """Reads one choice's deltas (ChoiceOutput.feed and finish, in chat's delta shape) and builds the
    response's output items, returning the Responses events each delta makes. Items come in the order the
    deltas do: reasoning, the message, the function calls. A message is opened at its first non-blank text
    (blank text before function calls is not a message, as chat gives content null then); a reply with no
    calls always has one (maybe empty)."""

    def __init__(self, response: dict, count_tokens, summarize: bool):
        self.response = response  # the response object so far (status in_progress)
        self.count_tokens = count_tokens
        self.summarize = summarize
        self.seq = 0
        self.output: list[dict] = []
        self.current: dict | None = None  # the item whose deltas are arriving
        self.blank = ""  # blank text not yet in a message
        self.calls: dict[int, dict] = {}  # chat's tool call index -> item
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    # -- items

    def _open(self, item: dict, part: dict | None) -> list[dict]:
        self.output.append(item)
        self.current = item
        index = len(self.output) - 1
        events = [self.event("response.output_item.added", output_index=index, item=dict(item, content=[])
                             if part is not None else dict(item))]
        if part is not None:
            item["content"] = [part]
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part, text="")))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.current = self.current, None
        if item is None:
            return []
        item["status"] = status
        index = self.output.index(item)
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events += [self.event(done, item_id=item["id"], output_index=index, content_index=0,
                                  text=part["text"], **extra),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
            if item["type"] == "reasoning" and self.summarize:
                item["summary"] = [{"type": "summary_text", "text": part["text"]}]
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.current is None or self.current["type"] != kind:
            if kind == "message" and not (self.blank + text).strip():
                self.blank += text
                return []
            events += self._close()
            if kind == "message":
                text, self.blank = self.blank + text, ""
                events += self._open_message()
            else:
                events += self._open({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                      "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        return events + self._delta(text)

    def _open_message(self) -> list[dict]:
        return self._open({"type": "message", "id": _new_id("msg"), "role": "assistant", "status": "in_progress"},
                          {"type": "output_text", "text": "", "annotations": []})

    def _delta(self, text: str) -> list[dict]:
        item = self.current
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if item["type"] == "message":
            return [self.event("response.output_text.delta", **where, delta=text, logprobs=[])]
        return [self.event("response.reasoning_text.delta", **where, delta=text)]

    def _call(self, delta: dict) -> list[dict]:
        events = []
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            events += self._close()
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": delta.get("id") or _new_id("call"),
                    "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
            self.calls[index] = item
            events += self._open(item, None)
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=arguments))
        return events

    # -- deltas

    def feed(self, delta: dict) -> list[dict]:
        """The events of one delta."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, delta: dict, reason: str) -> list[dict]:
        """The events of the last delta and of closing the reply; reason: chat's finish reason."""
        events = self.feed(delta)
        self.finish_reason = reason
        status = "incomplete" if reason == "length" else "completed"
        if not self.calls and not any(item["type"] == "message" for item in self.output):
            # No text but blanks, and no calls: the reply is a message of what there is (maybe empty).
            text, self.blank = self.blank, ""
            events += self._close()
            events += self._open_message()
            if text:
                events += self._delta(text)
        return events + self._close(status)

    def complete(self, usage: dict) -> dict:
        """The finished response (its status from the finish reason); usage: chat's usage body."""
        if self.finish_reason is None:
            raise ApiError(500, "generation ended without a finish reason")
        r = self.response
        if self.finish_reason == "length":
            r.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        elif self.finish_reason in ("stop", "tool_calls"):
            r.update(status="completed", completed_at=int(time.time()))
        else:
            r.update(status="failed", error={"code": "server_error", "message": "the request was aborted"})
        r["output"] = self.output
        reasoning = "".join(item["content"][0]["text"] for item in self.output if item["type"] == "reasoning")
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        r["usage"] = {"input_tokens": prompt,
                      "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens": completion,
                      "output_tokens_details": {"reasoning_tokens": min(self.count_tokens(reasoning), completion)
                                                if reasoning else 0},
                      "total_tokens": prompt + completion}
        return r

    def final_event(self) -> dict:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            self.response["status"], "response.failed")
        return self.event(kind, response=self.response)


def _sse_event(event: dict) -> str:
    return f"event: {event['type']}\n" + sse(event)


# ---- endpoints -----------------------------------------------------------------------------------


async def create_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, request: Request):
    model, _ = ctx.resolve_model(req.model, req.lora_path)  # (prepare_chat resolves the adapter again)
    plan = to_chat_request(ctx, store, req)
    defaults = ctx.sampling
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    response = ResponseObject(
        id=_new_id("resp"), created_at=int(time.time()), status="in_progress", model=model, output=[],
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
        reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning else None, store=req.store,
        temperature=req.temperature if req.temperature is not None else defaults.get("temperature"),
        top_p=req.top_p if req.top_p is not None else defaults.get("top_p"),
        text={"format": fmt or {"type": "text"}}, tool_choice=plan.tool_choice, tools=plan.tools,
        metadata=req.metadata or {}, user=req.user, service_tier=req.service_tier,
    ).model_dump()
    try:
        job = await prepare_chat(ctx, plan.chat)
    except ApiError as e:
        raise _renamed(e, plan.image_params) from None
    out = job.outs[0]
    tokenizer = ctx.tm.tokenizer
    summarize = bool(req.reasoning and (req.reasoning.summary or req.reasoning.generate_summary))
    asm = ResponseAssembler(response, lambda text: len(tokenizer.encode(text, add_special_tokens=False)), summarize)
    usage = UsageTracker(1, 1)

    def events(c: GenChunk) -> list[dict]:
        """The events of one chunk of the reply."""
        usage.update(c)
        evs = asm.feed(out.feed(c.text)) if c.text else []
        if c.finish:
            evs += asm.finish(out.finish(), out.finish_reason(c.finish.openai_reason))
        return evs

    def complete() -> dict:
        done = asm.complete(usage.body())
        if req.store and done["status"] != "failed":
            output = [item for item in done["output"] if item["type"] != "reasoning"]
            store.put(done["id"], StoredResponse(done, plan.items + output))
        return done

    if not req.stream:
        async def collect() -> dict:
            try:
                async for c in ctx.tm.generate(job.gen, job.rid):
                    events(c)
            except ApiError as e:
                raise _renamed(e) from None
            return complete()

        return await unless_disconnected(request, collect())

    try:
        generated = await start_stream(request, ctx.tm.generate(job.gen, job.rid))
    except ApiError as e:
        raise _renamed(e) from None
    if isinstance(generated, Response):
        return generated  # (the client left before the first token)

    async def stream() -> AsyncIterator[str]:
        for ev in asm.start():
            yield _sse_event(ev)
        try:
            async for c in generated:
                for ev in events(c):
                    yield _sse_event(ev)
        except ApiError as e:
            e = _renamed(e)
            yield _sse_event(asm.event("error", code=str(e.status), message=e.message, param=e.param))
            asm.response.update(status="failed", error={"code": "server_error", "message": e.message})
            yield _sse_event(asm.event("response.failed", response=asm.response))
            return
        finally:
            await generated.aclose()  # (a client gone mid-stream: the request is aborted now)
        complete()
        yield _sse_event(asm.final_event())

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


def retrieve_response(store: ResponseStore, response_id: str) -> dict:
    return store.get(response_id).response


def delete_response(store: ResponseStore, response_id: str) -> dict:
    store.delete(response_id)
    return DeletedResponse(id=response_id).model_dump()
