"""Errors answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Dict, Optional

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """A request answered with ``status`` and an OpenAI error body (4xx: the client's; 5xx: ours)."""

    def __init__(self, message: str, status: int = 400, *, code: Optional[str] = None,
                 param: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def engine_failure(error: str) -> str:
    """An engine error as a client sees it: its message, one line, bounded (never a traceback)."""
    line = " ".join(str(error).split())
    return line if len(line) <= 300 else line[:297] + "..."
