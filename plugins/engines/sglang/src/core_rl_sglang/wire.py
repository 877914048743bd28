"""The one HTTP convention of SGLang's control routes the engine relies on."""

from __future__ import annotations

from typing import Any

from core_rl_server_kit.remote import ServerReplyError, json_post


async def checked_post(client: Any, url: str, payload: dict[str, Any], timeout: float) -> Any:
    """POST and require ``{"success": true}`` (SGLang's control routes answer so; a failure's text
    is in ``message``, or ``error_message`` for the LoRA routes); return the decoded body."""
    body = await json_post(client, url, payload, timeout=timeout)
    if isinstance(body, dict) and body.get("success") is False:
        raise ServerReplyError(f"POST {url} failed: {body.get('message') or body.get('error_message')}")
    return body
