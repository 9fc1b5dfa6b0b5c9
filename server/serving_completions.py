"""/v1/completions: prompts (text, token ids, or batches of either) x n choices, streamed or collected."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from model_executor.sampling_params import MAX_TOP_LOGPROBS
from server.protocol import ApiError, CompletionRequest
from server.protocol_convert import (
    build_params,
    check_n,
    check_priority,
    choices_params,
    logit_bias_pairs,
    request_grammar,
)
from server.serving_common import (
    SSE_DONE,
    SSE_HEADERS,
    ChoiceChunks,
    ServingContext,
    UsageTracker,
    check_stream_options,
    completion_logprobs,
    prompt_completion_logprobs,
    sse,
    start_stream,
    unless_disconnected,
    vllm_prompt_logprobs,
)
from server.tokenizer_manager import GenRequest


def check_unsupported(req: CompletionRequest) -> None:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", "logprobs")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.prompt_logprobs}",
                           "prompt_logprobs")
        if req.stream:
            raise ApiError(400, "prompt_logprobs is not available with stream=true (as in vLLM); use echo with "
                                "logprobs to stream them", "prompt_logprobs")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, f"best_of must equal n (server-side best-of selection is not implemented), got "
                            f"best_of={req.best_of}, n={req.n}", "best_of")
    if req.suffix:
        raise ApiError(400, "suffix is not supported (no insertion; the model completes the prompt only)", "suffix")


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request):
    tm = ctx.tm
    model, lora = ctx.resolve_model(req.model, req.lora_path)
    check_stream_options(req)
    check_unsupported(req)
    check_priority(req.priority)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [((await tm.encode_prompts_async([prompt]))[0], prompt)]
    elif not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    elif isinstance(prompt[0], int):
        prompts = [(list(prompt), None)]
    elif isinstance(prompt[0], str):
        prompts = list(zip(await tm.encode_prompts_async(prompt), prompt))
    else:
        prompts = [(list(p), None) for p in prompt]
    check_n(req.n, len(prompts))
    grammar, grammar_param = request_grammar(req, ctx.grammar_enabled)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    # echo with logprobs scores the prompt (OpenAI's legacy shape); prompt_logprobs too (vLLM's field).
    echo_lp = req.echo and req.logprobs is not None
    want_prompt = echo_lp or req.prompt_logprobs is not None
    prompt_top = max(req.logprobs or 0 if echo_lp else 0, req.prompt_logprobs or 0)
    params = build_params(defaults=ctx.sampling, max_tokens=max_tokens, temperature=req.temperature,
                          top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop,
                          stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                          min_tokens=req.min_tokens, top_logprobs=req.logprobs,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, logit_bias=logit_bias_pairs(req.logit_bias),
                          grammar=grammar, prompt_logprob_start=0 if want_prompt else None,
                          prompt_top_logprobs=prompt_top, skip_special_tokens=req.skip_special_tokens,
                          spaces_between_special_tokens=req.spaces_between_special_tokens,
                          include_stop_str_in_output=req.include_stop_str_in_output)
    tm.check_token_ids(params.stop_token_ids, "stop_token_ids")
    tm.check_token_ids([t for t, _ in params.logit_bias], "logit_bias")
    for ids, _ in prompts:
        tm.check_token_ids(ids, "prompt")
        tm.check_length(len(ids), max_tokens, "prompt", "max_tokens")
    tm.check_alive()
    n = req.n
    gen = [GenRequest(ids, p, grammar_param, lora_name=lora) for ids, _ in prompts for p in choices_params(params, n)]
    prompt_ids = [g.input_ids for g in gen]
    echoes = []
    if req.echo:
        for ids, text in prompts:
            echoes.extend([text if text is not None else tm.tokenizer.decode(ids)] * n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    want_lp = req.logprobs is not None
    as_ids = req.return_tokens_as_token_ids

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        generated = await start_stream(request, tm.generate(gen, rid))
        if isinstance(generated, Response):
            return generated

        async def stream() -> AsyncIterator[str]:
            usage = UsageTracker(n, len(prompts))
            offsets = [len(e) for e in echoes] if echoes else [0] * len(gen)

            chunks = ChoiceChunks(rid, "text_completion", created, model)

            def chunk(index: int, text: str, logprobs=None, finish=None) -> str:
                return chunks(index, {"text": text, "logprobs": logprobs, "finish_reason": finish})
            # echo with logprobs: the prompt goes out with its logprobs, which come with the first output.
            pending_echo = set(range(len(gen))) if echo_lp else set()
            try:
                for i, e in enumerate(echoes):
                    if e and not echo_lp:
                        yield chunk(i, e)
                async for c in generated:
                    usage.update(c)
                    lp = None
                    text = c.text
                    if c.index in pending_echo:
                        pending_echo.discard(c.index)
                        text = echoes[c.index] + text
                        lp = prompt_completion_logprobs(tm, prompt_ids[c.index], c.prompt_logprobs, req.logprobs, as_ids)
                    if want_lp and c.logprobs:
                        part, offsets[c.index] = completion_logprobs(tm, c.logprobs, offsets[c.index], as_ids)
                        lp = part if lp is None else {k: lp[k] + part[k] for k in lp}
                    if text or lp or c.finish:
                        yield chunk(c.index, text, lp, c.finish.openai_reason if c.finish else None)
                if include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage.body()})
            except ApiError as e:
                yield sse(e.body())
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect():
        usage = UsageTracker(n, len(prompts))
        texts = list(echoes) if echoes else [""] * len(gen)
        lps = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in gen]
        offsets = [len(t) for t in texts]
        finish = [None] * len(gen)
        prompt_lps: list = [None] * len(gen)
        async for c in tm.generate(gen, rid):
            usage.update(c)
            if c.prompt_logprobs is not None:
                prompt_lps[c.index] = c.prompt_logprobs
            texts[c.index] += c.text
            if want_lp and c.logprobs:
                part, offsets[c.index] = completion_logprobs(tm, c.logprobs, offsets[c.index], as_ids)
                for k in lps[c.index]:
                    lps[c.index][k].extend(part[k])
            if c.finish:
                finish[c.index] = c.finish.openai_reason
        choices = []
        for i in range(len(gen)):
            choice = {"index": i, "text": texts[i], "logprobs": lps[i] if want_lp else None, "finish_reason": finish[i]}
            if echo_lp:
                head = prompt_completion_logprobs(tm, prompt_ids[i], prompt_lps[i], req.logprobs, as_ids)
                choice["logprobs"] = {k: head[k] + lps[i][k] for k in head}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tm, prompt_ids[i], prompt_lps[i], req.prompt_logprobs)
            choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                "usage": usage.body()}

    return await unless_disconnected(request, collect())
