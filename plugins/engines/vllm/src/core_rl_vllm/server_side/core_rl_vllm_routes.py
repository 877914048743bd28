"""An ASGI middleware for vLLM's API server (``--middleware core_rl_vllm_routes.WeightUpdateRoute``).

This file runs inside the vLLM server's API process, in the vllm server environment, not in the
trainer (the engine puts its directory on the server's ``PYTHONPATH``). It adds three routes and
passes every other request through untouched.

``POST /core_rl/generate`` with a JSON body ``{"requests": [...]}``, each item a body of vLLM's
``/inference/v1/generate``: several generation requests in one HTTP round trip. Each item becomes
its own engine request (submitted at once, scheduled as if it had come alone), and the answer
streams one JSON line per item as it finishes, in the order they finish: ``{"index": i, "status":
200, "body": <the /inference/v1/generate answer>}``, or the item's error status and message. One
HTTP request per prompt costs the API process a third of a small model's generation time on CPU
(HTTP parsing, vLLM's middleware stack, one JSON answer each): 16 prompts x 4 samples x 8 tokens,
77-105 ms of server CPU as 16 requests against 55-66 ms as one. Closing the stream (the client gave
up) cancels the items still running, which aborts them in the engine. An item may carry
``core_rl_media``: ``{"tensors": core-rl's pixel inputs of the prompt (encoded by
core_rl_server_kit.media_wire), "placeholders": [{"offset", "length"}, ...] (each image's placeholder run in
token_ids)}``; :func:`with_features` turns it into vLLM's own ``features`` (the model's
multimodal items, serialised as vLLM's ``/render`` would, hashed by content), so vLLM embeds those
very pixels at those tokens.

``POST /core_rl/update_weights`` with a JSON body ``{"method", "args", "kwargs", "version",
"pause", "timeout"}`` (or ``{"lora": {"name", "path", "unload_prefix"}, "version", "pause"}``: a LoRA
adapter instead of weights, :func:`load_adapter`): a weight update in one HTTP round trip. In the
API process it

1. pauses the engine's scheduler with running requests kept in place (``pause: true``; skipped
   when the caller paused the server itself), without the fixed delay of ``/pause``;
2. runs the worker RPC ``method(*args, **kwargs)`` that loads the new weights (vLLM's
   ``collective_rpc``: between two scheduler steps), or loads the adapter;
3. labels the engine's later outputs with ``version`` (vLLM's per-step weight version);
4. drops the prefix cache (KV blocks of finished requests, computed by the old weights) and the
   encoder cache (image embeddings, computed by the old vision tower);
5. resumes the scheduler (if it paused it).

The scheduler is paused from step 1 to 5 only, so a request frozen there continues under the new
weights with the very next step. It answers ``{"results": [...]}`` (each worker's RPC result; a
worker extension answers ``"error: ..."`` rather than raise) or, with status 500,
``{"error": "..."}``. The alternative (``/pause``, ``/collective_rpc``, ``/reset_prefix_cache``,
``/resume``) costs four round trips through a server whose CPU also generates, plus the fixed
20 ms ``/pause`` waits for its output handler.

``POST /core_rl/adapter_fingerprints``: the sync check's record of the LoRA adapter this server
last loaded (``rollout.lora_sync: adapter``): ``{"version": V, "path": P, "prints": {NAME: FLOAT}}``,
the fingerprints (``core_rl.sync.fingerprint``, loaded by file path from
``CORE_RL_WEIGHT_FINGERPRINT_PY``) of every tensor in the ``*.safetensors`` files of the directory
vLLM's handler loaded the adapter from, taken right after it loaded it (the directory the server
was actually pointed at); ``{"version": null, ...}`` before any adapter load since the server
started.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
from typing import Any

PATH = "/core_rl/update_weights"
GENERATE_PATH = "/core_rl/generate"
FINGERPRINTS_PATH = "/core_rl/adapter_fingerprints"

#: the model's multimodal processor (vLLM's), built on the first request with images
_PROCESSOR: dict[str, Any] = {}

#: the last adapter load's record (see the module docstring), answered at :data:`FINGERPRINTS_PATH`
_ADAPTER_LOADED: dict[str, Any] = {"version": None, "path": None, "prints": {}}


def _adapter_prints(path: str, version: int) -> dict[str, float]:
    """The sync check's fingerprints of every tensor of the adapter directory ``path`` at
    ``version``, with core-rl's own fingerprint module (loaded by file path: it needs only torch)."""
    module = _load_by_path("core_rl_weight_fingerprint", "CORE_RL_WEIGHT_FINGERPRINT_PY")
    return {name: module.fold(samples) for name, samples in module.file_samples(path, version).items()}


