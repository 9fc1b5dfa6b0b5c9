"""/tokenize and /detokenize, also served as /v1/tokenize and /v1/detokenize (vLLM's request and response
shapes; SGLang's detokenize answers `text`, which is given too). Chat messages are rendered exactly as
/v1/chat/completions renders them (tools in the default format included), so `count` is the prompt's."""

from __future__ import annotations

from server.protocol import ApiError, DetokenizeRequest, TokenizeRequest
from server.serving_chat import convert_messages, encode_chat
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
        images = []
        tokens, _ = await encode_chat(ctx, convert_messages(req.messages, images), tools, req.chat_template_kwargs,
                                      req.add_generation_prompt, req.continue_final_message, images=images)
    out = {"count": len(tokens), "max_model_len": tm.context_len, "tokens": tokens}
    if req.return_token_strs:
        out["token_strs"] = tm.tokenizer.convert_ids_to_tokens(tokens)
    return out


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict:
    ctx.check_model(req.model)
    ctx.tm.check_token_ids(req.tokens, "tokens")
    text = ctx.tm.tokenizer.decode(req.tokens)
    return {"prompt": text, "text": text}
