"""OpenAI-style request errors: what the proxy answers a client's mistake with (never a crash)."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request the proxy refuses: ``status`` (4xx), ``message``, the OpenAI error ``type``,
    ``code`` and the offending ``param``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
