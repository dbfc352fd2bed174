"""A Redis restart (SIGKILL, AOF on) loses no queued job, and the API reconnects by itself."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.conftest import RedisServer, WorkerPool, wait_job

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]


def test_redis_killed_and_restarted_loses_no_queued_job(
    client: httpx.Client,
    worker_pool: WorkerPool,
    redis_server: RedisServer,
    fresh_module: Callable[[], str],
) -> None:
    worker_pool.stop_all()  # nothing consumes: the jobs stay queued across the restart
    ids = []
    for _ in range(3):
        r = client.post("/optimize", json={"module": fresh_module()})
        assert r.status_code == 202
        ids.append(r.json()["id"])
    queued = [x.decode() for x in redis_server.client().lrange("rq:queue:stackfuse", 0, -1)]
    assert set(ids) <= set(queued)

    redis_server.kill()  # no graceful shutdown, no final save
    redis_server.start()

    after = [x.decode() for x in redis_server.client().lrange("rq:queue:stackfuse", 0, -1)]
    assert set(ids) <= set(after)
    for job_id in ids:  # the API's pooled connections died with Redis; it reconnects
        r = client.get(f"/jobs/{job_id}")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "queued"

    worker_pool.ensure(2)
    for job_id in ids:
        assert wait_job(client, job_id, timeout=180)["status"] == "succeeded"
