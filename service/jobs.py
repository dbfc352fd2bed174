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

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from service import metrics
from service.errors import IdempotencyConflict, InfrastructureError, StackfuseError
from service.schemas import TERMINAL, JobError, JobLinks, JobView, OptimizeRequest
from service.settings import Settings
from service.spec import CompileOptions, Target, cache_key

if TYPE_CHECKING:
    from redis import Redis
    from redis.asyncio import Redis as AsyncRedis
    from rq import Queue

    from service.storage import Store

PREFIX = "stackfuse"
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


def idempotency_key(client_key: str) -> str:
    """Hashed so that any client string maps to a short, safe Redis key."""
    return f"{PREFIX}:idem:{hashlib.sha256(client_key.encode()).hexdigest()}"


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
) -> tuple[dict[str, str], bool]:
    """Turn a validated submission into a job: ``(record, replayed)``.

    Same Idempotency-Key + same fingerprint -> the earlier job (replayed); a different
    fingerprint -> IdempotencyConflict. A compile-cache hit -> a job finished at once. Otherwise
    the module is stored (in a thread: write + fsync) and then the record + RQ job are created
    together. Only that last path writes the module, so a refused request, a replay or a cache
    hit leaves nothing in the store. Two round trips to Redis on the common path.
    """
    import anyio

    idem_key = idempotency_key(idempotency) if idempotency is not None else None
    async with redis.pipeline(transaction=False) as pipe:
        if idem_key:
            pipe.set(idem_key, idempotency_value(sub), nx=True, ex=settings.idempotency_ttl_s)
        pipe.get(cache_index_key(sub.cache_key))
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
            if record is not None:
                return record, True
        # the earlier job is gone (expired, or its enqueue failed): this request takes the key
        await redis.set(idem_key, idempotency_value(sub), ex=settings.idempotency_ttl_s)

    entry = parse_cache_entry(results[-1])
    # keep(): the objects are referenced again from now on, so retention spares them
    if entry and store.keep(entry["artifact_sha256"]) and store.keep(entry["report_sha256"]):
        record = new_record(sub, cached_from=entry)
        async with redis.pipeline(transaction=True) as pipe:
            write_record(pipe, sub.job_id, record, record_ttl(settings))
            metrics.count_submitted(pipe, "cached")
            await pipe.execute()
        return record, False

    record = new_record(sub)
    try:
        # stored before any worker can see the job; a put also refreshes an existing object's
        # mtime, which keeps retention off it until the record below names it
        await anyio.to_thread.run_sync(store.put_bytes, module_bytes)
        # record + RQ job in one MULTI/EXEC on the event loop: RQ's commands, recorded, so no
        # thread runs RQ's Python next to the loop
        commands = enqueue_commands(queue, settings, sub, record)
        async with redis.pipeline(transaction=True) as pipe:
            for args, options in commands:
                pipe.execute_command(*args, **options)
            metrics.count_submitted(pipe, "queued")
            await pipe.execute()
    except BaseException:
        if idem_key:
            await redis.delete(idem_key)
        raise
    return record, False


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
if (not status) or status == 'succeeded' or status == 'failed' then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

#: Start an attempt: status=running, attempts+1. Returns the attempt number, or 0 if finished.
_START = """
local status = redis.call('HGET', KEYS[1], 'status')
if (not status) or status == 'succeeded' or status == 'failed' then return 0 end
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

    def progress(self, job_id: str, stage: str, fraction: float, detail: str) -> None:
        self._update(
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
            with self.conn.pipeline(transaction=False) as pipe:
                metrics.count_finished(pipe, "failed")
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
