"""The one exception hierarchy of Stackfuse.

Shallow on purpose (after httpx): a caller catches ``StackfuseError`` or one of four families.
Every error carries a stable ``type`` slug (the last segment of the RFC 9457 problem type URI),
the HTTP status the API answers with, and a message a person can act on. Foreign errors (TVM,
nvcc, redis) are translated into these at one boundary each; none leaks raw to a client.

    StackfuseError
    ├── RequestError        bad HTTP request (size, media type, JSON, target, idempotency,
    │                       API key, tenant quota)
    ├── InputError          the module itself is unusable or hostile (parse, allow-list, limits)
    ├── CompileError        a deterministic failure of partition/codegen/build: not retried
    └── InfrastructureError the machine failed (toolchain missing, timeout, killed): retryable
"""

from __future__ import annotations

from typing import Any, ClassVar


class StackfuseError(Exception):
    """Base of every error Stackfuse raises on purpose."""

    type: ClassVar[str] = "internal-error"
    title: ClassVar[str] = "Internal error"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_dict(self) -> dict[str, Any]:
        """The job-record / CLI form: ``{"type", "title", "message", ...detail}``."""
        return {"type": self.type, "title": self.title, "message": self.message, **self.detail}


# --- requests -----------------------------------------------------------------------------
class RequestError(StackfuseError):
    type = "bad-request"
    title = "Bad request"
    status = 400


class PayloadTooLarge(RequestError):
    type = "payload-too-large"
    title = "Request body too large"
    status = 413


class HeadersTooLarge(RequestError):
    type = "headers-too-large"
    title = "Request headers too large"
    status = 431


class RequestTimeout(RequestError):
    """The client was too slow sending its request (headers or body); the connection is closed."""

    type = "request-timeout"
    title = "Request timeout"
    status = 408


class UnsupportedMediaType(RequestError):
    type = "unsupported-media-type"
    title = "Unsupported media type"
    status = 415


class MalformedJSON(RequestError):
    type = "malformed-json"
    title = "Body is not valid JSON"
    status = 400


class InvalidRequest(RequestError):
    """The JSON is well formed but not the shape POST /optimize takes (missing or extra fields)."""

    type = "invalid-request"
    title = "Request body has the wrong shape"
    status = 422


class MethodNotAllowed(RequestError):
    type = "method-not-allowed"
    title = "Method not allowed"
    status = 405


class UnknownTarget(RequestError):
    type = "unknown-target"
    title = "Unknown target"
    status = 422


class IdempotencyConflict(RequestError):
    type = "idempotency-conflict"
    title = "Idempotency-Key reused with a different body"
    status = 422


class NotFound(RequestError):
    type = "not-found"
    title = "Not found"
    status = 404


class NotReady(RequestError):
    type = "not-ready"
    title = "Not ready"
    status = 409


class AlreadyFinished(RequestError):
    """DELETE /jobs/{id} of a job that already succeeded, failed or was cancelled."""

    type = "job-finished"
    title = "Job already finished"
    status = 409


class Unauthorized(RequestError):
    """No API key, or one that is unknown or revoked, while keys are configured."""

    type = "unauthorized"
    title = "API key missing or not valid"
    status = 401

    def __init__(self, message: str, *, challenge: str = 'Bearer realm="stackfuse"') -> None:
        super().__init__(message)
        self.challenge = challenge  # the WWW-Authenticate header (RFC 6750), not in the body


class Forbidden(RequestError):
    """A valid key that does not grant this route (e.g. /metrics without an admin key)."""

    type = "forbidden"
    title = "Not allowed with this API key"
    status = 403


class QuotaExceeded(RequestError):
    """A tenant is at one of its quotas (jobs queued or running, bytes stored)."""

    type = "quota-exceeded"
    title = "Tenant quota exceeded"
    status = 429


# --- the module ---------------------------------------------------------------------------
class InputError(StackfuseError):
    """The module cannot be accepted as sent."""

    type = "invalid-module"
    title = "Invalid module"
    status = 422


class LimitExceeded(InputError):
    type = "limit-exceeded"
    title = "Module exceeds a limit"
    status = 413


class ForbiddenConstruct(InputError):
    type = "forbidden-construct"
    title = "Module uses a construct Stackfuse refuses"
    status = 422


class ForbiddenScript(ForbiddenConstruct):
    """TVMScript holding Python outside the allow-list (TVM's parser would evaluate it)."""

    type = "forbidden-script"
    title = "TVMScript uses Python Stackfuse does not accept"


# --- compiling ----------------------------------------------------------------------------
class CompileError(StackfuseError):
    """Deterministic: the same input fails the same way, so it is never retried."""

    type = "compile-failed"
    title = "Compilation failed"
    status = 422


class UnsupportedTarget(CompileError):
    type = "unsupported-target"
    title = "Target not supported"


class TimeLimitExceeded(CompileError):
    """A step ran past its time limit. Not retried: the same input would run as long again."""

    type = "time-limit-exceeded"
    title = "Time limit exceeded"


# --- infrastructure -----------------------------------------------------------------------
class InfrastructureError(StackfuseError):
    """The machine, not the input, failed; a retry on another worker may succeed."""

    type = "infrastructure-error"
    title = "Infrastructure failure"
    status = 503
    retryable = True


class ToolchainError(InfrastructureError):
    type = "toolchain-error"
    title = "Toolchain unavailable or failed"
