"""Job records, the compile cache index, idempotency keys and enqueueing. No FastAPI, no TVM.

A job is one Redis hash, ``stackfuse:job:<id>`` (all values strings), read by GET /jobs/{id} in
one round trip, created by :func:`submit` (the API, asyncio) and changed by :class:`JobRecords`
(the worker, sync, as RQ is). RQ's own job
hash carries only ``(job_id, input_sha256, spec)``; the module, the library and the report live in
the content-addressed :mod:`service.storage`. :class:`JobRecords` never overwrites a finished
job, so a job delivered twice (a retry racing a slow attempt) cannot undo a result.

Helpers that only queue commands (``write_record`` ...) accept a sync or an asyncio pipeline, so
the API (redis.asyncio) and the worker (sync redis, as RQ needs) share them.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from service import metrics, tenancy
from service.errors import (
    AlreadyFinished,
    IdempotencyConflict,
    InfrastructureError,
    InvalidRequest,
    StackfuseError,
)
from service.schemas import TERMINAL, JobError, JobLinks, JobView, OptimizeRequest
from service.settings import Settings
from service.spec import CompileOptions, Target, cache_key
from service.tenancy import LOCAL_TENANT, Quota

if TYPE_CHECKING:
    from redis import Redis
    from redis.asyncio import Redis as AsyncRedis
    from rq import Queue

    from service.storage import LocalStore, Store

PREFIX = tenancy.PREFIX
#: The RQ task, named by import path so the API never imports the worker (or TVM).
TASK = "worker.tasks.compile_job"

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")


def record_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


#: SCAN patterns of every job record and every compile cache entry (retention reads them).
RECORD_PATTERN = record_key("*")
#: Record fields that name stored objects.
OBJECT_FIELDS = ("input_sha256", "artifact_sha256", "report_sha256")


def cache_index_key(key: str) -> str:
    return f"{PREFIX}:cache:{key}"


CACHE_INDEX_PATTERN = cache_index_key("*")


def idempotency_key(tenant: str, client_key: str) -> str:
    """Per tenant (one tenant's key never finds another's job); hashed so that any client
    string maps to a short, safe Redis key."""
    digest = hashlib.sha256(f"{tenant}\0{client_key}".encode()).hexdigest()
    return f"{PREFIX}:idem:{digest}"


def new_job_id() -> str:
    return uuid.uuid4().hex


def is_job_id(text: str) -> bool:
    return bool(_JOB_ID.match(text))


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def record_ttl(settings: Settings) -> int:
    """Records outlive their RQ job: kept as long as the longer of result/failure TTLs."""
    return max(settings.result_ttl_s, settings.failure_ttl_s)


# --- submissions ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submission:
    """A validated request, reduced to hashes: what the queue and the cache are keyed by."""

    job_id: str
    input_sha256: str
    fingerprint: str
    cache_key: str
    target: Target
    options: CompileOptions
    format: str
    tenant: str = LOCAL_TENANT

    def for_tenant(self, tenant: str) -> Submission:
        """This submission as ``tenant``'s. Its compile cache key names the tenant, so a hit
        is only ever another job of the same tenant: a cross-tenant hit (finished at once,
        ``cached: true``) would tell one tenant that another compiled this exact module. The
        stored objects are content-addressed and shared whatever the tenant."""
        if tenant == LOCAL_TENANT:
            return dataclasses.replace(self, tenant=tenant)
        return dataclasses.replace(
            self, tenant=tenant, cache_key=_sha(f"tenant:{tenant}:{self.cache_key}")
        )

    def spec(self) -> dict[str, Any]:
        """The RQ job's third argument: small, JSON, no module text."""
        return {
            "target": self.target.model_dump(mode="json"),
            "options": self.options.model_dump(mode="json"),
            "format": self.format,
            "cache_key": self.cache_key,
        }


