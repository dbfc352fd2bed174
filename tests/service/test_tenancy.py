"""API keys and tenants (issue #33 item 1) against a real redis-server and a real API process.

The keyed API uses Redis database 1 of the session's server, so that the keys made here never
turn on authentication for the open-mode tests sharing database 0. No worker serves its
queue: jobs stay queued, which is what the quota, list and cancel tests need.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ApiProcess, RedisServer
from tests.service.test_api import assert_problem
from tests.service.test_cli import stackfuse


@pytest.fixture(scope="module")
def keyed_env(service_env: dict[str, str], redis_server: RedisServer) -> dict[str, str]:
    return {
        **service_env,
        "STACKFUSE_REDIS_URL": f"redis://127.0.0.1:{redis_server.port}/1",
        "STACKFUSE_QUEUE_NAME": "tenancy",
        "STACKFUSE_AUTH_CACHE_TTL_S": "0",
        "STACKFUSE_TENANT_MAX_ACTIVE_JOBS": "3",
    }


def make_key(env: dict[str, str], tenant: str, *extra: str) -> dict[str, Any]:
    out = stackfuse("keys", "create", "--tenant", tenant, "--json", *extra, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def keys(keyed_env: dict[str, str]) -> Iterator[dict[str, Any]]:
    made = {
        "a": make_key(keyed_env, "tenant-a"),
        "b": make_key(keyed_env, "tenant-b"),
        "admin": make_key(keyed_env, "ops", "--admin"),
    }
    yield made


@pytest.fixture(scope="module")
def keyed_api(
    start_api: Callable[..., ApiProcess], keyed_env: dict[str, str], keys: dict[str, Any]
) -> ApiProcess:
    overrides = {k: v for k, v in keyed_env.items() if k.startswith("STACKFUSE_")}
    return start_api(**overrides)


def as_(api: ApiProcess, key: dict[str, Any]) -> httpx.Client:
    return httpx.Client(
        base_url=api.url, timeout=30, headers={"Authorization": f"Bearer {key['key']}"}
    )


_n = iter(range(1, 1_000_000))


def submit(c: httpx.Client, module_json: str, **headers: str) -> httpx.Response:
    return c.post("/optimize", json={"module": module_json + " " * next(_n)}, headers=headers)


def test_keys_are_listed_without_secrets_and_stored_hashed(
    keyed_env: dict[str, str], keys: dict[str, Any], redis_server: RedisServer
) -> None:
    out = stackfuse("keys", "list", "--json", env=keyed_env, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = {k["key_id"]: k for k in json.loads(out.stdout)}
    assert listed[keys["a"]["key_id"]]["tenant"] == "tenant-a"
    assert listed[keys["admin"]["key_id"]]["admin"] is True
    for k in keys.values():
        assert k["key"].startswith("sf_") and k["key"] not in out.stdout
    r = redis_server.client()
    r.execute_command("SELECT", 1)
    dump = b" ".join(v for key in r.keys("*") if r.type(key) == b"hash" for v in r.hvals(key))
    assert all(k["key"].encode() not in dump for k in keys.values())


def test_missing_bad_and_revoked_keys_are_401_problems(
    keyed_api: ApiProcess, keyed_env: dict[str, str]
) -> None:
    with httpx.Client(base_url=keyed_api.url, timeout=30) as c:
        r = c.get("/jobs")
        assert_problem(r, 401, "unauthorized")
        assert r.headers["www-authenticate"].startswith("Bearer")
        r = c.get("/jobs", headers={"Authorization": "Bearer sf_nope"})
        assert_problem(r, 401, "unauthorized")
        assert 'error="invalid_token"' in r.headers["www-authenticate"]
        assert_problem(c.get("/jobs", headers={"Authorization": "Basic eDp5"}), 401, "unauthorized")
        assert c.get("/healthz").status_code == 200
    doomed = make_key(keyed_env, "tenant-c")
    with as_(keyed_api, doomed) as c:
        assert c.get("/jobs").status_code == 200
        out = stackfuse("keys", "revoke", doomed["key_id"], env=keyed_env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert_problem(c.get("/jobs"), 401, "unauthorized")
    bad = stackfuse("keys", "revoke", "key_0000000000000000", env=keyed_env, timeout=60)
    assert bad.returncode == 2


def test_another_tenants_job_is_a_404_on_every_route(
    keyed_api: ApiProcess, keys: dict[str, Any], module_json: str
) -> None:
    with as_(keyed_api, keys["a"]) as a, as_(keyed_api, keys["b"]) as b:
        r = submit(a, module_json)
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        assert a.get(f"/jobs/{job_id}").status_code == 200
        unknown = "0" * 32
        for path in (f"/jobs/{job_id}", f"/jobs/{job_id}/artifact", f"/jobs/{job_id}/report"):
            theirs = assert_problem(b.get(path), 404, "not-found")
            assert theirs["detail"] == assert_problem(
                b.get(path.replace(job_id, unknown)), 404, "not-found"
            )["detail"].replace(unknown, job_id)
        assert_problem(b.delete(f"/jobs/{job_id}"), 404, "not-found")
        assert job_id not in {j["id"] for j in b.get("/jobs").json()["jobs"]}
        assert a.delete(f"/jobs/{job_id}").status_code == 202


def test_idempotency_keys_are_per_tenant(
    keyed_api: ApiProcess, keys: dict[str, Any], module_json: str
) -> None:
    with as_(keyed_api, keys["a"]) as a, as_(keyed_api, keys["b"]) as b:
        first = submit(a, module_json, **{"Idempotency-Key": "shared-key"})
        assert first.status_code == 202
        other = submit(b, module_json, **{"Idempotency-Key": "shared-key"})
        assert other.status_code == 202, other.text  # no conflict, no job id of tenant a
        assert other.json()["id"] != first.json()["id"]
        assert "idempotent-replayed" not in other.headers
        for c, r in ((a, first), (b, other)):
            assert c.delete(f"/jobs/{r.json()['id']}").status_code == 202


def test_active_job_quota_is_a_429_with_retry_after_and_cancel_frees_it(
    keyed_api: ApiProcess, keyed_env: dict[str, str], module_json: str
) -> None:
    key = make_key(keyed_env, "quota-t")
    with as_(keyed_api, key) as c:
        ids = [submit(c, module_json).json()["id"] for _ in range(3)]
        refused = submit(c, module_json)
        problem = assert_problem(refused, 429, "quota-exceeded")
        assert problem["quota"] == "active_jobs" and problem["limit"] == 3
        assert int(refused.headers["retry-after"]) > 0
        cancelled = c.delete(f"/jobs/{ids[0]}")
        assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
        assert_problem(c.delete(f"/jobs/{ids[0]}"), 409, "job-finished")
        assert submit(c, module_json).status_code == 202


def test_cancel_of_a_queued_job_takes_it_off_the_queue(
    keyed_api: ApiProcess, keyed_env: dict[str, str], module_json: str, redis_server: RedisServer
) -> None:
    key = make_key(keyed_env, "cancel-t")
    r = redis_server.client()
    r.execute_command("SELECT", 1)
    with as_(keyed_api, key) as c:
        job_id = submit(c, module_json).json()["id"]
        assert job_id.encode() in r.lrange("rq:queue:tenancy", 0, -1)
        done = c.delete(f"/jobs/{job_id}").json()
        assert done["status"] == "cancelled" and done["finished_at"]
        assert job_id.encode() not in r.lrange("rq:queue:tenancy", 0, -1)
        assert c.get(f"/jobs/{job_id}").json()["status"] == "cancelled"
        assert_problem(c.get(f"/jobs/{job_id}/artifact"), 409, "not-ready")


def test_list_is_the_callers_own_newest_first_and_pages(
    keyed_api: ApiProcess, keyed_env: dict[str, str], module_json: str
) -> None:
    key = make_key(keyed_env, "list-t")
    with as_(keyed_api, key) as c:
        made = []
        for _ in range(5):
            job = submit(c, module_json).json()
            made.append(job["id"])
            c.delete(f"/jobs/{job['id']}")  # stays under the quota of 3
        seen, cursor = [], None
        while True:
            params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            page = c.get("/jobs", params=params).json()
            assert len(page["jobs"]) <= 2
            seen += [j["id"] for j in page["jobs"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == list(reversed(made))
        assert_problem(c.get("/jobs", params={"cursor": "garbage"}), 422, "invalid-request")
        assert_problem(c.get("/jobs", params={"limit": 201}), 422, "invalid-request")


def test_metrics_need_an_admin_key(keyed_api: ApiProcess, keys: dict[str, Any]) -> None:
    with httpx.Client(base_url=keyed_api.url, timeout=30) as c:
        assert_problem(c.get("/metrics"), 401, "unauthorized")
    with as_(keyed_api, keys["a"]) as c:
        assert_problem(c.get("/metrics"), 403, "forbidden")
    with as_(keyed_api, keys["admin"]) as c:
        assert c.get("/metrics").status_code == 200


@pytest.mark.slow
def test_cancel_of_a_running_job_stops_its_work_horse(
    start_api: Callable[..., ApiProcess],
    keyed_env: dict[str, str],
    fault_plan_file: Any,
    redis_server: RedisServer,
    tmp_path: Any,
) -> None:
    """A real worker; the job stalls mid-compile (fault injection) until cancelled."""
    import hashlib

    from tests.conftest import WorkerPool, add_fault, pid_alive, wait_for
    from tests.service.reshape import fresh_reshape

    env = {**keyed_env, "STACKFUSE_QUEUE_NAME": "tenancy-run"}
    api = start_api(**{k: v for k, v in env.items() if k.startswith("STACKFUSE_")})
    pool = WorkerPool(env, tmp_path, env["STACKFUSE_REDIS_URL"])
    key = make_key(env, "run-t")
    module = fresh_reshape()
    add_fault(fault_plan_file, hashlib.sha256(module.encode()).hexdigest(), sleep_s=120)
    r = redis_server.client()
    r.execute_command("SELECT", 1)
    try:
        pool.ensure(1)
        with as_(api, key) as c:
            job_id = c.post("/optimize", json={"module": module}).json()["id"]

            def stalled() -> dict[str, str] | None:
                rec = {
                    k.decode(): v.decode() for k, v in r.hgetall(f"stackfuse:job:{job_id}").items()
                }
                return (
                    rec
                    if rec.get("status") == "running" and rec.get("stage") == "normalize"
                    else None
                )

            horse = int(wait_for(stalled, 120, "the job to stall mid-compile")["pid"])
            done = c.delete(f"/jobs/{job_id}")
            assert done.status_code == 202 and done.json()["status"] == "cancelled"
            wait_for(lambda: not pid_alive(horse), 30, "the work-horse to be stopped")
            assert pool.workers[0].alive()  # the worker itself serves on
            time.sleep(2)
            job = c.get(f"/jobs/{job_id}").json()
            assert job["status"] == "cancelled" and job["attempts"] == 1  # not retried
    finally:
        pool.stop_all()


@pytest.mark.slow
def test_a_cache_hit_is_not_revealed_across_tenants(
    start_api: Callable[..., ApiProcess],
    keyed_env: dict[str, str],
    tmp_path: Any,
) -> None:
    """Tenant a's second submission is a cache hit; tenant b's identical one compiles."""
    from tests.conftest import WorkerPool, wait_job
    from tests.service.reshape import fresh_reshape

    env = {**keyed_env, "STACKFUSE_QUEUE_NAME": "tenancy-cache"}
    api = start_api(**{k: v for k, v in env.items() if k.startswith("STACKFUSE_")})
    pool = WorkerPool(env, tmp_path, env["STACKFUSE_REDIS_URL"])
    ka, kb = make_key(env, "cache-a"), make_key(env, "cache-b")
    module = fresh_reshape()
    try:
        pool.ensure(1)
        with as_(api, ka) as a, as_(api, kb) as b:
            first = a.post("/optimize", json={"module": module}).json()
            assert wait_job(a, first["id"], timeout=180)["status"] == "succeeded"
            again = a.post("/optimize", json={"module": module}).json()
            assert again["cached"] is True and again["status"] == "succeeded"
            other = b.post("/optimize", json={"module": module}).json()
            assert other["cached"] is False and other["status"] == "queued"
            done = wait_job(b, other["id"], timeout=180)
            assert done["status"] == "succeeded" and done["cached"] is False
    finally:
        pool.stop_all()


def test_stored_bytes_quota_is_a_429_with_retry_after(
    start_api: Callable[..., ApiProcess], keyed_env: dict[str, str], module_json: str
) -> None:
    """A cancelled job's stored module counts against its tenant's bytes; past the limit
    POST /optimize is refused, and another tenant is not."""
    over = {k: v for k, v in keyed_env.items() if k.startswith("STACKFUSE_")}
    api = start_api(**over, STACKFUSE_TENANT_MAX_STORED_BYTES="1")
    full, other = make_key(keyed_env, "bytes-t"), make_key(keyed_env, "bytes-u")
    with as_(api, full) as c, as_(api, other) as d:
        job_id = submit(c, module_json).json()["id"]
        assert c.delete(f"/jobs/{job_id}").status_code == 202
        refused = submit(c, module_json)
        problem = assert_problem(refused, 429, "quota-exceeded")
        assert problem["quota"] == "stored_bytes" and problem["stored"] > 1
        assert int(refused.headers["retry-after"]) > 0
        ok = submit(d, module_json)
        assert ok.status_code == 202
        d.delete(f"/jobs/{ok.json()['id']}")
