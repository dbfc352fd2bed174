"""HTTP routes. Thin: validation, then :mod:`service.jobs` and the store do the work.

Handlers stay cheap for the event loop: the body is hashed once, Redis is asked at most twice
per request on the common paths, a large body is decoded and checked in a child process
(:mod:`service.intake`), and writing the module runs in a worker thread.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from starlette.requests import ClientDisconnect

from service import intake, jobs, tenancy
from service.errors import (
    InfrastructureError,
    NotFound,
    NotReady,
    RequestError,
    UnsupportedMediaType,
)
from service.intake import Offload, Spool
from service.problems import openapi_problems
from service.schemas import TERMINAL, Health, JobList, JobView, OptimizeRequest
from service.settings import Settings, redact_url
from service.state import AppState


# async on purpose: FastAPI runs a sync dependency in the thread pool, a hop per request
async def _state(request: Request) -> AppState:
    return request.app.state.stackfuse


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


#: Declares the Bearer scheme in OpenAPI; the header itself is read by :func:`_caller`.
_bearer = HTTPBearer(auto_error=False, description="An API key (`stackfuse keys create`).")


async def _caller(request: Request, _scheme: Annotated[object, Depends(_bearer)]) -> tenancy.Caller:
    state: AppState = request.app.state.stackfuse
    return await state.auth.caller(request.headers.get("authorization"))


StateDep = Annotated[AppState, Depends(_state)]
SettingsDep = Annotated[Settings, Depends(_settings)]
CallerDep = Annotated[tenancy.Caller, Depends(_caller)]

router = APIRouter()


_problems = openapi_problems


def _inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` substituted in place: pydantic's ``#/$defs/...`` refs
    dangle once the schema is embedded in the OpenAPI document."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk({**defs[ref.removeprefix("#/$defs/")], **_without(node, "$ref")})
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return dict(walk(schema))


def _without(node: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k != key}


def _job_response(
    record: dict[str, str],
    settings: Settings,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> Response:
    view = jobs.view(record)
    out = dict(headers or {})
    if view.status not in TERMINAL:
        out["Retry-After"] = str(settings.retry_after_s)
    return JSONResponse(view.model_dump(mode="json", by_alias=True), status_code, out)


# --- request decoding -------------------------------------------------------------------------
def _check_media_type(request: Request) -> None:
    raw = request.headers.get("content-type", "")
    media = raw.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"POST /optimize takes application/json, not {raw or 'a body without Content-Type'}",
            accepted=["application/json"],
        )


async def _read_body(request: Request, spool: Spool) -> None:
    """Stream the body into ``spool`` (Starlette's ``request.body()`` would join a copy and keep
    it on the request). The size limit is BodyLimit's, applied as it streams."""
    try:
        async for chunk in request.stream():
            spool.write(chunk)
    except ClientDisconnect:
        raise RequestError("the client went away before the body was complete") from None
    spool.finish()


def _offload(request: Request, settings: Settings) -> Offload:
    app_state = request.app.state
    offload: Offload | None = getattr(app_state, "stackfuse_offload", None)
    if offload is None:
        offload = app_state.stackfuse_offload = Offload(settings)
    return offload