def prepare(request: OptimizeRequest, module_bytes: bytes, toolchain: str) -> Submission:
    """Hash the module once and derive the idempotency fingerprint and the compile cache key."""
    input_sha = hashlib.sha256(module_bytes).hexdigest()
    # The cache key names the module by its bytes *and* how to read them.
    module_id = input_sha if request.format == "tvm-json" else _sha(f"{request.format}:{input_sha}")
    fingerprint = _sha(
        json.dumps(
            {
                "module": input_sha,
                "format": request.format,
                "target": request.target.model_dump(mode="json"),
                "options": request.options.model_dump(mode="json"),
            },
            sort_keys=True,
        )
    )
    return Submission(
        job_id=new_job_id(),
        input_sha256=input_sha,
        fingerprint=fingerprint,
        cache_key=cache_key(module_id, request.target, request.options, toolchain),
        target=request.target,
        options=request.options,
        format=request.format,
    )


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def idempotency_value(sub: Submission) -> str:
    return f"{sub.fingerprint}:{sub.job_id}"


def parse_idempotency_value(value: str) -> tuple[str, str]:
    """``(fingerprint, job_id)`` of a stored idempotency entry."""
    fingerprint, _, job_id = value.partition(":")
    return fingerprint, job_id


# --- records ----------------------------------------------------------------------------------
def new_record(sub: Submission, *, cached_from: dict[str, str] | None = None) -> dict[str, str]:
    """The hash of a new job; finished at once when ``cached_from`` (a cache entry) is given."""
    ts = now_iso()
    record = {
        "id": sub.job_id,
        "status": "queued",
        "stage": "queued",
        "detail": "",
        "progress": "0",
        "created_at": ts,
        "updated_at": ts,
        "attempts": "0",
        "cached": "0",
        "input_sha256": sub.input_sha256,
        "cache_key": sub.cache_key,
        "target": sub.target.model_dump_json(),
        "options": sub.options.model_dump_json(),
        "format": sub.format,
        "tenant": sub.tenant,
    }
    if cached_from is not None:
        record.update(
            status="succeeded",
            stage="done",
            detail="served from the compile cache",
            progress="1",
            started_at=ts,
            finished_at=ts,
            cached="1",
            artifact_sha256=cached_from["artifact_sha256"],
            report_sha256=cached_from["report_sha256"],
            cached_from_job=cached_from.get("job_id", ""),
        )
    return record


def record_tenant(record: dict[str, str]) -> str:
    """The tenant a job belongs to (records written before tenants: the open mode's)."""
    return record.get("tenant") or LOCAL_TENANT


def write_record(pipe: Any, job_id: str, mapping: dict[str, str], ttl: int) -> None:
    """Queue HSET + EXPIRE of a job record on ``pipe`` (sync or asyncio pipeline)."""
    pipe.hset(record_key(job_id), mapping=mapping)
    pipe.expire(record_key(job_id), ttl)


def cache_entry(record: dict[str, str]) -> dict[str, str]:
    return {
        "artifact_sha256": record["artifact_sha256"],
        "report_sha256": record["report_sha256"],
        "job_id": record["id"],
    }


def parse_cache_entry(raw: str | bytes | None) -> dict[str, str] | None:
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    if isinstance(entry, dict) and {"artifact_sha256", "report_sha256"} <= entry.keys():
        return {k: str(v) for k, v in entry.items()}
    return None


def _json_field(record: dict[str, str], name: str) -> Any:
    raw = record.get(name)
    return json.loads(raw) if raw else None


def view(record: dict[str, str]) -> JobView:
    """The API's view of a record (links included)."""
    job_id = record["id"]
    status = record["status"]
    base = f"/jobs/{job_id}"
    error = _json_field(record, "error")
    last_error = _json_field(record, "last_error") if status not in TERMINAL else None
    return JobView(
        id=job_id,
        status=status,  # type: ignore[arg-type]
        stage=record.get("stage", ""),
        detail=record.get("detail", ""),
        progress=float(record.get("progress", "0")),
        created_at=datetime.fromisoformat(record["created_at"]),
        started_at=_ts(record.get("started_at")),
        finished_at=_ts(record.get("finished_at")),
        attempts=int(record.get("attempts", "0")),
        cached=record.get("cached") == "1",
        input_sha256=record["input_sha256"],
        artifact_sha256=record.get("artifact_sha256") or None,
        target=Target.model_validate_json(record["target"]),
        options=CompileOptions.model_validate_json(record["options"]),
        format=record.get("format", "tvm-json"),  # type: ignore[arg-type]
        error=JobError.model_validate(error) if error else None,
        last_error=JobError.model_validate(last_error) if last_error else None,
        links=JobLinks.model_validate(
            {
                "self": base,
                "artifact": f"{base}/artifact" if status == "succeeded" else None,
                "report": f"{base}/report" if record.get("report_sha256") else None,
            }
        ),
    )


