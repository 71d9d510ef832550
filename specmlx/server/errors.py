"""Errors in OpenAI's shape, so that clients written for it report them as they would its own.

Every failure a request can cause becomes one of these, with the status an OpenAI client
maps to its exception classes: 400 bad request, 401 key, 404 model or route, 413 body
too large. Anything
else is a bug: a 500 with the same shape, and the server keeps serving.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses; the message says what to change."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    body = error_body(error.status, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.status)


async def on_api_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, APIError)
    request.state.error = error.message  # for the request's log line
    return error_response(error)


async def on_http_error(request: Request, error: Exception) -> JSONResponse:
    """Starlette's own (unknown route, wrong method) in the same shape."""
    assert isinstance(error, HTTPException)
    body = error_body(error.status_code, str(error.detail))
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


async def on_bug(request: Request, error: Exception) -> JSONResponse:
    message = f"internal error: {type(error).__name__}: {error}"
    logging.getLogger("specmlx.server").error(message, exc_info=error)
    return JSONResponse(error_body(500, message), status_code=500)


HANDLERS = {APIError: on_api_error, HTTPException: on_http_error, Exception: on_bug}