# --- routes -----------------------------------------------------------------------------------
@router.post(
    "/optimize",
    status_code=202,
    response_model=JobView,
    summary="Submit a module for optimization",
    responses=_problems(400, 401, 408, 413, 415, 422, 429, 431, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": _inline_defs(OptimizeRequest.model_json_schema())}
            },
        },
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string"},
                "description": "Same key + same body -> the same job; a different body -> 422.",
            }
        ],
    },
)
async def optimize(request: Request, state: StateDep, caller: CallerDep) -> Response:
    """Validate cheaply, answer from the compile cache if possible, else enqueue a compile."""
    settings = state.settings
    _check_media_type(request)
    idem = request.headers.get("idempotency-key")
    if idem is not None and not (0 < len(idem) <= settings.max_idempotency_key_chars):
        raise RequestError(
            f"Idempotency-Key must be 1 to {settings.max_idempotency_key_chars} characters"
        )
    spool = Spool(settings.parse_in_process_bytes)
    try:
        await _read_body(request, spool)
        if spool.path is not None:
            sub, module_bytes = await _offload(request, settings).decode(
                spool.path, state.toolchain
            )
        else:
            sub, module_bytes = intake.decode(spool.buffer, settings, state.toolchain)
    finally:
        spool.close()

    record, replayed = await jobs.submit(
        state.redis,
        state.queue,
        state.store,
        settings,
        sub.for_tenant(caller.tenant),
        module_bytes,
        idem,
        tenancy.Quota.for_caller(caller, settings),
    )
    headers = {"Location": f"/jobs/{record['id']}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return _job_response(record, settings, 202, headers)


async def _record(state: AppState, job_id: str, caller: tenancy.Caller) -> dict[str, str]:
    """The caller's job; another tenant's is answered exactly like an unknown id."""
    if not jobs.is_job_id(job_id):
        raise NotFound(f"there is no job {job_id[:64]!r}")
    raw = await state.redis.hgetall(jobs.record_key(job_id))
    record = jobs.decode(raw) if raw else None
    if record is None or jobs.record_tenant(record) != caller.tenant:
        raise NotFound(f"there is no job {job_id} (unknown, or expired)")
    return record


@router.get(
    "/jobs",
    response_model=JobList,
    summary="The caller's jobs, newest first",
    responses=_problems(401, 422, 503),
)
async def list_jobs(
    state: StateDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=jobs.LIST_MAX)] = jobs.LIST_DEFAULT,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
) -> Response:
    """One page; pass ``next_cursor`` as ``cursor`` for the next (null on the last page)."""
    records, next_cursor = await jobs.list_jobs(state.redis, caller.tenant, limit, cursor)
    body = {
        "jobs": [jobs.view(r).model_dump(mode="json", by_alias=True) for r in records],
        "next_cursor": next_cursor,
    }
    return JSONResponse(body)


@router.delete(
    "/jobs/{job_id}",
    status_code=202,
    response_model=JobView,
    summary="Cancel a queued or running job",
    responses=_problems(401, 404, 409, 422, 503),
)
async def cancel_job(job_id: str, state: StateDep, caller: CallerDep) -> Response:
    """A queued job leaves the queue; a running one's work-horse is stopped. Either way the job
    is ``cancelled`` at once (202); a finished one is a 409."""
    import anyio

    record = await _record(state, job_id, caller)
    record = await jobs.cancel(state.redis, state.settings, state.store, record)
    await anyio.to_thread.run_sync(jobs.stop_rq_job, state.sync_redis, state.settings, job_id)
    return _job_response(record, state.settings, 202)


@router.get(
    "/jobs/{job_id}",
    response_model=JobView,
    summary="Job status",
    responses=_problems(401, 404, 422, 503),
)
async def get_job(job_id: str, state: StateDep, caller: CallerDep) -> Response:
    """Status, stage and progress; links to the artifact and report once there."""
    return _job_response(await _record(state, job_id, caller), state.settings)


def _not_ready(record: dict[str, str], what: str, settings: Settings) -> NotReady:
    return NotReady(
        f"job {record['id']} is {record['status']}; the {what} is not ready yet",
        status_of_job=record["status"],
        retry_after_s=settings.retry_after_s,
    )


def _etag_matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    tags = [t.strip() for t in if_none_match.split(",")]
    return "*" in tags or etag in tags or f"W/{etag}" in tags


def _serve_object(
    state: AppState, sha256: str, media_type: str, filename: str, if_none_match: str | None
) -> Response:
    etag = f'"{sha256}"'
    if _etag_matches(if_none_match, etag):
        return Response(status_code=304, headers={"ETag": etag})
    path = state.store.local_path(sha256)
    if path is None:
        raise InfrastructureError(f"object {sha256} is missing from the store")
    return FileResponse(
        path,
        media_type=media_type,
        filename=filename,
        headers={"ETag": etag, "Cache-Control": "private, max-age=31536000, immutable"},
    )


