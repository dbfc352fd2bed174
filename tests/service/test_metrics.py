"""GET /metrics (issue #33): what the API process shows includes what the worker processes
counted (through Redis), read with prometheus-client's own parser. Real redis-server, workers
and API; tests/service/reshape.py's modules."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import WorkerPool, wait_job
from tests.service.reshape import fresh_reshape


def submit(client: httpx.Client, module: str) -> str:
    r = client.post("/optimize", json={"module": module})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(client: httpx.Client) -> Samples:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_jobs_across_the_api_and_the_workers(
    client: httpx.Client, workers: WorkerPool
) -> None:
    before = scrape(client)
    for state in ("queued", "running", "retry_scheduled"):
        assert ("stackfuse_jobs", (("state", state),)) in before
    assert ("stackfuse_queue_depth", ()) in before

    module = fresh_reshape()
    job_id = submit(client, module)
    assert wait_job(client, job_id, timeout=180)["status"] == "succeeded"
    cached = submit(client, module)  # same bytes: a cache hit, finished at once
    assert client.get(f"/jobs/{cached}").json()["cached"] is True

    after = scrape(client)
    # counted by the worker (another process), shown by the API
    assert value(after, "stackfuse_jobs_finished_total", status="succeeded") == (
        value(before, "stackfuse_jobs_finished_total", status="succeeded") + 1
    )
    count = value(after, "stackfuse_compile_seconds_count")
    assert count == value(before, "stackfuse_compile_seconds_count") + 1
    assert value(after, "stackfuse_compile_seconds_bucket", le="+Inf") == count
    assert value(after, "stackfuse_compile_seconds_sum") > value(
        before, "stackfuse_compile_seconds_sum"
    )
    # each stage of the report's timings, once per successful compile
    for stage in ("ingest", "partition", "build"):
        n = value(after, "stackfuse_stage_seconds_count", stage=stage)
        assert n == value(before, "stackfuse_stage_seconds_count", stage=stage) + 1, stage
        assert value(after, "stackfuse_stage_seconds_bucket", stage=stage, le="+Inf") == n
    # counted by the API
    for outcome in ("queued", "cached"):
        assert value(after, "stackfuse_jobs_submitted_total", outcome=outcome) == (
            value(before, "stackfuse_jobs_submitted_total", outcome=outcome) + 1
        )
