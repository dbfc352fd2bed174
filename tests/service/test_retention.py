"""Retention (issue #33, item 7): what `stackfuse gc` and the workers' periodic gc job delete,
and what they must keep. Real redis-server, real workers, real compiles (of the modules of
tests/service/reshape.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from service import jobs, retention
from service.settings import Settings
from service.storage import LocalStore
from tests.conftest import (
    REPO,
    RedisServer,
    WorkerPool,
    WorkerProcess,
    add_fault,
    wait_for,
    wait_job,
)
from tests.service.reshape import fresh_reshape

DAY = 24 * 3600


@pytest.fixture
def new_module() -> Callable[[], str]:
    return fresh_reshape


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def submit(client: httpx.Client, module: str, **headers: str) -> str:
    r = client.post("/optimize", json={"module": module}, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def record(redis_server: RedisServer, job_id: str) -> dict[str, str]:
    return jobs.decode(redis_server.client().hgetall(jobs.record_key(job_id)))


def objects_of(rec: dict[str, str]) -> set[str]:
    return {rec[f] for f in jobs.OBJECT_FIELDS if rec.get(f)}


def store_of(env: dict[str, str]) -> LocalStore:
    return LocalStore.for_data_dir(Path(env["STACKFUSE_DATA_DIR"]))


def run_gc(
    env: dict[str, str], kernel_cache: Path, *args: str, min_age_s: int = 0
) -> subprocess.CompletedProcess[str]:
    """`stackfuse gc` in its own process, with the test's own kernel cache (the session's is
    shared with every compile) and nothing too young to collect unless ``min_age_s``."""
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "gc", *args],
        cwd=REPO,
        env={
            **env,
            "STACKFUSE_GC_MIN_AGE_S": str(min_age_s),
            "STACKFUSE_KERNEL_CACHE_DIR": str(kernel_cache),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def gc_json(env: dict[str, str], kernel_cache: Path) -> dict[str, Any]:
    return json.loads(run_gc(env, kernel_cache, "--json").stdout)  # type: ignore[no-any-return]


def expire(redis_server: RedisServer, *keys: str) -> None:
    """Let Redis expire the keys as their TTL would (1 ms instead of days)."""
    r = redis_server.client()
    for key in keys:
        r.pexpire(key, 1)
    wait_for(lambda: r.exists(*keys) == 0, 10, f"{keys} to expire")


# --- stored objects -----------------------------------------------------------------------------
def test_gc_deletes_the_objects_of_expired_jobs_and_keeps_those_of_live_ones(
    client: httpx.Client,
    workers: WorkerPool,
    redis_server: RedisServer,
    service_env: dict[str, str],
    new_module: Callable[[], str],
    tmp_path: Path,
) -> None:
    live_id, gone_id = submit(client, new_module()), submit(client, new_module())
    for job_id in (live_id, gone_id):
        assert wait_job(client, job_id, timeout=180)["status"] == "succeeded"
    live, gone = record(redis_server, live_id), record(redis_server, gone_id)
    store = store_of(service_env)
    assert all(store.exists(s) for s in objects_of(live) | objects_of(gone))

    # the record and its cache entry reach their TTL (result_ttl_s) together
    expire(redis_server, jobs.record_key(gone_id), jobs.cache_index_key(gone["cache_key"]))
    garbage = objects_of(gone) - objects_of(live)
    assert len(garbage) == 3  # module, library and report of its own

    result = gc_json(service_env, tmp_path / "kernels")
    assert result["objects"] >= 3
    assert {f"object {s}" for s in garbage} <= set(result["deleted"])
    assert not any(store.exists(s) for s in garbage)
    assert all(store.exists(s) for s in objects_of(live))
    r = client.get(f"/jobs/{live_id}/artifact")
    assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == live["artifact_sha256"]


def test_gc_spares_young_objects_and_a_dry_run_deletes_nothing(
    service_env: dict[str, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    store = store_of(service_env)
    young = store.put_bytes(f"unreferenced, just stored {uuid.uuid4()}".encode())
    old = store.put_bytes(f"unreferenced, stored long ago {uuid.uuid4()}".encode())
    path = store.local_path(old)
    assert path is not None
    os.utime(path, (time.time() - DAY, time.time() - DAY))

    dry = run_gc(service_env, tmp_path, "--dry-run", "--verbose", min_age_s=3600).stdout
    assert f"object {old}" in dry and "would delete" in dry
    assert f"object {young}" not in dry
    assert store.exists(old) and store.exists(young)

    run_gc(service_env, tmp_path, min_age_s=3600)
    assert not store.exists(old) and store.exists(young)


def test_a_refused_request_stores_no_module(
    client: httpx.Client,
    workers: WorkerPool,
    service_env: dict[str, str],
    new_module: Callable[[], str],
) -> None:
    store = store_of(service_env)
    key = f"retention-{uuid.uuid4()}"
    first, other = new_module(), new_module()
    job_id = submit(client, first, **{"Idempotency-Key": key})
    assert store.exists(sha(first))

    conflict = client.post("/optimize", json={"module": other}, headers={"Idempotency-Key": key})
    assert conflict.status_code == 422, conflict.text
    assert not store.exists(sha(other))

    invalid = json.dumps({"not": "a TVM module", "id": str(uuid.uuid4())})
    assert client.post("/optimize", json={"module": invalid}).status_code == 422
    assert not store.exists(sha(invalid))
    assert wait_job(client, job_id, timeout=180)["status"] == "succeeded"


# --- attempt directories ------------------------------------------------------------------------
def _wait_stalled(redis_server: RedisServer, job_id: str) -> dict[str, str]:
    return wait_for(  # type: ignore[no-any-return]
        lambda: (
            (rec := record(redis_server, job_id)).get("status") == "running"
            and rec.get("stage") == "normalize"
            and rec.get("attempts") == "1"
            and rec
        ),
        120,
        f"job {job_id} to stall mid-compile",
    )


def test_gc_removes_the_directory_of_a_killed_attempt_and_keeps_a_running_ones(
    client: httpx.Client,
    workers: WorkerPool,
    redis_server: RedisServer,
    service_env: dict[str, str],
    fault_plan_file: Path,
    new_module: Callable[[], str],
    tmp_path: Path,
) -> None:
    killed, running = new_module(), new_module()
    add_fault(fault_plan_file, sha(killed), sleep_s=30, attempts=[1])
    add_fault(fault_plan_file, sha(running), sleep_s=20, attempts=[1])
    killed_id, running_id = submit(client, killed), submit(client, running)
    horse = int(_wait_stalled(redis_server, killed_id)["pid"])
    _wait_stalled(redis_server, running_id)

    os.kill(horse, signal.SIGKILL)  # its `finally: rmtree(work)` never runs
    done = wait_job(client, killed_id, timeout=120)
    assert done["status"] == "succeeded" and done["attempts"] == 2, done
    work = Path(service_env["STACKFUSE_DATA_DIR"]) / "work"
    assert (work / f"{killed_id}.1").is_dir()
    assert not (work / f"{killed_id}.2").exists()  # a finished attempt cleans up after itself

    result = gc_json(service_env, tmp_path)
    assert f"work {killed_id}.1" in result["deleted"]
    assert not (work / f"{killed_id}.1").exists()
    if record(redis_server, running_id)["status"] == "running":
        assert (work / f"{running_id}.1").is_dir()
    assert wait_job(client, running_id, timeout=120)["status"] == "succeeded"


# --- the kernel cache ---------------------------------------------------------------------------
def _entry(
    settings: Settings, kind: str, suffix: str, extra: tuple[str, ...], age_s: float
) -> Path:
    """A kernel cache entry as worker.nvcc lays one out: the entry, its siblings, its lock."""
    from worker import nvcc

    key = uuid.uuid4().hex * 2
    entry = nvcc.cache_entry(settings, kind, key, suffix)
    entry.parent.mkdir(parents=True, exist_ok=True)
    for path in (entry, *(entry.with_suffix(s) for s in extra)):
        path.write_bytes(b"\0" * 1000)
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return entry


def _files_of(entry: Path) -> list[Path]:
    return sorted(entry.parent.glob(entry.name.split(".")[0] + ".*"))


def test_gc_deletes_kernels_unused_past_the_ttl_and_keeps_used_and_building_ones(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    settings = Settings(
        redis_url=redis_server.url,
        data_dir=tmp_path / "data",
        kernel_cache_dir=tmp_path / "kernels",
        kernel_cache_ttl_s=30 * DAY,
        gc_min_age_s=3600,
    )
    unused = _entry(settings, "objects", ".o", (".cu", ".json", ".lock"), 40 * DAY)
    unused_fatbin = _entry(settings, "fatbins", ".fatbin", (".lock",), 40 * DAY)
    fresh = _entry(settings, "objects", ".o", (".cu", ".json", ".lock"), 2 * DAY)
    read = _entry(settings, "fatbins", ".fatbin", (".lock",), 40 * DAY)
    read.read_bytes()  # a link reads it: relatime moves its atime (atime <= mtime)
    building = _entry(settings, "objects", ".o", (".cu", ".lock"), 40 * DAY)
    stub = settings.resolved_kernel_cache_dir() / "stub" / "libcuda.so.1"
    stub.parent.mkdir(parents=True)
    stub.write_bytes(b"stub")
    os.utime(stub, (time.time() - 40 * DAY, time.time() - 40 * DAY))

    with building.with_suffix(".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as worker.nvcc.cached_build holds it while nvcc runs
        result = retention.collect(redis_server.client(), settings)

    assert result.kernels == 2 and result.kernel_bytes == 6000
    assert _files_of(unused) == [] and _files_of(unused_fatbin) == []
    assert len(_files_of(fresh)) == 4 and len(_files_of(read)) == 2
    assert len(_files_of(building)) == 3 and stub.exists()


def test_gc_keeps_the_kernel_cache_within_its_budget_least_recently_used_first(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    settings = Settings(
        redis_url=redis_server.url,
        data_dir=tmp_path / "data",
        kernel_cache_dir=tmp_path / "kernels",
        kernel_cache_max_bytes=4500,
        gc_min_age_s=3600,
    )
    oldest = _entry(settings, "objects", ".o", (".cu",), 5 * DAY)
    older = _entry(settings, "fatbins", ".fatbin", (), 4 * DAY)
    newer = _entry(settings, "objects", ".o", (".cu",), 3 * DAY)
    newest = _entry(settings, "objects", ".o", (".cu",), 2 * DAY)
    just_built = _entry(settings, "objects", ".o", (), 60)  # younger than gc_min_age_s

    result = retention.collect(redis_server.client(), settings)
    # 8000 bytes -> at most 4500: the three least recently used go, the just-built one stays
    assert result.kernels == 3
    assert [bool(_files_of(e)) for e in (oldest, older, newer, newest, just_built)] == [
        False,
        False,
        False,
        True,
        True,
    ]


# --- the periodic job ---------------------------------------------------------------------------
def test_a_worker_runs_the_gc_job_periodically(
    worker_pool: WorkerPool,
    redis_server: RedisServer,
    service_env: dict[str, str],
    tmp_path: Path,
) -> None:
    worker_pool.stop_all()  # only this test's worker may take the gc lease
    r = redis_server.client()
    r.delete(retention.GC_LEASE_KEY)
    store = store_of(service_env)
    orphan = store.put_bytes(f"stored by a request whose enqueue failed {uuid.uuid4()}".encode())
    path = store.local_path(orphan)
    assert path is not None
    os.utime(path, (time.time() - DAY, time.time() - DAY))  # older than gc_min_age_s (1 h)

    env = {
        **service_env,
        "STACKFUSE_GC_INTERVAL_S": "3600",
        "STACKFUSE_KERNEL_CACHE_DIR": str(tmp_path / "kernels"),
    }
    worker = WorkerProcess(env, tmp_path / "gc-worker.log")
    try:
        wait_for(lambda: not store.exists(orphan), 60, "the periodic gc to delete the orphan")
        assert r.ttl(retention.GC_LEASE_KEY) > 3000  # the next run waits for gc_interval_s
        deleted = r.hget("stackfuse:metrics", "gc_deleted_total|kind=object")
        assert deleted is not None and int(deleted) >= 1
    finally:
        worker.stop()