def _ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def decode(raw: dict[Any, Any]) -> dict[str, str]:
    """HGETALL answer as ``str -> str`` whatever ``decode_responses`` the client uses."""
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in raw.items()
    }


# --- enqueueing -------------------------------------------------------------------------------
def make_queue(conn: Redis, settings: Settings) -> Queue:
    from rq import Queue
    from rq.serializers import JSONSerializer

    return Queue(
        settings.queue_name,
        connection=conn,
        serializer=JSONSerializer,
        default_timeout=settings.job_timeout_s,
    )


Command = tuple[tuple[Any, ...], dict[str, Any]]


def enqueue_commands(
    queue: Queue, settings: Settings, sub: Submission, record: dict[str, str]
) -> list[Command]:
    """The Redis commands that create the record and the RQ job, without running them.

    RQ's own ``enqueue_call`` writes into a pipeline that is recorded, never executed, so the
    commands are exactly RQ's; the caller runs them in one MULTI/EXEC (the API: on its asyncio
    client, so no thread runs RQ's Python next to the event loop). Needs
    ``queue.get_redis_server_version()`` to have been asked once (RQ caches it).
    """
    from rq import Retry

    # A retry goes to the front of the queue, ahead of work submitted after it: RQ honours
    # enqueue_at_front both for an immediate retry and when its scheduler enqueues a due one.
    retry = (
        Retry(
            max=settings.job_retries,
            interval=list(settings.job_retry_intervals_s),
            enqueue_at_front=True,
        )
        if settings.job_retries > 0
        else None
    )
    recorder = queue.connection.pipeline(transaction=True)
    try:
        recorder.multi()  # RQ would call multi() itself, refusing commands queued before it
        write_record(recorder, sub.job_id, record, record_ttl(settings))
        queue.enqueue_call(
            TASK,
            args=(sub.job_id, sub.input_sha256, sub.spec()),
            job_id=sub.job_id,
            timeout=settings.job_timeout_s,
            result_ttl=settings.result_ttl_s,
            failure_ttl=settings.failure_ttl_s,
            ttl=record_ttl(settings),
            description=f"compile {sub.input_sha256[:12]} for {sub.target.arch}",
            retry=retry,
            pipeline=recorder,
        )
        return [(tuple(args), dict(options)) for args, options in recorder.command_stack]
    finally:
        recorder.reset()


