"""The client's exceptions: one shallow tree (after httpx's), translated at one boundary.

Every HTTP error the API answers is an RFC 9457 problem; :func:`from_response` turns it into the
:class:`APIError` subclass of its family, chosen by the problem's ``type`` slug and, for a type
this client does not know, by the HTTP status. Transport failures become :class:`ConnectionError`
or :class:`Timeout`; a job that ends badly while waited on is :class:`JobFailed`.

    StackfuseError
    ├── APIError              an error response (status, problem, type, title, detail)
    │   ├── BadRequest        400, 405, 408, 415, 422, 431: the request or the module is refused
    │   │   └── InvalidModule the module itself (parse, allow-list, forbidden constructs)
    │   ├── PayloadTooLarge   413: the body or one of the module's limits
    │   ├── Unauthorized      401 (no or a wrong API key); Forbidden (403) below it
    │   ├── NotFound          404: no such job (unknown, expired, or not yours)
    │   ├── Conflict          409: not ready yet, or already finished (cancel)
    │   ├── RateLimited       429 (``retry_after``)
    │   └── ServerError       5xx: the service failed; retryable (``retry_after``)
    ├── JobFailed             the job ended ``failed`` (``error``: its type, title, message)
    │   └── JobCancelled      the job ended ``cancelled``
    ├── Timeout               no answer in time, or a wait ran past its timeout
    └── ConnectionError       the API cannot be reached
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import httpx

#: the prefix of every problem ``type`` the service sends (service/problems.py)
PROBLEM_BASE = "https://stackfuse.dev/problems/"


class StackfuseError(Exception):
    """Base of every error the client raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class APIError(StackfuseError):
    """The API answered with an error (an RFC 9457 problem, or a body that is not one)."""

    def __init__(self, status: int, problem: dict[str, Any], retry_after: float | None = None):
        self.status = status
        self.problem = problem
        #: the problem type's slug, e.g. ``unknown-target`` (the URI's last segment)
        self.type = str(problem.get("type", "")).removeprefix(PROBLEM_BASE)
        self.title = str(problem.get("title", "")) or f"HTTP {status}"
        self.detail = str(problem.get("detail", ""))
        self.retry_after = retry_after
        super().__init__(f"{self.title}: {self.detail}" if self.detail else self.title)


class BadRequest(APIError):
    """The request was refused as sent (shape, media type, target, idempotency key...)."""


class InvalidModule(BadRequest):
    """The module itself cannot be accepted (it does not parse, or uses a refused construct)."""


class PayloadTooLarge(APIError):
    """The body, or one of the module's limits (constants, nodes), is too large."""


class Unauthorized(APIError):
    """No API key, or one the service does not accept."""


class Forbidden(Unauthorized):
    """The key is valid but may not do this."""


class NotFound(APIError):
    """No such job: unknown, expired, or another tenant's."""


class Conflict(APIError):
    """The job is not in a state for this: not finished yet (downloads), or already finished
    (cancel)."""


class RateLimited(APIError):
    """Too many requests; ``retry_after`` says when to try again (seconds), when known."""


class ServerError(APIError):
    """The service failed (5xx); a retry later may succeed."""


class _Job(Protocol):
    """What an error needs of a :class:`stackfuse.Job` (no import of the client here)."""

    @property
    def id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def error(self) -> dict[str, Any] | None: ...


class JobFailed(StackfuseError):
    """The job ended without a library. ``error`` is the job's error (``type``, ``title``,
    ``message``); ``job`` is the job as last seen."""

    def __init__(self, job: _Job) -> None:
        #: the :class:`stackfuse.Job`, as last seen
        self.job: Any = job
        self.error: dict[str, Any] = dict(job.error or {})
        kind = self.error.get("type", "unknown")
        super().__init__(f"job {job.id} {job.status}: {kind}: {self.error.get('message', '')}")


class JobCancelled(JobFailed):
    """The job was cancelled before it finished."""


class Timeout(StackfuseError):
    """The API did not answer in time, or a job did not finish within a wait's timeout."""


class ConnectionError(StackfuseError):
    """The API cannot be reached at the client's URL (the client's own, as httpx names its
    own ``ConnectError``; not the builtin)."""


#: problem type slug -> exception, where the slug says more than the status
_BY_TYPE: dict[str, type[APIError]] = {
    "invalid-module": InvalidModule,
    "forbidden-construct": InvalidModule,
    "forbidden-script": InvalidModule,
    "payload-too-large": PayloadTooLarge,
    "limit-exceeded": PayloadTooLarge,
    "not-found": NotFound,
    "not-ready": Conflict,
}

_BY_STATUS: dict[int, type[APIError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    429: RateLimited,
}


def error_class(status: int, slug: str) -> type[APIError]:
    """The exception for a problem of ``slug`` answered with ``status``."""
    if slug in _BY_TYPE:
        return _BY_TYPE[slug]
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return ServerError
    if 400 <= status < 500:
        return BadRequest
    return APIError


def from_response(response: httpx.Response) -> APIError:
    """The exception for an error response (problem+json, or anything else it sent)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"title": f"HTTP {response.status_code}", "detail": response.text[:500]}
    retry_after: float | None = None
    raw = response.headers.get("Retry-After")
    if raw is not None:
        try:
            retry_after = float(raw)
        except ValueError:
            retry_after = None
    slug = str(body.get("type", "")).removeprefix(PROBLEM_BASE)
    return error_class(response.status_code, slug)(response.status_code, body, retry_after)
