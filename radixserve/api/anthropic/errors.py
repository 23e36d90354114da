"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``: light enough
for the router to import (no engine, no torch)."""

from __future__ import annotations

from radixserve.api.asgi import APIError, Response, json_response

PREFIX = "/v1/messages"  # the Messages API's routes: errors under it take this shape
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(error: APIError) -> Response:
    """An error in Anthropic's shape (overload is its 529 ``overloaded_error``)."""
    status = error.status
    if error.code == "overloaded":
        status, kind = 529, "overloaded_error"
    elif status == 503:
        kind = "api_error"
    else:
        kind = _ERROR_TYPES.get(status, "api_error")
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return json_response({"type": "error", "error": {"type": kind, "message": message}}, status)