async def submit(
    redis: AsyncRedis,
    queue: Queue,
    store: Store,
    settings: Settings,
    sub: Submission,
    module_bytes: bytes,
    idempotency: str | None,
    quota: Quota | None = None,
) -> tuple[dict[str, str], bool]:
    """Turn a validated submission into a job of ``sub.tenant``: ``(record, replayed)``.

    Same Idempotency-Key (of the same tenant) + same fingerprint -> the earlier job (replayed);
    a different fingerprint -> IdempotencyConflict. The tenant at its storage quota -> 429. A
    compile-cache hit (the tenant's own cache) -> a job finished at once. Otherwise a slot among
    the tenant's active jobs is reserved (429 when ``quota`` has none left), the module is
    stored (in a thread: write + fsync) and then the record + RQ job are created together. Only
    that last path writes the module, so a refused request, a replay or a cache hit leaves
    nothing in the store. Three round trips to Redis for a compile, two for a cache hit.
    """
    import anyio

    tenant = sub.tenant
    idem_key = idempotency_key(tenant, idempotency) if idempotency is not None else None
    async with redis.pipeline(transaction=False) as pipe:
        if idem_key:
            pipe.set(idem_key, idempotency_value(sub), nx=True, ex=settings.idempotency_ttl_s)
        pipe.get(cache_index_key(sub.cache_key))
        pipe.get(tenancy.tenant_key(tenant, "stored_bytes"))
        results = await pipe.execute()

    if idem_key and not results[0]:
        prior = await redis.get(idem_key)
        if prior is not None:
            fingerprint, prior_id = parse_idempotency_value(str(prior))
            if fingerprint != sub.fingerprint:
                raise IdempotencyConflict(
                    "this Idempotency-Key was used with a different body; use a new key",
                    job_id=prior_id,
                )
            record = await _await_record(redis, prior_id)
            if record is not None and record_tenant(record) == tenant:
                return record, True
        # the earlier job is gone (expired, or its enqueue failed): this request takes the key
        await redis.set(idem_key, idempotency_value(sub), ex=settings.idempotency_ttl_s)

    reserved = False
    try:
        stored = int(results[-1] or 0)
        if quota is not None and quota.max_stored_bytes and stored >= quota.max_stored_bytes:
            raise tenancy.quota_refused_bytes(stored, quota.max_stored_bytes, settings)

        entry = parse_cache_entry(results[-2])
        # keep(): the objects are referenced again from now on, so retention spares them
        if entry and store.keep(entry["artifact_sha256"]) and store.keep(entry["report_sha256"]):
            record = new_record(sub, cached_from=entry)
            size = _sizes(store, entry["artifact_sha256"], entry["report_sha256"])
            async with redis.pipeline(transaction=True) as pipe:
                write_record(pipe, sub.job_id, record, record_ttl(settings))
                pipe.zadd(tenancy.tenant_key(tenant, "jobs"), {sub.job_id: _score(record)})
                tenancy.account_stored(pipe, tenant, sub.job_id, size)
                metrics.count_submitted(pipe, "cached")
                await pipe.execute()
            return record, False

        record = new_record(sub)
        limit = quota.max_active_jobs if quota is not None else 0
        oldest = _score(record) - record_ttl(settings) * 1_000_000
        got = await redis.eval(
            tenancy.RESERVE_SCRIPT,
            1,
            tenancy.tenant_key(tenant, "active"),
            sub.job_id,
            str(_score(record)),
            str(oldest),
            str(limit),
        )
        if int(got) < 0:
            raise tenancy.quota_refused_jobs(-int(got), limit, settings)
        reserved = True
        # stored before any worker can see the job; a put also refreshes an existing object's
        # mtime, which keeps retention off it until the record below names it
        await anyio.to_thread.run_sync(store.put_bytes, module_bytes)
        # record + RQ job in one MULTI/EXEC on the event loop: RQ's commands, recorded, so no
        # thread runs RQ's Python next to the loop
        commands = enqueue_commands(queue, settings, sub, record)
        async with redis.pipeline(transaction=True) as pipe:
            for args, options in commands:
                pipe.execute_command(*args, **options)
            pipe.zadd(tenancy.tenant_key(tenant, "jobs"), {sub.job_id: _score(record)})
            metrics.count_submitted(pipe, "queued")
            await pipe.execute()
    except BaseException:
        async with redis.pipeline(transaction=False) as pipe:
            if idem_key:
                pipe.delete(idem_key)
            if reserved:
                tenancy.release_active(pipe, tenant, sub.job_id)
            await pipe.execute()
        raise
    return record, False


def _score(record: dict[str, str]) -> int:
    """A record's place in its tenant's job list: its creation time, microseconds."""
    created = datetime.fromisoformat(record["created_at"])
    return int(created.timestamp() * 1_000_000)


def _sizes(store: Store, *shas: str | None) -> int:
    """Bytes of the stored objects named (a missing one counts 0)."""
    total = 0
    for sha in shas:
        if sha:
            try:
                total += store.size(sha)
            except (OSError, ValueError):
                continue
    return total


