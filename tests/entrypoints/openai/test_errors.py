"""Mapping of diffbatch exceptions and failed requests to OpenAI error responses."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError

from diffbatch.entrypoints.openai.errors import (
    RETRY_AFTER_S,
    exception_response,
    request_error_response,
    validation_error_response,
)
from diffbatch.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    PayloadTooLargeError,
    PipelineError,
    QueueFullError,
    RequestTimeoutError,
)
from diffbatch.outputs import DiffusionOutput, RequestError


def body_of(response) -> dict:
    return json.loads(response.body)["error"]


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (InvalidRequestError("bad n", param="n"), 400, "invalid_request_error", None),
        (ModelNotFoundError("no model", param="model"), 404, "not_found_error",
         "model_not_found"),
        (PayloadTooLargeError("too big", param="size"), 413, "invalid_request_error",
         "payload_too_large"),
        (QueueFullError("full"), 503, "server_overloaded", "queue_full"),
        (RequestTimeoutError("slow"), 504, "timeout_error", "timeout"),
        (EngineDeadError("dead"), 503, "engine_unavailable", "engine_unavailable"),
        (EngineClosedError("closed"), 503, "engine_unavailable", "engine_unavailable"),
        (PipelineError("boom"), 500, "server_error", None),
    ],
)
def test_exception_attributes_decide_the_answer(exc, status: int, type_: str, code) -> None:
    response = exception_response(exc)
    assert response.status_code == status
    error = body_of(response)
    assert error == {"message": exc.message, "type": type_, "param": exc.param, "code": code}
    retry = response.headers.get("retry-after")
    assert retry == (str(RETRY_AFTER_S) if status == 503 else None)  # every 503 has one


def test_failed_request_keeps_its_status_and_param() -> None:
    response = request_error_response(RequestError("oops", 500, "server_error"))
    assert response.status_code == 500
    assert body_of(response)["message"] == "oops"
    response = request_error_response(RequestError("bad", 400, "invalid_request_error", "lora"))
    assert (response.status_code, body_of(response)["param"]) == (400, "lora")


def test_a_server_side_abort_is_a_retryable_503() -> None:
    error = DiffusionOutput.make_aborted("r1").error
    assert error is not None
    response = request_error_response(error)
    assert response.status_code == 503
    assert body_of(response)["code"] == "aborted"


@pytest.mark.parametrize(
    ("error", "message", "param"),
    [
        ({"type": "missing", "loc": ("body", "prompt"), "msg": "Field required", "input": {}},
         "`prompt` is required", "prompt"),
        ({"type": "extra_forbidden", "loc": ("body", "colour"), "msg": "x", "input": 1},
         "unknown field `colour`", "colour"),
        ({"type": "greater_than_equal", "loc": ("body", "n"), "msg": "x", "input": 0,
          "ctx": {"ge": 1}}, "`n` must be >= 1, got 0", "n"),
        ({"type": "int_type", "loc": ("body", "seed"), "msg": "x", "input": "a"},
         "`seed` must be an integer, got 'a'", "seed"),
        ({"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error", "input": {},
          "ctx": {"error": "Expecting value"}}, "not valid JSON (Expecting value)", None),
        ({"type": "model_attributes_type", "loc": ("body",), "msg": "x", "input": [1]},
         "must be a JSON object, got [1]", None),
        ({"type": "something_new", "loc": ("body", "n"), "msg": "odd", "input": 2},
         "`n` is invalid: odd, got 2", "n"),
    ],
)
def test_validation_errors_become_400_with_param(error: dict, message: str, param) -> None:
    response = validation_error_response(RequestValidationError([error]))
    assert response.status_code == 400
    body = body_of(response)
    assert message in body["message"]
    assert (body["param"], body["type"]) == (param, "invalid_request_error")


def test_a_diffbatch_error_inside_validation_keeps_its_status() -> None:
    cause = PayloadTooLargeError("too many pixels", param="size")
    error = {"type": "value_error", "loc": ("body", "size"), "msg": "Value error",
             "input": "9999x9999", "ctx": {"error": cause}}
    response = validation_error_response(RequestValidationError([error]))
    assert response.status_code == 413
    assert body_of(response)["message"] == "too many pixels"
