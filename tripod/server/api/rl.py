"""The RL control surface (``--enable-rl-api``; docs/rl.md): what an RL trainer drives a rollout
server with, in SGLang's and vLLM's spellings. Without the flag none of these routes exists (404);
with ``--api-key`` they need the key like every guarded route.

- ``POST /pause_generation {"mode": "abort"|"wait"|"keep"}`` (vLLM: ``POST /pause?mode=``),
  ``POST /continue_generation`` (vLLM: ``POST /resume``), ``POST /abort_requests`` (SGLang:
  ``/abort_request``): all requests, or those whose response ids are given.
- ``POST /update_weights_from_disk {"model_path"}``, ``POST /update_weights_from_tensor`` (the
  body a safetensors file, ``application/octet-stream``, or JSON ``{"safetensors": base64}``),
  ``GET /get_weight_version``; ``POST /init_weights_update_group`` then
  ``POST /update_weights_from_distributed {"names", "dtypes", "shapes"}`` (a trainer's gloo group:
  it is rank 0 and broadcasts each tensor while the engine receives).
- ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping`` (vLLM), and SGLang's
  ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation``.
- ``POST /reset_prefix_cache`` (SGLang: ``/flush_cache``).

Each is one typed control message to the engine process (``protocol/engine_ipc.py``), carried out
there between steps (``engine/rl_control.py``); the answer carries the engine's state after it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tripod.protocol import engine_ipc
from tripod.server.api.body import StrictModel, parse, read_body
from tripod.server.engine_client import EngineDead
from tripod.server.errors import APIError
from tripod.server.state import ServerState

# Seconds a control may take: an update waits for the requests in flight to finish.
CONTROL_TIMEOUT_S = 600.0
_STATUS = {"invalid": 400, "unsupported": 400, "conflict": 409}
RL_ROUTES = frozenset({
    "/pause_generation", "/pause", "/continue_generation", "/resume", "/abort_requests", "/abort_request",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/get_weight_version", "/sleep", "/wake_up",
    "/is_sleeping", "/init_weights_update_group", "/update_weights_from_distributed", "/release_memory_occupation", "/resume_memory_occupation", "/reset_prefix_cache", "/flush_cache",
})


class PauseBody(StrictModel):
    mode: str = "abort"  # SGLang's default


class AbortBody(StrictModel):
    rids: list[str] | None = None  # response ids (chatcmpl-..., cmpl-...); none given: every request
    rid: str | None = None  # SGLang's one id ("" with abort_all)
    abort_all: bool = False


class DiskBody(StrictModel):
    model_path: str
    flush_cache: bool = True  # SGLang's field: the cache is always flushed here (old KV is never reused)


class TensorBody(StrictModel):
    safetensors: str  # base64 of a safetensors file's bytes
    flush_cache: bool = True


class GroupBody(StrictModel):  # SGLang's /init_weights_update_group
    master_address: str
    master_port: int
    rank_offset: int = 1  # this engine's rank (the trainer is rank 0)
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class DistributedBody(StrictModel):  # SGLang's /update_weights_from_distributed
    names: list[str]
    dtypes: list[str]  # "float32", "bfloat16", "float16" (or with "torch.")
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True


class MemoryBody(StrictModel):
    tags: list[str] | None = None  # SGLang's: "kv_cache", "weights" (and "cuda_graph"); none: all


def sleep_level(tags: list[str] | None) -> int:
    """SGLang's release tags as a sleep level: the KV cache alone is level 1, with weights level 2."""
    if tags is None:
        return 2
    unknown = set(tags) - {"kv_cache", "weights", "cuda_graph"}
    if unknown or not tags:
        raise APIError(400, f"tags {sorted(unknown) if unknown else tags}: give 'kv_cache' and/or 'weights'",
                       param="tags")
    return 2 if "weights" in tags else 1


def state_body(s: engine_ipc.RLState) -> dict[str, Any]:
    return {"weight_version": s.weight_version, "paused": s.paused or None, "is_sleeping": s.sleeping > 0,
            "sleep_level": s.sleeping, "in_flight": s.in_flight, "held": s.held}


