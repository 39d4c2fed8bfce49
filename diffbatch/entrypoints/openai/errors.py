"""Every HTTP error in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

The server answers errors from four sources, all through `error_response`:

- diffbatch exceptions (`diffbatch.errors`): status, type and param come from the
  exception's own attributes;
- a failed request's `RequestError` (from the engine's `DiffusionOutput.error`);
- FastAPI's request validation (malformed JSON, wrong types, our protocol rules),
  translated from its 422 body to a 400 naming the offending field as `param`;
- Starlette's `HTTPException` (unknown route, wrong method) and anything
  unexpected (500, logged with its traceback, never shown to the client).

Every 503 carries `Retry-After` (full queue, engine restarting its worker or
shutting down, connection limit): the condition is temporary, here or elsewhere.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffbatch.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from diffbatch.errors import (
    DiffbatchError,
    EngineDeadError,
    ModelNotFoundError,
    PayloadTooLargeError,
    QueueFullError,
    RequestTimeoutError,
)

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

    from diffbatch.outputs import RequestError

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a request answered 503.
RETRY_AFTER_S = 1

# FastAPI's whole answer to a body that `json.loads` refuses with anything but a
# JSONDecodeError (an integer over Python's 4300-digit limit, nesting too deep).
_FASTAPI_BODY_ERROR = "There was an error parsing the body"

# Machine-readable `code`s, like OpenAI's "model_not_found"; None where OpenAI has none.
_CODES: dict[type[DiffbatchError], str] = {
    ModelNotFoundError: "model_not_found",
    PayloadTooLargeError: "payload_too_large",
    QueueFullError: "queue_full",
    RequestTimeoutError: "timeout",
    EngineDeadError: "engine_unavailable",
}
_STATUS_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "server_overloaded",
}


def error_body(
    message: str, type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error body as a plain dict."""
    info = ErrorInfo(message=message, type=type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(
    status_code: int,
    message: str,
    *,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSON response with the OpenAI error body; `type` defaults from the status."""
    if type is None:
        type = _STATUS_TYPES.get(status_code, "server_error" if status_code >= 500 else
                                 "invalid_request_error")
    if status_code == 503 and not any(k.lower() == "retry-after" for k in headers or {}):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(
        error_body(message, type, param=param, code=code),
        status_code=status_code,
        headers=headers,
    )


def _code_of(exc: DiffbatchError) -> str | None:
    for cls in type(exc).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return None


def exception_response(exc: DiffbatchError) -> JSONResponse:
    """Map a diffbatch exception through its `status_code`, `type` and `param`."""
    status, message, keywords = exception_error(exc)
    return error_response(status, message, **keywords)


def exception_error(exc: DiffbatchError) -> tuple[int, str, dict[str, Any]]:
    """(status, message, keywords of `error_response`) of a diffbatch exception."""
    return exc.status_code, exc.message, {"type": exc.type, "param": exc.param,
                                          "code": _code_of(exc)}


def request_error_response(error: RequestError) -> JSONResponse:
    """Map the `RequestError` of a failed engine request (see `request_error`)."""
    status, message, keywords = request_error(error)
    return error_response(status, message, **keywords)


def request_error(error: RequestError) -> tuple[int, str, dict[str, Any]]:
    """(status, message, keywords of `error_response`) of a failed engine request.

    NOTE: an aborted request (499) that reaches here was aborted by the server, not
    by this client (whose disconnect cancels the handler before any answer), e.g.
    because the engine is shutting down; 503 tells the client it may retry.
    """
    if error.status_code == 499:
        return 503, f"request was aborted by the server: {error.message}", {
            "type": "engine_unavailable", "code": "aborted"}
    code = "engine_unavailable" if error.type == EngineDeadError.type else None
    return error.status_code, error.message, {"type": error.type, "param": error.param,
                                              "code": code}


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """The request field a pydantic error location points at ("body", "n") -> "n",
    ("query", "after") -> "after"."""
    parts = [str(p) for p in loc if p not in ("body", "query")]
    return ".".join(parts) if parts else None


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """Translate FastAPI's 422 validation errors into one OpenAI 400 (or 413/404).

    The first error decides the answer; a `DiffbatchError` raised by a protocol
    validator keeps its own message, status and param.
    """
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    kind = first.get("type", "")
    loc = tuple(first.get("loc", ()))
    param = _param_of(loc)
    ctx = first.get("ctx") or {}
    cause = ctx.get("error")
    if kind == "json_invalid":
        detail = ctx.get("error", "")
        return error_response(
            400, f"request body is not valid JSON ({detail}); send a JSON object",
            code="invalid_json",
        )
    if isinstance(cause, DiffbatchError):
        return exception_response(cause)
    if kind == "missing":
        message = f"`{param}` is required" if param else "a request body is required"
    elif kind == "extra_forbidden":
        message = f"unknown field `{param}`; see /docs for the supported fields"
    elif param is None and kind in ("model_attributes_type", "dict_type"):
        message = f"request body must be a JSON object, got {_short(first.get('input'))}"
    else:
        message = f"`{param}` {_rule_of(kind, ctx, first)}, got {_short(first.get('input'))}"
    return error_response(400, message, param=param)


# pydantic error types -> our "`field` must be <rule>" wording.
_RULES: dict[str, str] = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "string_too_short": "must have at least {min_length} characters",
    "string_too_long": "must have at most {max_length} characters",
    "bool_type": "must be a boolean",
    "bool_parsing": "must be a boolean",
    "literal_error": "must be one of {expected}",
}


def _rule_of(kind: str, ctx: dict[str, Any], error: Any) -> str:
    template = _RULES.get(kind)
    if template is not None:
        try:
            return template.format(**ctx)
        except (KeyError, IndexError):
            pass
    return f"is invalid: {error.get('msg', 'invalid value')}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _diffbatch_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DiffbatchError)
    return exception_response(exc)


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error_response(exc)


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    code = None
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see /docs"
    elif exc.status_code == 400 and message == _FASTAPI_BODY_ERROR:
        message, code = "request body is not valid JSON; send a JSON object", "invalid_json"
    return error_response(exc.status_code, message, code=code,
                          headers=getattr(exc, "headers", None))


async def _unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal server error ({type(exc).__name__})")


def install_exception_handlers(app: FastAPI) -> None:
    """Make every error `app` answers use the OpenAI shape."""
    app.add_exception_handler(DiffbatchError, _diffbatch_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
