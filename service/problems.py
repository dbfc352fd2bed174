"""RFC 9457 problem details: the one place an error becomes an HTTP response.

Every error path ends in :func:`problem_response`. Foreign exceptions (Starlette's 404/405,
FastAPI's parameter validation, anything unexpected) are first translated into a
:class:`service.errors.StackfuseError`, so clients see one shape and one set of type URIs.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.errors import (
    InfrastructureError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RequestError,
    StackfuseError,
    Unauthorized,
)

PROBLEM_BASE = "https://stackfuse.dev/problems/"
PROBLEM_MEDIA_TYPE = "application/problem+json"

log = logging.getLogger("stackfuse.api")


def openapi_problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI error responses as they are sent: ``application/problem+json`` only."""
    from http import HTTPStatus

    from service.schemas import Problem

    schema = Problem.model_json_schema()
    return {
        c: {
            "description": HTTPStatus(c).phrase,
            "content": {PROBLEM_MEDIA_TYPE: {"schema": schema}},
        }
        for c in codes
    }


def problem_body(
    err: StackfuseError, instance: str | None = None, status: int | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + err.type,
        "title": err.title,
        "status": status or err.status,
        "detail": err.message,
    }
    if instance:
        body["instance"] = instance
    # extension members: the error's structured detail (limits, allowed values ...)
    for key, value in err.detail.items():
        body.setdefault(key, value)
    return body


def problem_response(
    err: StackfuseError,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    status: int | None = None,
) -> Response:
    """The response for ``err``; ``status`` overrides the class's (foreign HTTP errors only)."""
    return Response(
        content=json.dumps(problem_body(err, instance, status), default=str),
        status_code=status or err.status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=headers,
    )


def _instance(request: Request) -> str:
    return request.url.path


async def _stackfuse_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StackfuseError)
    headers: dict[str, str] = {}
    if exc.status == 413:
        headers["Connection"] = "close"  # the rest of the body will not be read
    if "retry_after_s" in exc.detail:
        headers["Retry-After"] = str(exc.detail["retry_after_s"])
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = exc.challenge
    return problem_response(exc, _instance(request), headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    err: StackfuseError
    if exc.status_code == 404:
        err = NotFound(f"no resource at {request.url.path}")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
    else:
        err = RequestError(str(exc.detail))
    return problem_response(err, _instance(request), dict(exc.headers or {}), exc.status_code)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
    return problem_response(
        InvalidRequest("the request is invalid", errors=errors), _instance(request)
    )


async def _redis_error(request: Request, exc: Exception) -> Response:
    log.warning("redis unavailable on %s %s: %s", request.method, request.url.path, exc)
    return problem_response(
        InfrastructureError("the job store (Redis) is unavailable; retry shortly"),
        _instance(request),
        {"Retry-After": "5"},
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem_response(
        StackfuseError("the server failed unexpectedly; the error is logged"), _instance(request)
    )


def install(app: FastAPI) -> None:
    """Register the handlers; all of them render through :func:`problem_response`."""
    app.add_exception_handler(StackfuseError, _stackfuse_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(RedisError, _redis_error)
    app.add_exception_handler(Exception, _unexpected)
