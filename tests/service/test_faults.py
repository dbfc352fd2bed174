"""Infrastructure failures (issue #4): work-horse killed, compiler segfault (poison job), job
time limit, whole worker SIGKILLed. Real worker processes, real signals; the only test hook is
worker/tasks.py's fault injection (a stall or a SIGSEGV at a chosen stage, for a chosen module).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from tests.conftest import (
    ApiProcess,
    RedisServer,
    WorkerPool,
    add_fault,
    pid_alive,
    wait_for,
    wait_job,
)
from tests.service.reshape import fresh_reshape

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

RETRIES = 2  # STACKFUSE_JOB_RETRIES of the session


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def submit(client: httpx.Client, module: str) -> str:
    r = client.post("/optimize", json={"module": module})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def record(redis_server: RedisServer, job_id: str) -> dict[str, str]:
    raw = redis_server.client().hgetall(f"stackfuse:job:{job_id}")
    return {k.decode(): v.decode() for k, v in raw.items()}


def wait_stalled(redis_server: RedisServer, job_id: str, attempt: int = 1) -> dict[str, str]:
    """Wait until the job sits in its injected stall (stage normalize: TVM has the module)."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: (
            (rec := record(redis_server, job_id)).get("status") == "running"
            and rec.get("stage") == "normalize"
            and rec.get("attempts") == str(attempt)
            and rec
        ),
        120,
        f"job {job_id} to stall mid-compile",
    )


def test_workhorse_sigkilled_mid_compile_is_retried_and_finishes(
    client: httpx.Client,
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    fault_plan_file: Path,
    redis_server: RedisServer,
) -> None:
    module = fresh_module()
    add_fault(fault_plan_file, sha(module), sleep_s=30, attempts=[1])
    job_id = submit(client, module)
    first = wait_stalled(redis_server, job_id)
    horse, worker_pid = int(first["pid"]), int(first["worker_pid"])
    assert horse != worker_pid

    os.kill(horse, signal.SIGKILL)
    done = wait_job(client, job_id, timeout=120)
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 2 and done["error"] is None
    assert pid_alive(worker_pid)  # the worker survived its horse
    assert record(redis_server, job_id)["pid"] != str(horse)


def test_segfault_fails_that_job_only_at_the_retry_bound_and_the_worker_keeps_serving(
    client: httpx.Client,
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    fault_plan_file: Path,
    redis_server: RedisServer,
) -> None:
    poison = fresh_module()
    add_fault(fault_plan_file, sha(poison), segfault=True)  # crashes on every attempt
    job_id = submit(client, poison)
    done = wait_job(client, job_id, timeout=180)
    assert done["status"] == "failed"
    assert done["attempts"] == RETRIES + 1
    err = done["error"]
    assert err["type"] == "infrastructure-error"
    assert err["message"] == (
        f"the compiler process died (signal 11, SIGSEGV) {RETRIES + 1} times; giving up"
    )
    assert err["reason"] == "crashed" and err["signal"] == 11

    # the bound holds: nothing re-queues it, and RQ agrees it failed
    time.sleep(4)
    assert client.get(f"/jobs/{job_id}").json()["attempts"] == RETRIES + 1
    rq_job = Job.fetch(job_id, connection=redis_server.client(), serializer=JSONSerializer)
    assert rq_job.get_status() == "failed"

    # the workers that ran it are alive and serve the next job
    crashed_on = int(record(redis_server, job_id)["worker_pid"])
    assert pid_alive(crashed_on) and all(w.alive() for w in workers.workers)
    ok = wait_job(client, submit(client, fresh_module()), timeout=120)
    assert ok["status"] == "succeeded", ok


def test_retryable_compiler_error_is_retried_to_the_bound_and_keeps_its_message(
    client: httpx.Client,
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    fault_plan_file: Path,
) -> None:
    module = fresh_module()
    add_fault(fault_plan_file, sha(module), **{"raise": "infrastructure-error"})
    done = wait_job(client, submit(client, module), timeout=120)
    assert done["status"] == "failed" and done["attempts"] == RETRIES + 1
    assert done["error"]["type"] == "infrastructure-error"
    assert done["error"]["message"] == (
        f"injected machine failure at normalize (test only) {RETRIES + 1} times; giving up"
    )


def test_job_past_its_time_limit_fails_without_retry(
    start_api: Callable[..., ApiProcess],
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    fault_plan_file: Path,
) -> None:
    module = fresh_module()
    add_fault(fault_plan_file, sha(module), sleep_s=60)
    short = start_api(STACKFUSE_JOB_TIMEOUT_S="4")  # the timeout travels with the job
    with short.client() as c:
        job_id = submit(c, module)
        done = wait_job(c, job_id, timeout=60)
        assert done["status"] == "failed" and done["attempts"] == 1, done
        assert done["error"]["type"] == "time-limit-exceeded"
        assert "4 s" in done["error"]["message"]
        time.sleep(3)
        assert c.get(f"/jobs/{job_id}").json()["attempts"] == 1


