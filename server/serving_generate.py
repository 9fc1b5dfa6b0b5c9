"""/generate (SGLang's native route): text or input_ids, sampling_params, cumulative streaming."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from model_executor.sampling_params import MAX_TOP_LOGPROBS
from server.protocol import ApiError, GenerateRequest
from server.protocol_convert import build_params, check_priority, logit_bias_pairs, request_grammar
from server.serving_common import (
    SSE_DONE,
    SSE_HEADERS,
    ServingContext,
    sse,
    start_stream,
    unless_disconnected,
)
from server.tokenizer_manager import GenChunk, GenRequest


@dataclass
class _Accumulator:
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    lps: list = field(default_factory=list)
    top: list = field(default_factory=list)
    input_lps: list = field(default_factory=list)
    input_top: list = field(default_factory=list)


async def generate(ctx: ServingContext, req: GenerateRequest, request: Request):
    tm = ctx.tm
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", "text")
    check_priority(req.priority)
    _, lora = ctx.resolve_model(None, req.lora_path)
    if req.text is not None:
        ids, param = (await tm.encode_prompts_async([req.text]))[0], "text"
    else:
        ids, param = list(req.input_ids), "input_ids"
        tm.check_token_ids(ids, param)
    sp = req.sampling_params
    if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs_num")
    start = req.logprob_start_len
    if start != -1:
        if not req.return_logprob:
            raise ApiError(400, "logprob_start_len needs return_logprob=true", "logprob_start_len")
        if not 0 <= start < len(ids):
            raise ApiError(400, f"logprob_start_len must be -1 (no prompt logprobs) or a prompt position in "
                                f"[0, {len(ids)}), got {start}", "logprob_start_len")
    grammar, grammar_param = request_grammar(sp, ctx.grammar_enabled, param_prefix="sampling_params.")
    params = build_params(defaults=ctx.sampling, max_tokens=sp.max_new_tokens, temperature=sp.temperature,
                          top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed, stop=sp.stop,
                          stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                          min_tokens=sp.min_new_tokens,
                          top_logprobs=req.top_logprobs_num if req.return_logprob else None,
                          presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
                          repetition_penalty=sp.repetition_penalty,
                          logit_bias=logit_bias_pairs(sp.logit_bias, "sampling_params.logit_bias"),
                          grammar=grammar,
                          prompt_logprob_start=None if start == -1 else start,
                          prompt_top_logprobs=req.top_logprobs_num,
                          skip_special_tokens=sp.skip_special_tokens,
                          spaces_between_special_tokens=sp.spaces_between_special_tokens,
                          include_stop_str_in_output=sp.no_stop_trim,
                          param_names={name: f"sampling_params.{name}" for name in (
                              "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")}
                          | {"max_tokens": "sampling_params.max_new_tokens",
                             "min_tokens": "sampling_params.min_new_tokens"})
    tm.check_token_ids(params.stop_token_ids, "sampling_params.stop_token_ids")
    tm.check_token_ids([t for t, _ in params.logit_bias], "sampling_params.logit_bias")
    tm.check_length(len(ids), sp.max_new_tokens, param, "sampling_params.max_new_tokens")
    tm.check_alive()
    rid = f"gen-{uuid.uuid4().hex}"
    gen = [GenRequest(ids, params, grammar_param, lora_name=lora)]
    acc = _Accumulator()
    # SGLang's entries: [logprob, token id, its text (return_text_in_logprobs) or None].
    text_of = tm.token_str if req.return_text_in_logprobs else (lambda _: None)
    if start != -1:  # the token at the start has no logprob: nothing before it is scored (SGLang's None)
        acc.input_lps.append([None, ids[start], text_of(ids[start])])
        acc.input_top.append(None)

    def absorb(c: GenChunk) -> dict:
        acc.text += c.text
        acc.output_ids.extend(c.token_ids)
        if c.prompt_logprobs is not None:
            p = c.prompt_logprobs
            acc.input_lps.extend([v, t, text_of(t)] for v, t in zip(p.logprobs, p.token_ids))
            acc.input_top.extend([[v, t, text_of(t)] for t, v in zip(ids_, vals)]
                                 for ids_, vals in zip(p.top_ids, p.top_logprobs))
        if req.return_logprob and c.logprobs:
            acc.lps.extend([lp.logprob, lp.token_id, text_of(lp.token_id)] for lp in c.logprobs)
            acc.top.extend([[v, t, text_of(t)] for t, v in lp.top] for lp in c.logprobs)
        meta = {"id": rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                "cached_tokens": c.cached_tokens,
                "finish_reason": None if c.finish is None else {"type": c.finish.kind, "matched": c.finish.matched}}
        if c.spec_counts is not None:
            meta.update(c.spec_counts.meta())
        if req.return_logprob:
            meta["input_token_logprobs"] = acc.input_lps
            meta["input_top_logprobs"] = acc.input_top
            meta["output_token_logprobs"] = acc.lps
            meta["output_top_logprobs"] = acc.top
        return {"text": acc.text, "output_ids": list(acc.output_ids), "meta_info": meta}

    if req.stream:
        chunks = await start_stream(request, tm.generate(gen, rid))
        if isinstance(chunks, Response):
            return chunks

        async def stream() -> AsyncIterator[str]:
            try:
                async for c in chunks:
                    out = absorb(c)
                    if c.text or c.token_ids or c.finish:
                        yield sse(out)  # SGLang streams the cumulative text
            except ApiError as e:
                yield sse(e.body())
            yield SSE_DONE

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect():
        out = None
        async for c in tm.generate(gen, rid):
            out = absorb(c)
        return out

    return await unless_disconnected(request, collect())
