"""LoRA adapters over HTTP: listed in ``/v1/models`` (each with its base as ``parent``), loaded and
unloaded live with vLLM's endpoints and bodies (``POST /v1/load_lora_adapter`` ``{"lora_name",
"lora_path"}``, ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``), behind the API key like every
``/v1/`` route (their request models are here). An unload answers once the adapter's running
requests have finished."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tripod.server.api.body import StrictModel, parse, read_body
from tripod.server.engine_client import EngineDead
from tripod.server.errors import APIError
from tripod.server.state import ServerState

UNLOAD_WAIT_S = 600.0


class LoadLoraRequest(StrictModel):  # POST /v1/load_lora_adapter (vLLM's body)
    lora_name: str
    lora_path: str


class UnloadLoraRequest(StrictModel):  # POST /v1/unload_lora_adapter
    lora_name: str


def adapter_cards(state: ServerState, base: dict[str, Any]) -> list[dict[str, Any]]:
    """One model card per adapter, in the base's shape, with ``parent`` (its base) and ``root`` (its folder)."""
    return [{**base, "id": name, "display_name": name, "parent": base["id"], "root": path, "lora": True}
            for name, path in sorted((state.client.loras or {}).items())]


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> JSONResponse:
        req: LoadLoraRequest = parse(LoadLoraRequest, await read_body(request, state.config.max_body_bytes))
        if req.lora_name in (state.model_name, "default"):
            raise APIError(400, f"'lora_name' {req.lora_name!r} is the base model's name; choose another", param="lora_name")
        reply = await _ask(state, "load", req.lora_name, req.lora_path)
        if reply.error is not None:
            raise APIError(400, reply.error, param="lora_path")
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name, "parent": state.model_name,
                             "root": req.lora_path, "status": "loaded",
                             "message": f"Success: LoRA adapter '{req.lora_name}' added successfully."})

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        req: UnloadLoraRequest = parse(UnloadLoraRequest, await read_body(request, state.config.max_body_bytes))
        reply = await _ask(state, "unload", req.lora_name)
        if reply.error is not None:
            raise APIError(404, reply.error, param="lora_name", code="model_not_found")
        deadline = time.monotonic() + UNLOAD_WAIT_S
        running = reply.running
        while running and time.monotonic() < deadline:  # its running requests finish on its weights
            await asyncio.sleep(0.05)  # NOTE: the engine has no event for this; polled with a deadline
            running = (await _ask(state, "list", req.lora_name)).running
        return JSONResponse({"object": "lora_adapter", "id": req.lora_name, "status": "unloaded",
                             "waited_for": reply.running, "running": running,
                             "message": f"Success: LoRA adapter '{req.lora_name}' removed successfully."})


async def _ask(state: ServerState, action: str, name: str, path: str = "") -> Any:
    if state.client.loras is None:
        raise APIError(400, f"{state.model_name} is served without LoRA adapters here (a model over several "
                       "processes, or one whose attention has no q/k/v/o projections)")
    try:
        return await state.client.lora(action, name, path)
    except EngineDead as e:
        raise APIError(503, str(e), type="server_error", code="engine_dead") from None
    except TimeoutError:
        raise APIError(503, "the engine did not answer in time", type="server_error") from None
