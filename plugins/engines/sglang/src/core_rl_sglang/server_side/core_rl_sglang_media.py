"""``POST /core_rl/generate``: SGLang's ``/generate`` with pixel inputs core-rl computed itself.

This file runs in the sglang server environment (the launcher, :mod:`core_rl_sglang_server`,
registers the route before SGLang's HTTP server starts), not in the trainer.

SGLang 0.5.23's ``/generate`` takes images as ``image_data`` URLs (or data URIs) that its own
processor resizes, normalises and expands into placeholder tokens; the JSON contract of the route
refuses anything else. Its request object also takes a *processed* image, ``{"format":
"processor_output", "pixel_values": tensor, "image_grid_thw": tensor}``, with token ids whose
placeholders are already expanded: SGLang then keeps those ids as they are, places the image
embeddings at the image tokens and computes the M-RoPE positions from the grid. Only the offline
(Python) engine can pass tensors, so this route does it for HTTP: the body is ``/generate``'s, with
``image_data`` one entry per request of the batch (``null`` for one without images), each a map of
tensors encoded as ``{"dtype": "float32", "shape": [...], "data": base64 of the little-endian
bytes}`` (:mod:`core_rl_server_kit.media_wire`). The sampled tokens are then those of the very ids and pixels
the trainer computes log-probs over.
"""

# no ``from __future__ import annotations``: FastAPI reads the handler's ``Request`` annotation
import functools
import importlib.util
import os
from typing import Any

ROUTE = "/core_rl/generate"


def decode_tensors(encoded: dict[str, Any]) -> dict[str, Any]:
    """The tensors of ``encoded`` (``{key: {"dtype", "shape", "data"}}``), decoded by core-rl's own
    :mod:`core_rl_server_kit.media_wire`, loaded by the file path ``CORE_RL_MEDIA_WIRE_PY`` names (it needs only
    torch and numpy)."""
    return _wire().decode_tensors(encoded)


@functools.cache
def _wire() -> Any:
    """:mod:`core_rl_server_kit.media_wire`, loaded once from ``CORE_RL_MEDIA_WIRE_PY``."""
    spec = importlib.util.spec_from_file_location("core_rl_media_wire", os.environ["CORE_RL_MEDIA_WIRE_PY"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def processor_output(media: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """One request's ``image_data``: SGLang's processed-image form of ``media``'s tensors."""
    if not media:
        return None
    return [{"format": "processor_output", **decode_tensors(media)}]


def register() -> bool:
    """Add :data:`ROUTE` to SGLang's HTTP app; False (said on stderr) where this SGLang lacks what it needs."""
    import sys

    try:
        from fastapi import Request
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.io_struct import GenerateReqInput

        serve = http_server.serve_generate_request
    except (ImportError, AttributeError) as exc:
        print(f"core-rl: no {ROUTE} route ({exc})", file=sys.stderr, flush=True)
        return False

    async def generate_with_media(request: Request):
        body = dict(await request.json())
        media = body.pop("image_data", None)
        batched = (
            isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list)
        )
        if media is not None:
            images = [processor_output(m) for m in media] if batched else processor_output(media)
            body["image_data"] = images
        return await serve(GenerateReqInput(**body), request)

    http_server.app.add_api_route(ROUTE, generate_with_media, methods=["POST"])
    return True