SCHEDULER_LOCK = "rq:scheduler-lock:stackfuse"


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def scheduler_holder(redis_server: RedisServer, workers: WorkerPool) -> tuple[str, int, int] | None:
    """(name, pid, worker pid) of the scheduler holding the queue's lock, when it is alive and
    a child of one of ``workers``."""
    r = redis_server.client()
    name = r.get(SCHEDULER_LOCK)
    pid = r.hget(f"rq:scheduler:{name.decode()}", "pid") if name else None
    if not pid or not pid_alive(int(pid)):
        return None
    parent = parent_pid(int(pid))
    if parent not in {w.pid for w in workers.workers}:
        return None
    return name.decode(), int(pid), parent


def test_sigkilled_worker_takes_its_scheduler_along_and_its_retry_goes_first(
    client: httpx.Client,
    workers: WorkerPool,
    fault_plan_file: Path,
    redis_server: RedisServer,
) -> None:
    """kill -9 of the worker whose child runs RQ's scheduler (not of its process group): the
    scheduler dies with it and frees its lock, the other worker's scheduler takes over and
    enqueues the killed job's retry (interval 1 s) at the front, ahead of jobs queued before."""
    name, scheduler, holder_pid = wait_for(
        lambda: scheduler_holder(redis_server, workers), 120, "a live worker's scheduler"
    )
    # both workers busy, so the holder runs one of the stalled jobs
    stalled = [fresh_reshape(), fresh_reshape()]
    for module in stalled:
        add_fault(fault_plan_file, sha(module), sleep_s=20, attempts=[1])
    ids = [submit(client, m) for m in stalled]
    running = {int(wait_stalled(redis_server, j)["worker_pid"]): j for j in ids}
    assert set(running) == {w.pid for w in workers.workers}
    victim_job = running[holder_pid]
    horse = int(record(redis_server, victim_job)["pid"])
    # queued behind them, each long enough to keep the surviving worker busy while the
    # scheduler enqueues the retry
    behind = [fresh_reshape(), fresh_reshape()]
    for module in behind:
        add_fault(fault_plan_file, sha(module), sleep_s=10, attempts=[1])
    later = [submit(client, m) for m in behind]

    holder = workers.by_pid(holder_pid)
    os.kill(holder_pid, signal.SIGKILL)  # the worker alone, as the OOM killer would
    holder.proc.wait(10)
    wait_for(lambda: not pid_alive(scheduler), 10, "the scheduler to die with its worker")
    wait_for(lambda: not pid_alive(horse), 10, "the work-horse to die with its worker")
    r = redis_server.client()
    wait_for(lambda: r.get(SCHEDULER_LOCK) != name.encode(), 10, "the lock to be released")

    queue_key = "rq:queue:stackfuse"
    queued = wait_for(
        lambda: (
            (ids_ := [i.decode() for i in r.lrange(queue_key, 0, -1)])
            and victim_job in ids_
            and ids_
        ),
        120,
        "the killed job's retry to be enqueued",
        0.05,
    )
    assert queued[0] == victim_job, queued  # at the front, whatever was queued before it
    survivor = scheduler_holder(redis_server, workers)
    assert survivor is not None and survivor[2] != holder_pid

    done = {j: wait_job(client, j, timeout=180) for j in [*ids, *later]}
    assert all(d["status"] == "succeeded" for d in done.values()), done
    assert done[victim_job]["attempts"] == 2
    assert done[victim_job]["started_at"] < done[later[-1]]["started_at"]


# Last on purpose: the killed worker may hold RQ's scheduler lock (61 s TTL), which delays
# scheduled retries in tests that run after this one.
def test_worker_sigkilled_as_a_whole_gets_its_job_requeued_within_seconds(
    start_api: Callable[..., ApiProcess],
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    fault_plan_file: Path,
    redis_server: RedisServer,
) -> None:
    module = fresh_module()
    add_fault(fault_plan_file, sha(module), sleep_s=60, attempts=[1])
    # retry interval 0: the re-queue must not wait for RQ's scheduler, which may have lived in
    # the worker we kill (its lock outlives it by up to 61 s; see the README)
    api = start_api(STACKFUSE_JOB_RETRY_INTERVALS_S="[0]")
    with api.client() as c:
        job_id = submit(c, module)
        first = wait_stalled(redis_server, job_id)
        horse, worker_pid = int(first["pid"]), int(first["worker_pid"])
        victim = workers.by_pid(worker_pid)

        killed_at = time.monotonic()
        victim.kill_group()  # worker + its scheduler; the horse is in a group of its own
        wait_for(lambda: not pid_alive(horse), 5, "the orphaned work-horse to die with its worker")

        done = wait_job(c, job_id, timeout=120)
        took = time.monotonic() - killed_at
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 2
        assert int(record(redis_server, job_id)["worker_pid"]) != worker_pid
        # worker_ttl_s=6 + maintenance 2 s + a cached compile: seconds, not hours
        assert took < 60, f"re-queued after {took:.0f} s"
