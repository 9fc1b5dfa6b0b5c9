"""/tokenize and /detokenize (vLLM's request and response shapes)."""

from __future__ import annotations

from server.protocol import ApiError, DetokenizeRequest, TokenizeRequest
from server.serving_chat import convert_messages
from server.serving_common import ServingContext


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict:
    ctx.check_model(req.model)
    tm = ctx.tm
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        tokens = tm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        tools = [t.function.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        tokens = await tm.encode_chat_async(convert_messages(req.messages), tools=tools,
                                            template_kwargs=req.chat_template_kwargs,
                                            add_generation_prompt=req.add_generation_prompt)
    out = {"count": len(tokens), "max_model_len": tm.context_len, "tokens": tokens}
    if req.return_token_strs:
        out["token_strs"] = tm.tokenizer.convert_ids_to_tokens(tokens)
    return out


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict:
    ctx.check_model(req.model)
    ctx.tm.check_token_ids(req.tokens, "tokens")
    return {"prompt": ctx.tm.tokenizer.decode(req.tokens)}
