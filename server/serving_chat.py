"""/v1/chat/completions: messages through the chat template (with tools and chat_template_kwargs), n choices,
structured outputs, tool calls (`tool_choice` none/auto/required/named) and reasoning content.

Tools work with no flags: server/chat_tools.py resolves at start-up which format the model's template uses
(or duet's default format, for a template that renders no tools) and which parsers read the output.
`auto` reads the calls the model wrote with that format's parser (no parser: the reply is text);
`required` and a named function are enforced with a grammar that writes the calls in the same format (in
vLLM's JSON shapes when the format is unknown), so the calls always parse.

The pieces other endpoints reuse: `prepare_chat` (a chat request -> a ChatJob ready to run),
`convert_messages` (OpenAI messages -> template dicts), `encode_chat` (dicts -> prompt ids, with the default
tool format applied), `plan_tools` (tool_choice -> ToolPlan, with its grammar) and `ChoiceOutput` (one
choice's text -> content, reasoning and tool calls, streamed or whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from model_executor.sampling_params import MAX_TOP_LOGPROBS, GrammarSpec
from scheduler.io_struct import ImageInput
from server.chat_tools import (
    ChatFormat,
    named_call_affixes,
    parse_forced_calls,
    prepare_tool_messages,
    tool_choice_grammar,
)
from server.multimodal import ImageRef
from server.protocol import ApiError, ChatCompletionRequest, ChatMessage, NamedToolChoice
from server.protocol_convert import (
    build_params,
    check_n,
    check_priority,
    choices_params,
    logit_bias_pairs,
    request_grammar,
)
from server.reasoning_parser import HarmonyStream, ReasoningStream, make_reasoning_stream
from server.serving_common import (
    SSE_DONE,
    SSE_HEADERS,
    ChoiceChunks,
    ServingContext,
    UsageTracker,
    chat_logprobs,
    check_stream_options,
    sse,
    start_stream,
    unless_disconnected,
)
from server.tokenizer_manager import GenRequest
from server.tool_parsers import ParsedToolCall, ToolCallStream, make_tool_parser


def _arguments_for_template(arguments: str):
    """Templates render arguments with `tojson`: give them the object, not its JSON text (else it is
    encoded twice)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


IMAGE_DETAILS = ("auto", "low", "high")  # accepted; the image processor's own resizing decides the detail