@router.get(
    "/jobs/{job_id}/artifact",
    summary="The built shared library",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the .so"},
        304: {"description": "If-None-Match matched the ETag (the library's sha256)"},
        **_problems(401, 404, 409, 422, 503),
    },
)
async def get_artifact(
    job_id: str,
    state: StateDep,
    caller: CallerDep,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    record = await _record(state, job_id, caller)
    if record["status"] != "succeeded":
        if record["status"] in ("failed", "cancelled"):
            raise NotReady(
                f"job {job_id} {record['status']}; it has no artifact",
                status_of_job=record["status"],
            )
        raise _not_ready(record, "artifact", state.settings)
    sha = record["artifact_sha256"]
    return _serve_object(
        state, sha, "application/octet-stream", f"stackfuse-{job_id}.so", if_none_match
    )


@router.get(
    "/jobs/{job_id}/report",
    summary="The fusion report",
    response_class=Response,
    responses={
        200: {"content": {"application/json": {}}, "description": "worker.report.Report"},
        **_problems(401, 404, 409, 422, 503),
    },
)
async def get_report(
    job_id: str,
    state: StateDep,
    caller: CallerDep,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """Also served for failed jobs when partitioning ran (then ``error`` is set in it)."""
    record = await _record(state, job_id, caller)
    sha = record.get("report_sha256")
    if not sha:
        if record["status"] in ("failed", "cancelled"):
            raise NotFound(
                f"job {job_id} {record['status']} before partitioning ran, so it has no report"
            )
        raise _not_ready(record, "report", state.settings)
    if record.get("cached") == "1":
        return _cached_report(state, record, sha, if_none_match)
    return _serve_object(
        state, sha, "application/json", f"stackfuse-{job_id}-report.json", if_none_match
    )


@router.get(
    "/jobs/{job_id}/report.html",
    summary="The fusion report as one self-contained HTML page",
    response_class=Response,
    responses={
        200: {"content": {"text/html": {}}, "description": "the report page"},
        **_problems(401, 404, 409, 422, 503),
    },
)
async def get_report_html(job_id: str, state: StateDep, caller: CallerDep) -> Response:
    """The same report as ``/jobs/{id}/report`` (same readiness and 404s), as a page."""
    import json

    from worker.report_html import render  # no TVM

    record = await _record(state, job_id, caller)
    sha = record.get("report_sha256")
    if not sha:
        if record["status"] in ("failed", "cancelled"):
            raise NotFound(
                f"job {job_id} {record['status']} before partitioning ran, so it has no report"
            )
        raise _not_ready(record, "report", state.settings)
    path = state.store.local_path(sha)
    if path is None:
        raise InfrastructureError(f"object {sha} is missing from the store")
    raw = path.read_bytes()
    if record.get("cached") == "1":
        from worker.report import cached_view

        raw = cached_view(raw, job_id, record.get("cached_from_job", ""))
    return Response(render(json.loads(raw)), media_type="text/html; charset=utf-8")


def _cached_report(
    state: AppState, record: dict[str, str], sha256: str, if_none_match: str | None
) -> Response:
    """A job answered from the compile cache serves the original job's report as its own:
    ``cached: true``, the original compile time apart, its own download name."""
    from worker.report import cached_view  # pydantic only, no TVM

    job_id = record["id"]
    etag = f'"{sha256}-{job_id}"'
    if _etag_matches(if_none_match, etag):
        return Response(status_code=304, headers={"ETag": etag})
    path = state.store.local_path(sha256)
    if path is None:
        raise InfrastructureError(f"object {sha256} is missing from the store")
    body = cached_view(path.read_bytes(), job_id, record.get("cached_from_job", ""))
    return Response(
        body,
        media_type="application/json",
        headers={
            "ETag": etag,
            "Content-Disposition": f'attachment; filename="stackfuse-{job_id}-report.json"',
            "Cache-Control": "private, max-age=31536000, immutable",
        },
    )


@router.get("/healthz", response_model=Health, summary="The API process is up")
async def healthz() -> dict[str, Any]:
    return {"status": "ok", "checks": {}}


@router.get(
    "/readyz",
    response_model=Health,
    summary="Redis answers and at least one worker is alive",
    responses=_problems(503),
)
async def readyz(state: StateDep) -> dict[str, Any]:
    from rq.worker_registration import WORKERS_BY_QUEUE_KEY

    settings = state.settings
    try:
        await state.redis.ping()
        keys = await state.redis.smembers(WORKERS_BY_QUEUE_KEY % settings.queue_name)
        async with state.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(key, "last_heartbeat")
            beats = await pipe.execute()
    except Exception as exc:
        raise InfrastructureError(
            f"Redis at {redact_url(settings.redis_url)} does not answer: {type(exc).__name__}"
        ) from None
    now = datetime.now(UTC)
    alive = 0
    for beat in beats:
        if beat:
            seen = datetime.strptime(beat, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
            if (now - seen).total_seconds() <= settings.worker_ttl_s:
                alive += 1
    if alive == 0:
        raise InfrastructureError(
            f"no worker is alive on queue {settings.queue_name!r}; start one with "
            "`stackfuse worker`",
            workers=0,
        )
    return {"status": "ok", "checks": {"redis": "ok", "workers": alive}}
