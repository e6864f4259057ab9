"""The HTTP door's error answers: an exception -> status, OpenAI-shaped body and metrics outcome.

Exceptions from the backend are answered from router/errors.py's table (the same rows the gRPC
door answers from); the door's own answers (auth, routes, bodies) are ApiErrors it raises.
"""
from __future__ import annotations

from engine.sampling import InvalidRequest
from router import errors
from router.errors import ModelNotFound

RETRY_AFTER_S = 1  # what 429/503 answers suggest; the condition is usually brief


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.outcome: str | None = None  # set from the error table; else by status
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception from the backend (router/errors.py's table)."""
    if isinstance(exc, ApiError):
        return exc
    row = errors.answer(exc)
    if row is errors.INTERNAL:
        return ApiError(500, errors.internal_message(exc))
    param = exc.field if isinstance(exc, InvalidRequest) else "model" if isinstance(exc, ModelNotFound) else None
    error = ApiError(row.http_status, errors.safe_text(exc), param, retry_after=RETRY_AFTER_S if row.retry else None)
    error.outcome = row.outcome
    return error


# The door's own answers (auth, routes, bodies); the rest come from router/errors.py's table.
OUTCOMES = {200: "ok", 401: "unauthenticated", 429: "overloaded", 503: "unavailable", 500: "error"}


def outcome(error: ApiError) -> str:
    """The metrics outcome for an answer (the same names the gRPC door uses)."""
    if error.outcome is not None:
        return error.outcome
    return OUTCOMES.get(error.status, "invalid" if 400 <= error.status < 500 else "error")


def error_body(error: ApiError) -> dict:
    """OpenAI's `{"message", "type", "param", "code"}` for an answer."""
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
        error.status, "invalid_request_error" if error.status < 500 else "server_error")
    code = {401: "invalid_api_key", 404: "model_not_found" if error.param == "model" else None,
            413: "request_too_large"}.get(error.status)
    return {"message": str(error), "type": kind, "param": error.param, "code": code}