def image_part(part: dict, where: str) -> ImageRef:
    """An OpenAI `image_url` content part's image (`{"url": ..., "detail": ...}`, or the URL alone)."""
    spec = part.get("image_url")
    if isinstance(spec, str):
        spec = {"url": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise ApiError(400, "an image_url part needs image_url.url, a string", where)
    unknown = sorted(set(spec) - {"url", "detail"}) + sorted(set(part) - {"type", "image_url"})
    if unknown:
        raise ApiError(400, f"unknown fields in the image part: {', '.join(unknown)}", where)
    if spec.get("detail") is not None and spec["detail"] not in IMAGE_DETAILS:
        raise ApiError(400, f"image_url.detail must be one of {', '.join(IMAGE_DETAILS)}", where)
    return ImageRef(spec["url"], where)


def convert_messages(messages: list[ChatMessage], images: list[ImageRef] | None = None) -> list[dict]:
    """OpenAI messages -> template dicts. Image parts are appended to `images` (in order) and become
    {"type": "image"} parts of a content list; images None: an image part is a 400."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts, texts, has_image = [], [], False
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                where = f"messages.{i}.content.{j}"
                if kind == "image_url" and images is not None:
                    images.append(image_part(part, where))
                    parts.append({"type": "image"})
                    has_image = True
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    supported = "text and image_url" if images is not None else "text"
                    raise ApiError(400, f"content parts of type {kind!r} are not supported here; only {supported}",
                                   where)
                parts.append({"type": "text", "text": part["text"]})
                texts.append(part["text"])
            content = parts if has_image else "\n".join(texts)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, "only assistant messages may carry tool_calls", f"messages.{i}.tool_calls")
            msg["tool_calls"] = [{"id": c.id or f"call_{k}", "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": _arguments_for_template(c.function.arguments)}}
                                 for k, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ApiError(400, "a tool message needs tool_call_id", f"messages.{i}.tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


async def encode_chat(ctx: ServingContext, messages: list[dict], tools: list[dict] | None = None,
                      template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, param: str = "continue_final_message",
                      images: list[ImageRef] | None = None) -> tuple[list[int], list[ImageInput] | None]:
    """The prompt ids of chat messages (convert_messages' dicts) and tools (function definitions) through the
    chat template, in duet's default tool format when the template renders no tools (chat_tools); with images
    (convert_messages' refs), also the processed images, whose pad tokens the ids hold."""
    if continue_final_message and add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true (set "
                            "add_generation_prompt to false to continue the last message)", param)
    messages, tools = prepare_tool_messages(ctx.chat_format, messages, tools)
    kwargs = {"tools": tools, "template_kwargs": template_kwargs, "add_generation_prompt": add_generation_prompt,
              "continue_final_message": continue_final_message}
    if images:
        return await asyncio.to_thread(functools.partial(ctx.tm.encode_chat_images, messages, images, **kwargs))
    return await ctx.tm.encode_chat_async(messages, **kwargs), None


@dataclass
class ToolPlan:
    """What a request's tools and tool_choice ask for. mode: "none" | "auto" | "required" | "named"."""

    mode: str
    tools: list[dict] | None = None  # function definitions, for the chat template
    name: str | None = None  # the named function
    grammar: GrammarSpec | None = None  # required / named: the constraint that writes the calls


def plan_tools(ctx: ServingContext, tools: list[dict] | None, choice: str | None, name: str | None = None,
               parallel: bool = True, param: str = "tool_choice") -> ToolPlan:
    """tools: function definitions ({"name", "description", "parameters"}) or None; choice: "none", "auto",
    "required", "named" (with name) or None (auto with tools, else none). A 400 naming `param` for a choice
    that cannot be served."""
    choice = choice if choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none", tools)
    if not tools:
        raise ApiError(400, f"{param} needs tools", param)
    if len({t["name"] for t in tools}) != len(tools):
        raise ApiError(400, "tool function names must be unique", "tools")
    if choice == "auto":  # without a parser the reply is text, never a 400
        return ToolPlan("auto", tools)
    if not ctx.grammar_enabled:
        raise ApiError(400, f"{param} {choice if choice == 'required' else 'with a named function'} is "
                            "enforced with a grammar; structured outputs are off (--grammar-backend none)", param)
    if choice == "named" and name not in {t["name"] for t in tools}:
        raise ApiError(400, f"{param} names the function {name!r}, which is not in tools", param)
    named = name if choice == "named" else None
    grammar = tool_choice_grammar(ctx.chat_format.tool_parser, tools, named, parallel)
    return ToolPlan(choice, tools, named, grammar)


def _chat_plan(ctx: ServingContext, req: ChatCompletionRequest) -> ToolPlan:
    tools = [t.function.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice, name = req.tool_choice, None
    if isinstance(choice, NamedToolChoice):
        choice, name = "named", choice.function.name
    return plan_tools(ctx, tools, choice, name, req.parallel_tool_calls)


@dataclass
class ChoiceOutput:
    """One choice's reply assembled from its text: reasoning, content and tool calls.

    feed(text) gives the delta fields to send now, finish() the last ones; afterwards `content`,
    `reasoning_text` and `calls` hold the whole reply and message() its OpenAI message. Streamed and
    non-streamed replies go through the same steps, so they are equal. A named call whose arguments are JSON
    streams them as they are written (between the format's fixed text before and after them)."""

    plan: ToolPlan
    fmt: ChatFormat
    reasoning: ReasoningStream | HarmonyStream | None = None
    tool_stream: ToolCallStream | None = None
    reasoning_text: str = ""
    content: str = ""
    raw: str = ""  # the constrained reply of required/named
    args_sent: int = 0  # named: characters of its arguments already sent
    named_started: bool = False  # named: its first delta (id, name) was sent
    calls: list[ParsedToolCall] = field(default_factory=list)
    named_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def __post_init__(self):
        if self.fmt.reasoning_parser is not None and self.plan.mode in ("none", "auto"):
            self.reasoning = make_reasoning_stream(self.fmt.reasoning_parser)
        if self.plan.mode == "auto" and self.fmt.tool_parser is not None:
            self.tool_stream = ToolCallStream(make_tool_parser(self.fmt.tool_parser, self.plan.tools))
        self.affixes = (named_call_affixes(self.fmt.tool_parser, self.plan.name)
                        if self.plan.mode == "named" else None)

    def _named_delta(self, arguments: str) -> dict:
        call = {"index": 0, "function": {"arguments": arguments}}
        if not self.named_started:
            self.named_started = True
            call.update(id=self.named_id, type="function")
            call["function"] = {"name": self.plan.name, "arguments": arguments}
        self.args_sent += len(arguments)
        return {"tool_calls": [call]}

    def _named_arguments(self, final: bool) -> str:
        """The arguments written so far: while streaming, without what may be the start of the closing text."""
        head, tail = self.affixes
        if not final:
            return self.raw[len(head):max(len(head), len(self.raw) - len(tail))]
        if self.raw.endswith(tail) and len(self.raw) >= len(head) + len(tail):
            return self.raw[len(head):len(self.raw) - len(tail)]
        args = self.raw[len(head):]  # cut short (max_tokens), maybe inside the closing text
        for k in range(min(len(tail), len(args)) - 1, 0, -1):
            if args.endswith(tail[:k]):
                with contextlib.suppress(json.JSONDecodeError):
                    json.loads(args[:-k])
                    return args[:-k]
        return args

    def feed(self, text: str) -> dict:
        """The delta fields to send now for this text."""
        delta: dict = {}
        if self.plan.mode in ("required", "named"):
            self.raw += text
            if self.affixes is not None:
                new = self._named_arguments(final=False)[self.args_sent:]
                if new:
                    delta = self._named_delta(new)
            return delta
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        self._add(delta, reasoning, content)
        return delta

    def _add(self, delta: dict, reasoning: str, content: str) -> None:
        if reasoning:
            self.reasoning_text += reasoning
            delta["reasoning_content"] = reasoning
        if self.tool_stream is not None and content:
            content = self.tool_stream.feed(content)
        if content:
            self.content += content
            delta["content"] = content

    def finish(self) -> dict:
        """The last delta fields (held-back text, the parsed calls)."""
        delta: dict = {}
        if self.plan.mode == "named" and self.affixes is not None:
            arguments = self._named_arguments(final=True)
            rest = arguments[self.args_sent:]
            if rest or not self.named_started:  # an empty reply still names the call
                delta = self._named_delta(rest)
            self.calls = [ParsedToolCall(self.plan.name, arguments, self.named_id)]
            return delta
        if self.plan.mode in ("required", "named"):
            calls = parse_forced_calls(self.fmt.tool_parser, self.raw, self.plan.tools, self.plan.name) or []
            if self.plan.mode == "named":
                calls = [ParsedToolCall(c.name, c.arguments, self.named_id) for c in calls[:1]]
            self.calls = calls
            if calls:
                delta["tool_calls"] = [c.to_openai(i) for i, c in enumerate(calls)]
            else:  # cut short (max_tokens): what was written is all there is
                self.content = self.raw
                delta["content"] = self.raw
            return delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            self._add(delta, reasoning, content)
        if self.tool_stream is not None:
            rest, self.calls = self.tool_stream.finish()
            if rest:
                self.content += rest
                delta["content"] = delta.get("content", "") + rest
            if self.calls:
                delta["tool_calls"] = [c.to_openai(i) for i, c in enumerate(self.calls)]
        return delta

    def message(self) -> dict:
        msg = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.calls and self.plan.mode == "auto" and not self.content.strip():
            msg["content"] = None
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning_text or None
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" and self.plan.mode != "named" else reason


def chunk_deltas(out: ChoiceOutput, text: str, finished: bool) -> list[dict]:
    """The non-empty deltas one engine chunk streams: its text's, then, when it is the last, the finish's. Two
    deltas, not one merged: the finish's fields may repeat the text's keys (held-back text, a named call's
    last arguments)."""
    deltas = [out.feed(text)] if text else []
    if finished:
        deltas.append(out.finish())
    return [d for d in deltas if d]


@dataclass
class ChatJob:
    """A chat request made ready to run: its prompt, one scheduler request per choice, and per choice the state
    that turns its text into a message. /v1/messages and /v1/responses run the same jobs (serving_messages.py,
    serving_responses.py)."""

    model: str
    input_ids: list[int]
    gen: list[GenRequest]
    outs: list[ChoiceOutput]
    num_top: int | None
    rid: str
    created: int


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> ChatJob:
    """Everything before generation: checks, the rendered prompt, sampling parameters, tool plan."""
    tm = ctx.tm
    model, lora = ctx.resolve_model(req.model, req.lora_path)
    check_stream_options(req)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                           "top_logprobs")
        if not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    check_n(req.n)
    check_priority(req.priority)
    images: list[ImageRef] = []
    messages = convert_messages(req.messages, images)
    plan = _chat_plan(ctx, req)
    grammar, grammar_param = request_grammar(req, ctx.grammar_enabled)
    if plan.grammar is not None:
        if grammar is not None:
            raise ApiError(400, f"{grammar_param} cannot be combined with tool_choice {plan.mode}", grammar_param)
        grammar, grammar_param = plan.grammar, "tools"
    input_ids, image_inputs = await encode_chat(ctx, messages, plan.tools, req.chat_template_kwargs,
                                                req.add_generation_prompt, req.continue_final_message, images=images)
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    elif req.max_tokens is not None:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    else:
        max_tokens, max_param = tm.default_max_tokens(len(input_ids), "messages"), "max_tokens"
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = build_params(defaults=ctx.sampling, max_tokens=max_tokens, temperature=req.temperature,
                          top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop,
                          stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                          min_tokens=req.min_tokens, top_logprobs=num_top,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, logit_bias=logit_bias_pairs(req.logit_bias),
                          grammar=grammar,
                          skip_special_tokens=req.skip_special_tokens and not ctx.chat_format.reads_special_tokens,
                          spaces_between_special_tokens=req.spaces_between_special_tokens,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          param_names={"max_tokens": max_param})
    tm.check_token_ids(params.stop_token_ids, "stop_token_ids")
    tm.check_token_ids([t for t, _ in params.logit_bias], "logit_bias")
    tm.check_length(len(input_ids), max_tokens, "messages", max_param)
    tm.check_alive()
    n = req.n
    gen = [GenRequest(input_ids, p, grammar_param, lora_name=lora, images=image_inputs)
           for p in choices_params(params, n)]
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    outs = [ChoiceOutput(plan, ctx.chat_format) for _ in range(n)]
    return ChatJob(model, input_ids, gen, outs, num_top, rid, created)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, request: Request):
    job = await prepare_chat(ctx, req)
    tm, n, model, num_top, gen, rid, created, outs = (ctx.tm, req.n, job.model, job.num_top, job.gen, job.rid,
                                                      job.created, job.outs)
    as_ids = req.return_tokens_as_token_ids

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        generated = await start_stream(request, tm.generate(gen, rid))
        if isinstance(generated, Response):
            return generated

        async def stream() -> AsyncIterator[str]:
            usage = UsageTracker(n, 1)

            chunks = ChoiceChunks(rid, "chat.completion.chunk", created, model)

            def chunk(index: int, delta: dict, logprobs=None, finish=None) -> str:
                return chunks(index, {"delta": delta, "logprobs": logprobs, "finish_reason": finish})
            try:
                for i in range(n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                async for c in generated:
                    usage.update(c)
                    out = outs[c.index]
                    lp = None
                    if num_top is not None and c.logprobs:
                        lp = {"content": chat_logprobs(tm, c.logprobs, num_top, as_ids)}
                    deltas = chunk_deltas(out, c.text, c.finish is not None)  # (finish() parses the calls)
                    finish = out.finish_reason(c.finish.openai_reason) if c.finish else None
                    deltas = deltas or ([{}] if lp or finish else [])
                    for k, delta in enumerate(deltas):  # logprobs with the first, the finish with the last
                        yield chunk(c.index, delta, lp if k == 0 else None, finish if k == len(deltas) - 1 else None)
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": model, "choices": [], "usage": usage.body()})
            except ApiError as e:
                yield sse(e.body())
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect():
        usage = UsageTracker(n, 1)
        lps: list[list] = [[] for _ in range(n)]
        finish = [None] * n
        async for c in tm.generate(gen, rid):
            usage.update(c)
            out = outs[c.index]
            if c.text:
                out.feed(c.text)
            if num_top is not None and c.logprobs:
                lps[c.index].extend(chat_logprobs(tm, c.logprobs, num_top, as_ids))
            if c.finish:
                out.finish()
                finish[c.index] = out.finish_reason(c.finish.openai_reason)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": i, "message": outs[i].message(),
                             "logprobs": {"content": lps[i]} if num_top is not None else None,
                             "finish_reason": finish[i]} for i in range(n)],
                "usage": usage.body()}

    return await unless_disconnected(request, collect())