async def _await_record(redis: AsyncRedis, job_id: str) -> dict[str, str] | None:
    """A record another request is creating right now (same Idempotency-Key) appears within
    one enqueue; wait briefly for it rather than answer 404."""
    import asyncio

    for _ in range(50):
        raw = await redis.hgetall(record_key(job_id))
        if raw:
            return decode(raw)
        await asyncio.sleep(0.05)
    return None


# --- state changes after creation (worker side) ------------------------------------------------
#: HSET the given fields unless the job already finished. KEYS[1]=record; ARGV=ttl, k1, v1, ...
#: Returns 1 when written, 0 when the job is finished or its record is gone.
_SET_UNLESS_TERMINAL = """
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or status == 'succeeded' or status == 'failed' or status == 'cancelled' then
  return 0
end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

#: Start an attempt: status=running, attempts+1. Returns the attempt number, or 0 if finished.
_START = """
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or status == 'succeeded' or status == 'failed' or status == 'cancelled' then
  return 0
end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return n
"""


@dataclass(frozen=True)
class AttemptCause:
    """Why an attempt ended without the task recording an outcome (seen from outside it)."""

    reason: str  # "crashed" | "exited" | "lost" | "error"
    what: str  # "the compiler process died (signal 11, SIGSEGV)"
    extra: dict[str, Any]


class JobRecords:
    """State changes of job records, with a sync Redis connection (worker, CLI, tests)."""

    def __init__(self, conn: Redis, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self.ttl = record_ttl(settings)
        self._set = conn.register_script(_SET_UNLESS_TERMINAL)
        self._start = conn.register_script(_START)
        self._store: LocalStore | None = None

    def _stored_bytes(self, *shas: str | None) -> int:
        from service.storage import LocalStore

        if self._store is None:
            self._store = LocalStore.for_data_dir(
                self.settings.data_dir, fsync=self.settings.store_fsync
            )
        return _sizes(self._store, *shas)

    def _finished(self, pipe: Any, record: dict[str, str], fields: dict[str, str]) -> None:
        """Queue the tenant's bookkeeping of a job that just finished: its active slot given
        back, the bytes its objects hold counted."""
        tenant = record_tenant(record)
        done = {**record, **fields}
        size = self._stored_bytes(*(done.get(f) for f in OBJECT_FIELDS))
        tenancy.release_active(pipe, tenant, record["id"])
        tenancy.account_stored(pipe, tenant, record["id"], size)

    def get(self, job_id: str) -> dict[str, str] | None:
        raw = self.conn.hgetall(record_key(job_id))
        return decode(raw) if raw else None

    def _update(self, job_id: str, fields: dict[str, str]) -> bool:
        fields = {**fields, "updated_at": now_iso()}
        argv: list[str | int] = [self.ttl]
        for k, v in fields.items():
            argv += [k, v]
        return bool(self._set(keys=[record_key(job_id)], args=argv))

    def start(self, job_id: str, *, worker: str, pid: int, worker_pid: int) -> int:
        """Mark an attempt started; its number, or 0 when the job already finished."""
        ts = now_iso()
        argv: list[str | int] = [self.ttl]
        for k, v in {
            "status": "running",
            "stage": "starting",
            "detail": "",
            "progress": "0",
            "started_at": ts,
            "updated_at": ts,
            "worker": worker,
            "pid": str(pid),
            "worker_pid": str(worker_pid),
        }.items():
            argv += [k, v]
        return int(self._start(keys=[record_key(job_id)], args=argv))

    def progress(self, job_id: str, stage: str, fraction: float, detail: str) -> bool:
        """False when the job finished meanwhile (e.g. it was cancelled)."""
        return self._update(
            job_id,
            {"stage": stage, "progress": f"{max(0.0, min(1.0, fraction)):.4f}", "detail": detail},
        )

    def succeed(self, job_id: str, *, artifact_sha256: str, report_sha256: str) -> bool:
        """Record success and publish the result in the compile cache."""
        record = self.get(job_id)
        if record is None:
            return False
        fields = {
            "status": "succeeded",
            "stage": "done",
            "detail": "",
            "progress": "1",
            "finished_at": now_iso(),
            "artifact_sha256": artifact_sha256,
            "report_sha256": report_sha256,
        }
        written = self._update(job_id, fields)
        if written:
            entry = cache_entry({**record, **fields})
            started = _ts(record.get("started_at"))
            seconds = (datetime.now(UTC) - started).total_seconds() if started else None
            with self.conn.pipeline(transaction=False) as pipe:
                key = cache_index_key(record["cache_key"])
                pipe.set(key, json.dumps(entry), ex=self.settings.result_ttl_s)
                metrics.count_finished(pipe, "succeeded", seconds)
                self._finished(pipe, record, fields)
                pipe.execute()
        return written

    def fail(
        self,
        job_id: str,
        error: StackfuseError | dict[str, Any],
        *,
        report_sha256: str | None = None,
    ) -> bool:
        err = error.to_dict() if isinstance(error, StackfuseError) else error
        fields = {
            "status": "failed",
            "stage": "failed",
            "finished_at": now_iso(),
            "error": json.dumps(err),
        }
        if report_sha256:
            fields["report_sha256"] = report_sha256
        written = self._update(job_id, fields)
        if written:
            record = self.get(job_id)
            with self.conn.pipeline(transaction=False) as pipe:
                metrics.count_finished(pipe, "failed")
                if record is not None:
                    self._finished(pipe, record, fields)
                pipe.execute()
        return written

    def note_error(self, job_id: str, error: StackfuseError) -> None:
        """Remember a retryable error raised by the task, for the retry/give-up message."""
        self._update(job_id, {"last_error": json.dumps(error.to_dict())})

    def attempt_ended(self, job_id: str, cause: AttemptCause, *, will_retry: bool) -> None:
        """An attempt ended without an outcome (crash, lost worker, retryable error): mark the
        job queued again, or failed with a message saying what happened how often."""
        record = self.get(job_id)
        if record is None or record["status"] in TERMINAL:
            return
        attempts = max(1, int(record.get("attempts", "0")))
        noted = _json_field(record, "last_error") if cause.reason == "error" else None
        # Keep the type of a noted error (e.g. toolchain-error); otherwise infrastructure-error.
        kind: dict[str, Any] = noted or InfrastructureError(cause.what).to_dict()
        what = kind["message"]
        base = {**kind, "reason": cause.reason, "attempts": attempts, **cause.extra}
        if will_retry:
            err = {**base, "message": f"{what} on attempt {attempts}; retrying"}
            self._update(
                job_id,
                {
                    "status": "queued",
                    "stage": "queued",
                    "detail": f"retry after attempt {attempts}",
                    "progress": "0",
                    "last_error": json.dumps(err),
                },
            )
        else:
            times = "once" if attempts == 1 else f"{attempts} times"
            self.fail(job_id, {**base, "message": f"{what} {times}; giving up"})


# --- the caller's own jobs: list and cancel (API side) -----------------------------------------
#: Mark a job cancelled unless it finished. KEYS[1]=record; ARGV=ttl, k1, v1, ...
#: Returns the status it had ('' when the record is gone); it is cancelled only when that was
#: queued or running.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if status == 'succeeded' or status == 'failed' or status == 'cancelled' then return status end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return status
"""


