"""POST /load_lora_adapter and /unload_lora_adapter (SGLang), also as /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM): the scheduler reads or drops the adapter; an adapter it cannot serve is a 400
naming why, and the server goes on serving."""

from __future__ import annotations

from scheduler.io_struct import LoadLoraReq, UnloadLoraReq
from server.protocol import ApiError, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from server.serving_common import ServingContext


def _require_lora(ctx: ServingContext) -> None:
    if not ctx.args.lora_enabled:
        raise ApiError(400, "this server serves no LoRA adapters (start it with --enable-lora)")


async def load_lora_adapter(ctx: ServingContext, req: LoadLoraAdapterRequest) -> dict:
    _require_lora(ctx)
    if req.lora_name in ctx.lora_adapters:
        raise ApiError(400, f"LoRA adapter '{req.lora_name}' is already loaded", "lora_name")
    reply = await ctx.tm.control(LoadLoraReq, lora_name=req.lora_name, lora_path=req.lora_path, pinned=req.pinned)
    if not reply.ok:
        raise ApiError(400, str(reply.data.get("message")), "lora_path")
    ctx.lora_adapters[req.lora_name] = req.lora_path
    return {"success": True, "message": f"LoRA adapter '{req.lora_name}' loaded",
            "loaded_adapters": dict(ctx.lora_adapters)}


async def unload_lora_adapter(ctx: ServingContext, req: UnloadLoraAdapterRequest) -> dict:
    _require_lora(ctx)
    if req.lora_name not in ctx.lora_adapters:
        raise ApiError(404, f"The LoRA adapter '{req.lora_name}' is not loaded.", "lora_name", "NotFoundError")
    reply = await ctx.tm.control(UnloadLoraReq, lora_name=req.lora_name)
    if not reply.ok:
        raise ApiError(400, str(reply.data.get("message")), "lora_name")
    del ctx.lora_adapters[req.lora_name]
    return {"success": True, "message": f"LoRA adapter '{req.lora_name}' unloaded",
            "loaded_adapters": dict(ctx.lora_adapters)}