@functools.cache
def _load_by_path(name: str, variable: str) -> Any:
    """The core-rl module whose file the environment variable ``variable`` names (it needs only
    torch), loaded once."""
    spec = importlib.util.spec_from_file_location(name, os.environ[variable])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_features(model_config: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` (an item of :data:`GENERATE_PATH`) with its ``core_rl_media`` replaced by vLLM's
    ``features`` for the model of ``model_config``: the decoded tensors split into one multimodal
    item per image by the model's own field layout (its processor's ``_get_mm_fields_config``),
    each serialised with vLLM's ``mm_serde`` and hashed by its serialised content."""
    import hashlib

    from transformers import BatchFeature
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.inputs import MultiModalKwargsItems

    payload = dict(payload)
    media = payload.pop("core_rl_media")
    tensors = _load_by_path("core_rl_media_wire", "CORE_RL_MEDIA_WIRE_PY").decode_tensors(media["tensors"])
    if "processor" not in _PROCESSOR:
        _PROCESSOR["processor"] = MULTIMODAL_REGISTRY.create_processor(model_config)
    inputs = BatchFeature(tensors)
    fields = _PROCESSOR["processor"]._get_mm_fields_config(inputs, {})
    items = MultiModalKwargsItems.from_hf_inputs(inputs, fields)
    encoded = [encode_mm_kwargs_item(item) for item in items.get("image", [])]
    placeholders = list(media["placeholders"])
    if len(encoded) != len(placeholders):
        raise ValueError(f"{len(encoded)} images in the pixel inputs but {len(placeholders)} placeholder runs")
    payload["features"] = {
        "mm_hashes": {"image": [hashlib.sha256(e.encode()).hexdigest() for e in encoded]},
        "mm_placeholders": {"image": placeholders},
        "kwargs_data": {"image": encoded},
    }
    return payload


def _jsonable(result: Any) -> Any:
    return result if result is None or isinstance(result, str | dict | list) else str(result)


async def update_weights(engine: Any, body: dict[str, Any], models: Any = None) -> list[Any]:
    """Steps 1-5 of the module docstring on ``engine`` (vLLM's ``AsyncLLM``); with ``lora`` in
    ``body``, step 2 loads that adapter through ``models`` instead (:func:`load_adapter`)."""
    core = engine.engine_core
    pause = bool(body.get("pause", True))
    if pause:
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
    try:
        if "lora" in body:
            results = await load_adapter(models, body["lora"])
        else:
            results = await engine.collective_rpc(
                body["method"],
                timeout=body.get("timeout"),
                args=tuple(body.get("args", [])),
                kwargs=dict(body.get("kwargs", {})),
            )
        if not any(isinstance(r, str) and r.startswith("error") for r in results or []):
            if "lora" in body:
                _record_adapter(body["lora"]["path"], int(body["version"]))
            await core.set_weight_version_async(str(body["version"]))
            await engine.reset_prefix_cache()
            await engine.reset_encoder_cache()  # image embeddings of the old vision tower
    finally:
        if pause:
            await core.resume_scheduler_async()
    return [_jsonable(r) for r in results or []]


def _record_adapter(path: str, version: int) -> None:
    """Keep the fingerprints of the adapter just loaded from ``path`` as ``version``'s (the record
    is cleared first: a failure here leaves none, which the check reports as nothing loaded)."""
    _ADAPTER_LOADED.update(version=None, path=None, prints={})
    _ADAPTER_LOADED.update(version=version, path=str(path), prints=_adapter_prints(path, version))


async def load_adapter(models: Any, lora: dict[str, Any]) -> list[str]:
    """Load the LoRA adapter directory ``lora["path"]`` under the name ``lora["name"]`` with vLLM's
    own handler (``models``: the server's ``OpenAIServingModels``, which also resolves the name a
    request gives as its ``model``), then unload every other adapter whose name starts with
    ``lora["unload_prefix"]``. A name the server serves already (a resumed trainer reloading the
    version it serves) is unloaded first and loaded afresh: vLLM's ``load_inplace`` would stay set
    on the stored request and reload the adapter from disk at every scheduler step. One result, as
    a worker RPC's: ``"ok"`` or ``"error: ..."``."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    if models is None:
        return ["error: the server does not serve LoRA adapters (start it with --enable-lora)"]
    name = lora["name"]
    if name in models.lora_requests:
        await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
    loaded = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=lora["path"]))
    if isinstance(loaded, ErrorResponse):
        return [f"error: loading the LoRA adapter {lora['path']}: {loaded.error.message}"]
    prefix = lora.get("unload_prefix")
    for old in [n for n in models.lora_requests if prefix and n.startswith(prefix) and n != name]:
        await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=old))
    return ["ok"]


async def generate_one(serving: Any, index: int, payload: Any) -> dict[str, Any]:
    """One item of a :data:`GENERATE_PATH` request through vLLM's own token-in-token-out handler
    (``serving``); its answer line, errors included."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    try:
        if isinstance(payload, dict) and "core_rl_media" in payload:
            payload = with_features(serving.model_config, payload)
        request = GenerateRequest.model_validate(payload)
    except Exception as exc:  # pydantic's validation error, pixel inputs that do not fit: the item is wrong
        return {"index": index, "status": 400, "error": f"{type(exc).__name__}: {exc}"}
    try:
        result = await serving.serve_tokens(request, None)
    except Exception as exc:  # the status vLLM's own route would answer (400 for a bad request)
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        result = create_error_response(exc)
    if isinstance(result, ErrorResponse):
        return {"index": index, "status": int(result.error.code), "error": result.error.message}
    if not hasattr(result, "model_dump"):  # a stream: the items must not ask for one
        return {"index": index, "status": 400, "error": "streaming is not supported in a batch"}
    return {"index": index, "status": 200, "body": result.model_dump()}


async def generate_lines(serving: Any, payloads: list[Any]) -> Any:
    """The answer lines of :data:`GENERATE_PATH`, each as its item finishes; leaving early (the
    client went away) cancels the items still running."""
    tasks = [asyncio.ensure_future(generate_one(serving, i, p)) for i, p in enumerate(payloads)]
    try:
        for finished in asyncio.as_completed(tasks):
            yield (json.dumps(await finished) + "\n").encode()
    finally:
        for task in tasks:
            task.cancel()


class WeightUpdateRoute:
    """Pure ASGI middleware (no cost on the requests it passes on): serves :data:`PATH`,
    :data:`GENERATE_PATH` and :data:`FINGERPRINTS_PATH`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path")
        if (
            scope.get("type") != "http"
            or path not in (PATH, GENERATE_PATH, FINGERPRINTS_PATH)
            or scope.get("method") != "POST"
        ):
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request
        from starlette.responses import JSONResponse, StreamingResponse

        if path == FINGERPRINTS_PATH:
            await JSONResponse(dict(_ADAPTER_LOADED))(scope, receive, send)
            return

        request = Request(scope, receive)
        if path == GENERATE_PATH:
            serving = getattr(scope["app"].state, "serving_tokens", None)
            try:
                payloads = (await request.json())["requests"]
                if not isinstance(payloads, list):
                    raise TypeError("'requests' must be a list")
            except Exception as exc:
                response = JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
            else:
                if serving is None:  # a server started without --enable-scale-out
                    response = JSONResponse({"error": "the server has no token-in-token-out API"}, status_code=404)
                else:
                    response = StreamingResponse(generate_lines(serving, payloads), media_type="application/x-ndjson")
            await response(scope, receive, send)
            return
        try:
            body = await request.json()
            state = scope["app"].state
            results = await update_weights(state.engine_client, body, getattr(state, "openai_serving_models", None))
            response = JSONResponse({"results": results})
        except Exception as exc:  # answered, not raised: the caller names the server and the error
            response = JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
        await response(scope, receive, send)