async def cancel(
    redis: AsyncRedis, settings: Settings, store: Store, record: dict[str, str]
) -> dict[str, str]:
    """Cancel a queued or running job: its record says ``cancelled`` from now on (a worker
    that starts or finishes it later changes nothing), its tenant gets the slot back. Stopping
    the RQ side is :func:`stop_rq_job`'s (sync RQ, in a thread). AlreadyFinished otherwise."""
    job_id = record["id"]
    ts = now_iso()
    fields = {
        "status": "cancelled",
        "stage": "cancelled",
        "detail": "cancelled by the client",
        "finished_at": ts,
        "updated_at": ts,
    }
    argv: list[str | int] = [record_ttl(settings)]
    for k, v in fields.items():
        argv += [k, v]
    before = str(await redis.eval(_CANCEL, 1, record_key(job_id), *argv))
    if before not in ("queued", "running"):
        raise AlreadyFinished(
            f"job {job_id} already {before or 'expired'}; only a queued or running job can be "
            "cancelled",
            status_of_job=before or None,
        )
    tenant = record_tenant(record)
    size = _sizes(store, record.get("input_sha256"), record.get("report_sha256"))
    async with redis.pipeline(transaction=False) as pipe:
        tenancy.release_active(pipe, tenant, job_id)
        tenancy.account_stored(pipe, tenant, job_id, size)
        metrics.count_finished(pipe, "cancelled")
        pipe.hgetall(record_key(job_id))
        *_, raw = await pipe.execute()
    return decode(raw) if raw else {**record, **fields}


