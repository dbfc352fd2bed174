"""Structured logs (issue #33): STACKFUSE_LOG_FORMAT=json makes every line a worker writes,
ours and RQ's, one JSON object, and the lines logged during a job name it. A real worker
process, against a real redis-server, with a job whose module is missing from the store."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from redis import Redis

from service import jobs, logs
from service.schemas import OptimizeRequest
from service.settings import Settings
from service.spec import Target, toolchain_fingerprint
from service.storage import LocalStore
from tests.conftest import RedisServer


def test_json_lines_carry_the_job_id_and_extras() -> None:
    record = logging.LogRecord("stackfuse.worker", logging.INFO, __file__, 1, "hi %s", ("x",), None)
    record.artifact_sha256 = "ab" * 32
    with logs.job_scope("job-1"):
        doc = json.loads(logs.JsonFormatter().format(record))
    assert doc["message"] == "hi x" and doc["level"] == "info" and doc["job_id"] == "job-1"
    assert doc["artifact_sha256"] == "ab" * 32
    outside = json.loads(logs.JsonFormatter().format(record))
    assert "job_id" not in outside


def test_a_json_worker_logs_json_lines_naming_its_job(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    url = f"{redis_server.url.rsplit('/', 1)[0]}/13"
    conn = Redis.from_url(url)
    conn.flushdb()
    env = {
        **os.environ,
        "STACKFUSE_REDIS_URL": url,
        "STACKFUSE_DATA_DIR": str(tmp_path),
        "STACKFUSE_QUEUE_NAME": "logs-test",
        "STACKFUSE_LOG_FORMAT": "json",
    }
    settings = Settings(redis_url=url, data_dir=tmp_path, queue_name="logs-test")
    module = b'{"not": "a module"}'  # ingest refuses it: a failed job, no compile
    request = OptimizeRequest(module=module.decode(), target=Target(arch="sm_90"))
    sub = jobs.prepare(request, module, toolchain_fingerprint())
    LocalStore.for_data_dir(tmp_path, fsync=False).put_bytes(module)
    with conn.pipeline(transaction=True) as pipe:
        jobs.write_record(pipe, sub.job_id, jobs.new_record(sub), jobs.record_ttl(settings))
        pipe.execute()
    jobs.make_queue(conn, settings).enqueue_call(
        "worker.tasks.compile_job",
        args=(sub.job_id, sub.input_sha256, sub.spec()),
        job_id=sub.job_id,
    )
    run = subprocess.run(
        [sys.executable, "-m", "service.cli", "worker", "--burst"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.strip()]
    assert lines, run
    docs = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert {"time", "level", "logger", "message"} <= set(docs[0])
    assert any(d["logger"].startswith("rq.") for d in docs)  # RQ's lines too
    assert any(d.get("job_id") == sub.job_id for d in docs), lines