class _Controls:
    """Sends one control message and turns its reply into an answer (or the error's status)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def ask(self, make: Callable[[int], engine_ipc.Control]) -> dict[str, Any]:
        try:
            reply = await self.state.client.control(make, CONTROL_TIMEOUT_S)
        except EngineDead as e:
            raise APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead") from None
        except TimeoutError:
            raise APIError(503, "the engine did not answer in time (it still carries the control out)",
                           type="server_error") from None
        if reply.error is not None:
            raise APIError(_STATUS.get(reply.kind, 400), reply.error, code=reply.kind or None)
        out = {"success": True, **state_body(reply.state)}
        if reply.aborted:
            out["aborted"] = reply.aborted
        if reply.released:
            out["released_bytes"] = reply.released
        return out

    async def answer(self, make: Callable[[int], engine_ipc.Control]) -> JSONResponse:
        return JSONResponse(await self.ask(make))

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.state.config.max_body_bytes)


def add_rl_routes(app: FastAPI, state: ServerState) -> None:
    c = _Controls(state)
    _add_pause_routes(app, c)
    _add_weight_routes(app, c)
    _add_memory_routes(app, c)


def _add_pause_routes(app: FastAPI, c: _Controls) -> None:
    async def pause(mode: str) -> JSONResponse:
        if mode not in engine_ipc.PAUSE_MODES:
            raise APIError(400, f"'mode' {mode!r}: use one of {', '.join(engine_ipc.PAUSE_MODES)}", param="mode")
        return await c.answer(lambda t: engine_ipc.PauseGeneration(t, mode))

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        raw = await c.body(request)
        return await pause(parse(PauseBody, raw).mode if raw.strip() else "abort")

    @app.post("/pause")
    async def pause_vllm(mode: str = "abort") -> JSONResponse:
        return await pause(mode)

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        return await c.answer(engine_ipc.ContinueGeneration)

    app.post("/resume")(continue_generation)

    async def abort(request: Request) -> JSONResponse:
        raw = await c.body(request)
        body = parse(AbortBody, raw) if raw.strip() else AbortBody()
        ids = [*(body.rids or []), *([body.rid] if body.rid else [])]
        if body.abort_all or not ids:
            return await c.answer(lambda t: engine_ipc.AbortRequests(t, []))
        # A completions request of several prompts runs one engine request per prompt ("{id}-p{i}").
        rids = [r for r in c.state.client.open_rids() if any(r == i or r.startswith(f"{i}-p") for i in ids)]
        if not rids:
            return JSONResponse({"success": True, "aborted": 0, **state_body(c.state.client.rl)})
        return await c.answer(lambda t: engine_ipc.AbortRequests(t, rids))

    app.post("/abort_requests")(abort)
    app.post("/abort_request")(abort)


def _add_weight_routes(app: FastAPI, c: _Controls) -> None:
    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request) -> JSONResponse:
        body: DiskBody = parse(DiskBody, await c.body(request))
        if not body.model_path:
            raise APIError(400, "'model_path' is empty: give a model folder or .gguf file", param="model_path")
        out = await c.ask(lambda t: engine_ipc.UpdateWeights(t, model_path=body.model_path))
        return JSONResponse({**out, "message": f"weights loaded from {body.model_path}"})

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request) -> JSONResponse:
        raw = await c.body(request)
        if request.headers.get("content-type", "").startswith("application/json"):
            try:
                data = base64.b64decode(parse(TensorBody, raw).safetensors, validate=True)
            except binascii.Error:
                raise APIError(400, "'safetensors' is not base64", param="safetensors") from None
        else:
            data = raw
        if not data:
            raise APIError(400, "send a safetensors file as the body (application/octet-stream), or JSON "
                           "{\"safetensors\": base64}")
        return await c.answer(lambda t: engine_ipc.UpdateWeights(t, safetensors=data))

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> JSONResponse:
        b: GroupBody = parse(GroupBody, await c.body(request))
        if not 0 < b.master_port < 65536 or b.world_size < 2:
            raise APIError(400, "'master_port' must be a port (1-65535) and 'world_size' at least 2")
        return await c.answer(lambda t: engine_ipc.InitWeightsGroup(t, b.master_address, b.master_port, b.rank_offset,
                                                                    b.world_size, b.backend))

    @app.post("/update_weights_from_distributed")
    async def from_group(request: Request) -> JSONResponse:
        b: DistributedBody = parse(DistributedBody, await c.body(request))
        dtypes = [d.removeprefix("torch.") for d in b.dtypes]
        return await c.answer(lambda t: engine_ipc.UpdateWeights(t, names=b.names, dtypes=dtypes, shapes=b.shapes))

    @app.get("/get_weight_version")
    async def weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": c.state.client.rl.weight_version})


def _add_memory_routes(app: FastAPI, c: _Controls) -> None:
    async def sleep(level: int) -> JSONResponse:
        if level not in (1, 2):
            raise APIError(400, f"sleep level {level}: 1 (the KV cache) or 2 (the weights too)", param="level")
        return await c.answer(lambda t: engine_ipc.Sleep(t, level))

    @app.post("/sleep")
    async def sleep_vllm(level: int = 1) -> JSONResponse:
        return await sleep(level)

    @app.post("/release_memory_occupation")
    async def release(request: Request) -> JSONResponse:
        raw = await c.body(request)
        return await sleep(sleep_level(parse(MemoryBody, raw).tags if raw.strip() else None))

    @app.post("/wake_up")
    async def wake_up() -> JSONResponse:
        return await c.answer(engine_ipc.WakeUp)

    app.post("/resume_memory_occupation")(wake_up)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        s = c.state.client.rl
        return JSONResponse({"is_sleeping": s.sleeping > 0, "sleep_level": s.sleeping})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return await c.answer(engine_ipc.ResetPrefixCache)

    app.post("/flush_cache")(reset_prefix_cache)


def asleep_error(state: ServerState) -> APIError | None:
    """The 503 a generating request gets while the engine sleeps (None: awake)."""
    level = state.client.rl.sleeping
    if not level:
        return None
    what = "its KV cache and weights" if level == 2 else "its KV cache"
    return APIError(503, f"the engine is asleep (level {level}: {what} released for training); POST /wake_up "
                    "(or /resume_memory_occupation) first", type="server_error", code="sleeping",
                    headers={"Retry-After": str(state.config.retry_after)})
