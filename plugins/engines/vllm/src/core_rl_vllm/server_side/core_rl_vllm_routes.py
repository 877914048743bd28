"""An ASGI middleware for vLLM's API server (``--middleware core_rl_vllm_routes.WeightUpdateRoute``).

This file runs inside the vLLM server's API process, in the vllm server environment, not in the
trainer (the engine puts its directory on the server's ``PYTHONPATH``). It adds one route and
passes every other request through untouched:

``POST /core_rl/update_weights`` with a JSON body ``{"method", "args", "kwargs", "version",
"pause", "timeout"}``: a weight update in one HTTP round trip. In the API process it

1. pauses the engine's scheduler with running requests kept in place (``pause: true``; skipped
   when the caller paused the server itself), without the fixed delay of ``/pause``;
2. runs the worker RPC ``method(*args, **kwargs)`` that loads the new weights (vLLM's
   ``collective_rpc``: between two scheduler steps);
3. labels the engine's later outputs with ``version`` (vLLM's per-step weight version);
4. drops the prefix cache (KV blocks of finished requests, computed by the old weights);
5. resumes the scheduler (if it paused it).

The scheduler is paused from step 1 to 5 only, so a request frozen there continues under the new
weights with the very next step. It answers ``{"results": [...]}`` (each worker's RPC result; a
worker extension answers ``"error: ..."`` rather than raise) or, with status 500,
``{"error": "..."}``. The alternative (``/pause``, ``/collective_rpc``, ``/reset_prefix_cache``,
``/resume``) costs four round trips through a server whose CPU also generates, plus the fixed
20 ms ``/pause`` waits for its output handler.
"""

from __future__ import annotations

from typing import Any

PATH = "/core_rl/update_weights"


def _jsonable(result: Any) -> Any:
    return result if result is None or isinstance(result, str | dict | list) else str(result)


async def update_weights(engine: Any, body: dict[str, Any]) -> list[Any]:
    """Steps 1-5 of the module docstring on ``engine`` (vLLM's ``AsyncLLM``)."""
    core = engine.engine_core
    pause = bool(body.get("pause", True))
    if pause:
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
    try:
        results = await engine.collective_rpc(
            body["method"],
            timeout=body.get("timeout"),
            args=tuple(body.get("args", [])),
            kwargs=dict(body.get("kwargs", {})),
        )
        if not any(isinstance(r, str) and r.startswith("error") for r in results or []):
            await core.set_weight_version_async(str(body["version"]))
            await engine.reset_prefix_cache()
    finally:
        if pause:
            await core.resume_scheduler_async()
    return [_jsonable(r) for r in results or []]


class WeightUpdateRoute:
    """Pure ASGI middleware (no cost on the requests it passes on): serves :data:`PATH`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") != PATH or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        request = Request(scope, receive)
        try:
            body = await request.json()
            results = await update_weights(scope["app"].state.engine_client, body)
            response = JSONResponse({"results": results})
        except Exception as exc:  # answered, not raised: the caller names the server and the error
            response = JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
        await response(scope, receive, send)
