"""Prometheus metrics, counted in one Redis hash so that every process adds to the same numbers.

The API and the workers are separate processes, often on separate hosts, and share only Redis.
prometheus-client's own multiprocess mode shares a directory of mmap files between processes of
one host, so it cannot add a worker's counts to the API's. Counters and the compile-time
histogram therefore live in the hash :data:`METRICS_KEY` (HINCRBY / HINCRBYFLOAT, queued on the
caller's pipeline, so a count is written with the state change it counts); gauges are read from
RQ's own keys at scrape time. ``GET /metrics`` (the API) reads both in one round trip and renders
them with prometheus-client's exposition format.

No FastAPI or prometheus-client at import: the worker imports this module through
:mod:`service.jobs`. :func:`make_router` builds the route for the app (no ``from __future__
import annotations`` here: FastAPI reads the route's annotations, which are local names).
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.settings import Settings

if TYPE_CHECKING:
    from fastapi import APIRouter
    from redis.asyncio import Redis as AsyncRedis

#: The hash every process counts in (field ``name|label=value,...``); never expires.
METRICS_KEY = "stackfuse:metrics"
#: Upper bounds of the compile-time histogram, seconds: a cached glue build takes seconds, a
#: cold Hopper configuration 45-95 s, and a job's limit is ``job_timeout_s`` (1800 s).
COMPILE_SECONDS_BUCKETS: tuple[float, ...] = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800)
#: RQ's keys of one queue, read at scrape time: (state, Redis type, key template).
_RQ_GAUGES = (
    ("queued", "list", "rq:queue:{}"),
    ("running", "zset", "rq:wip:{}"),
    ("retry_scheduled", "zset", "rq:scheduled:{}"),
)
_FINISHED = "jobs_finished_total"
_SUBMITTED = "jobs_submitted_total"
_COMPILE = "compile_seconds"
_STAGE = "stage_seconds"
#: Upper bounds of the stage-duration histogram, seconds: ingest and partition take well under a
#: second, codegen with cached configurations seconds, a cold configuration 45-95 s.
STAGE_SECONDS_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_GC_DELETED = "gc_deleted_total"
_GC_BYTES = "gc_deleted_bytes_total"


def _field(name: str, **labels: str) -> str:
    return name + "|" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _parse_field(field: str) -> tuple[str, dict[str, str]]:
    name, _, rest = field.partition("|")
    labels = dict(item.split("=", 1) for item in rest.split(",") if "=" in item)
    return name, labels


# --- counting (queued on a sync or asyncio pipeline, run by the caller) -------------------------
def count_submitted(pipe: Any, outcome: str) -> None:
    """A POST /optimize that made a job: ``queued`` (a compile) or ``cached`` (a cache hit)."""
    pipe.hincrby(METRICS_KEY, _field(_SUBMITTED, outcome=outcome), 1)


def count_finished(pipe: Any, status: str, compile_seconds: float | None = None) -> None:
    """A job reached ``status`` (succeeded/failed); a success also observes its compile time."""
    pipe.hincrby(METRICS_KEY, _field(_FINISHED, status=status), 1)
    if compile_seconds is not None:
        seconds = max(0.0, compile_seconds)
        bound = next((b for b in COMPILE_SECONDS_BUCKETS if seconds <= b), math.inf)
        pipe.hincrby(METRICS_KEY, _field(_COMPILE + "_bucket", le=_le(bound)), 1)
        pipe.hincrbyfloat(METRICS_KEY, _field(_COMPILE + "_sum"), seconds)
        pipe.hincrby(METRICS_KEY, _field(_COMPILE + "_count"), 1)


def count_stages(pipe: Any, timings: dict[str, float]) -> None:
    """One successful compile's stage durations (the report's ``timings``: ``ingest_s``,
    ``partition_s``, ``codegen_s``, ``build_s``, ...), each into its ``stage`` histogram."""
    for key, value in timings.items():
        if not key.endswith("_s") or not isinstance(value, int | float):
            continue
        stage, seconds = key.removesuffix("_s"), max(0.0, float(value))
        bound = next((b for b in STAGE_SECONDS_BUCKETS if seconds <= b), math.inf)
        pipe.hincrby(METRICS_KEY, _field(_STAGE + "_bucket", stage=stage, le=_le(bound)), 1)
        pipe.hincrbyfloat(METRICS_KEY, _field(_STAGE + "_sum", stage=stage), seconds)
        pipe.hincrby(METRICS_KEY, _field(_STAGE + "_count", stage=stage), 1)


def count_gc(pipe: Any, kind: str, deleted: int, size: int) -> None:
    """What one garbage collection deleted, by kind (object, kernel, work_dir, temporary)."""
    if deleted:
        pipe.hincrby(METRICS_KEY, _field(_GC_DELETED, kind=kind), deleted)
        pipe.hincrby(METRICS_KEY, _field(_GC_BYTES, kind=kind), size)


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


# --- reading ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """The counters hash and the RQ gauges, as read in one round trip."""

    counters: dict[str, float]
    gauges: dict[str, int]


async def read(redis: "AsyncRedis", settings: Settings) -> Snapshot:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(METRICS_KEY)
        for _, kind, template in _RQ_GAUGES:
            key = template.format(settings.queue_name)
            pipe.llen(key) if kind == "list" else pipe.zcard(key)
        raw_counters, *sizes = await pipe.execute()
    counters = {_text(k): float(_text(v)) for k, v in raw_counters.items()}
    gauges = {state: int(n) for (state, _, _), n in zip(_RQ_GAUGES, sizes, strict=True)}
    return Snapshot(counters, gauges)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def render(snapshot: Snapshot) -> tuple[bytes, str]:
    """(body, content type) in the Prometheus text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Collector:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        gauges = self.snapshot.gauges
        jobs = GaugeMetricFamily(
            "stackfuse_jobs",
            "Jobs in RQ by state: queued (waiting for a worker), running, retry_scheduled "
            "(waiting out a retry interval); includes gc jobs",
            labels=["state"],
        )
        for state, n in gauges.items():
            jobs.add_metric([state], n)
        yield jobs
        yield GaugeMetricFamily(
            "stackfuse_queue_depth", "Jobs waiting in the queue", value=gauges["queued"]
        )

        by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for field, value in self.snapshot.counters.items():
            name, labels = _parse_field(field)
            by_name.setdefault(name, []).append((labels, value))
        for name, label, doc in (
            (_FINISHED, "status", "Jobs that finished, by status"),
            (_SUBMITTED, "outcome", "Submissions that made a job: queued, or a cache hit"),
            (_GC_DELETED, "kind", "What garbage collection deleted, by kind"),
            (_GC_BYTES, "kind", "Bytes garbage collection freed, by kind"),
        ):
            family = CounterMetricFamily(
                f"stackfuse_{name.removesuffix('_total')}", doc, labels=[label]
            )
            for labels, value in by_name.get(name, []):
                family.add_metric([labels.get(label, "")], value)
            yield family

        buckets = {labels.get("le"): v for labels, v in by_name.get(_COMPILE + "_bucket", [])}
        cumulative, out = 0.0, []
        for bound in (*COMPILE_SECONDS_BUCKETS, math.inf):
            cumulative += buckets.get(_le(bound), 0.0)
            out.append((_le(bound), cumulative))
        total = sum(v for _, v in by_name.get(_COMPILE + "_sum", []))
        yield HistogramMetricFamily(
            "stackfuse_compile_seconds",
            "Wall time of successful compile attempts, seconds",
            buckets=out,
            sum_value=total,
        )

        stages = HistogramMetricFamily(
            "stackfuse_stage_seconds",
            "Wall time of each stage of successful compiles (the report's timings), seconds",
            labels=["stage"],
        )
        per_stage: dict[str, dict[str, float]] = {}
        for labels, value in by_name.get(_STAGE + "_bucket", []):
            per_stage.setdefault(labels.get("stage", ""), {})[labels.get("le", "")] = value
        sums = {labels.get("stage", ""): v for labels, v in by_name.get(_STAGE + "_sum", [])}
        for stage in sorted(per_stage):
            cumulative, cells = 0.0, []
            for bound in (*STAGE_SECONDS_BUCKETS, math.inf):
                cumulative += per_stage[stage].get(_le(bound), 0.0)
                cells.append((_le(bound), cumulative))
            stages.add_metric([stage], cells, sum_value=sums.get(stage, 0.0))
        yield stages


def make_router() -> "APIRouter":
    """``GET /metrics``; the app includes it (FastAPI imported here, not at module import)."""
    from fastapi import APIRouter, Request
    from fastapi.responses import Response

    from service.problems import openapi_problems as problem_responses

    router = APIRouter()

    @router.get(
        "/metrics",
        summary="Prometheus metrics (jobs by state, queue depth, compile and stage seconds, gc)",
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {}}, "description": "text format 0.0.4"},
            **problem_responses(401, 403, 503),
        },
    )
    async def metrics(request: Request) -> Response:
        """Admin key required while keys are configured, unless STACKFUSE_METRICS_PUBLIC=1."""
        state = request.app.state.stackfuse
        if not state.settings.metrics_public:
            await state.auth.admin(request.headers.get("authorization"))
        body, content_type = render(await read(state.redis, state.settings))
        return Response(body, media_type=content_type)

    return router