def stop_rq_job(conn: Redis, settings: Settings, job_id: str) -> str:
    """The RQ side of a cancel: a job still waiting (queued, or scheduled for a retry) is
    cancelled in RQ, which takes it off the queue; one a worker runs has its work-horse
    stopped (RQ's stop-job command: the worker kills the horse and does not retry it). What
    was done: ``cancelled``, ``stopped`` or ``none`` (RQ no longer has the job)."""
    from rq.command import send_stop_job_command
    from rq.exceptions import InvalidJobOperation, NoSuchJobError
    from rq.job import Job, JobStatus
    from rq.serializers import JSONSerializer

    try:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        status = job.get_status(refresh=False)
        if status in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
            job.cancel()
            return "cancelled"
        if status == JobStatus.STARTED and job.worker_name:
            send_stop_job_command(conn, job_id, serializer=JSONSerializer)
            return "stopped"
    except (NoSuchJobError, InvalidJobOperation):
        pass
    # a horse that started meanwhile sees the record cancelled at its next progress report
    return "none"


#: GET /jobs page sizes.
LIST_DEFAULT, LIST_MAX = 50, 200


def _cursor(score: float, job_id: str) -> str:
    return base64.urlsafe_b64encode(f"{int(score)}:{job_id}".encode()).decode().rstrip("=")


def _parse_cursor(cursor: str) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        score, _, job_id = raw.partition(":")
        if score.isdigit() and is_job_id(job_id):
            return int(score), job_id
    except (ValueError, binascii.Error):
        pass
    raise InvalidRequest(
        "cursor is not one this API gave out: pass next_cursor of the previous page as it came",
        errors=[{"loc": ["query", "cursor"], "msg": "invalid cursor"}],
    )


async def list_jobs(
    redis: AsyncRedis, tenant: str, limit: int, cursor: str | None
) -> tuple[list[dict[str, str]], str | None]:
    """One page of ``tenant``'s jobs, newest first: ``(records, next cursor or None)``.

    The cursor is the last listed job's (creation time, id), so jobs submitted while paging
    do not shift later pages. Entries whose record expired are skipped (and dropped)."""
    key = tenancy.tenant_key(tenant, "jobs")
    after = _parse_cursor(cursor) if cursor else None
    top: float | str = after[0] if after else "+inf"
    page: list[tuple[float, dict[str, str]]] = []
    offset = 0
    batch = limit + 1
    while len(page) <= limit:
        rows: list[Any] = await redis.zrange(
            key, top, "-inf", desc=True, byscore=True, offset=offset, num=batch, withscores=True
        )
        if not rows:
            break
        offset += len(rows)
        # same creation time: members come in descending id order; skip up to the cursor's
        members = [
            (str(m), float(sc))
            for m, sc in rows
            if not (after and int(sc) == after[0] and str(m) >= after[1])
        ]
        async with redis.pipeline(transaction=False) as pipe:
            for m, _ in members:
                pipe.hgetall(record_key(m))
            raws = await pipe.execute()
        gone = []
        for (m, sc), raw in zip(members, raws, strict=True):
            if raw:
                page.append((sc, decode(raw)))
            else:
                gone.append(m)
        if gone:
            await redis.zrem(key, *gone)
        if len(rows) < batch:
            break
    more = len(page) > limit
    page = page[:limit]
    next_cursor = _cursor(page[-1][0], page[-1][1]["id"]) if more and page else None
    return [r for _, r in page], next_cursor
