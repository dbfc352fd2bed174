"""Session fixtures for tests that need the real service: a redis-server of their own, RQ
worker processes (`stackfuse worker`), API processes (`stackfuse api`), and helpers to wait.

Nothing is faked: Redis is a real redis-server on a free port in a temp dir (AOF on, so a test
can kill and restart it), workers are real forking RQ workers, the API is uvicorn in its own
process. Every worker of the session shares one kernel cache (STACKFUSE_KERNEL_CACHE_DIR, set for
this process too), so nvcc runs once per kernel config per session; set the variable yourself to
keep the cache across sessions.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

REPO = Path(__file__).resolve().parents[1]


#: the session's own kernel cache, when this session made one (removed at its end)
_OWN_KERNEL_CACHE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # One kernel cache for every compile of this session: workers and in-process tests.
    if not os.environ.get("STACKFUSE_KERNEL_CACHE_DIR"):
        path = tempfile.mkdtemp(prefix="stackfuse-kernels-")
        _OWN_KERNEL_CACHE.append(path)
        os.environ["STACKFUSE_KERNEL_CACHE_DIR"] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    """A cache set from outside is kept (that is what setting it is for); our own is not."""
    import shutil

    for path in _OWN_KERNEL_CACHE:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get("STACKFUSE_KERNEL_CACHE_DIR") == path:
            del os.environ["STACKFUSE_KERNEL_CACHE_DIR"]
    _OWN_KERNEL_CACHE.clear()


# --- helpers ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as dead
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


# --- redis ------------------------------------------------------------------------------------
class RedisServer:
    """A redis-server of the test session, persisted with AOF in ``directory``."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "redis.log").open("ab")
        argv = [
            "redis-server",
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(self.ping, 15, f"redis-server on port {self.port}")

    def ping(self) -> bool:
        try:
            with Redis(port=self.port, socket_connect_timeout=0.5) as r:
                return bool(r.ping())
        except Exception:
            return False

    def client(self) -> Redis:
        return Redis.from_url(self.url)

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs; only what the AOF already has survives."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.stop()


# --- the service's environment ----------------------------------------------------------------
@pytest.fixture(scope="session")
def fault_plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "plan.json"
    path.write_text("{}")
    return path


def add_fault(plan_file: Path, input_sha256: str, **fault: Any) -> None:
    """Arm worker/tasks.py's test-only fault injection for one module (by its sha256)."""
    plan = json.loads(plan_file.read_text())
    plan[input_sha256] = fault
    tmp = plan_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan))
    os.replace(tmp, plan_file)


@pytest.fixture(scope="session")
def service_env(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, fault_plan_file: Path
) -> dict[str, str]:
    """Environment of every API and worker process of the session (short timings)."""
    data_dir = tmp_path_factory.mktemp("data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STACKFUSE_")}
    env.pop("REDIS_URL", None)
    env.update(
        {
            "STACKFUSE_REDIS_URL": redis_server.url,
            "STACKFUSE_DATA_DIR": str(data_dir),
            "STACKFUSE_KERNEL_CACHE_DIR": os.environ["STACKFUSE_KERNEL_CACHE_DIR"],
            "STACKFUSE_WORKER_TTL_S": "6",
            "STACKFUSE_WORKER_HEARTBEAT_S": "1",
            "STACKFUSE_MAINTENANCE_INTERVAL_S": "2",
            "STACKFUSE_JOB_RETRIES": "2",
            "STACKFUSE_JOB_RETRY_INTERVALS_S": "[1]",
            "STACKFUSE_JOB_TIMEOUT_S": "600",
            "STACKFUSE_RETRY_AFTER_S": "1",
            "STACKFUSE_MAX_BODY_BYTES": str(2 * 1024 * 1024),
            "STACKFUSE_FAULT_INJECTION": "1",
            "STACKFUSE_FAULT_PLAN_FILE": str(fault_plan_file),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


# --- workers ----------------------------------------------------------------------------------
class WorkerProcess:
    """One `stackfuse worker --count 1` process, in its own process group."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker", "--count", "1"],
            cwd=REPO,
            env=env,
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30) -> None:
        """Warm shutdown (SIGTERM), then the whole group is killed if it lingers."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
        self.kill_group()

    def kill_group(self) -> None:
        """SIGKILL the worker and everything in its process group (its scheduler); its
        work-horse has a group of its own and must die by itself (PR_SET_PDEATHSIG)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(10)


class WorkerPool:
    def __init__(self, env: dict[str, str], log_dir: Path, redis_url: str) -> None:
        self.env = env
        self.log_dir = log_dir
        self.redis_url = redis_url
        self.workers: list[WorkerProcess] = []
        self._n = 0

    def start_one(self) -> WorkerProcess:
        self._n += 1
        w = WorkerProcess(self.env, self.log_dir / f"worker-{self._n}.log")
        self.workers.append(w)
        return w

    def ensure(self, count: int) -> None:
        """Exactly ``count`` live workers, each registered in Redis."""
        self.workers = [w for w in self.workers if w.alive()]
        while len(self.workers) < count:
            self.start_one()
        while len(self.workers) > count:
            self.workers.pop().stop()
        queue = self.env.get("STACKFUSE_QUEUE_NAME", "stackfuse")
        with Redis.from_url(self.redis_url) as r:
            wait_for(
                lambda: _registered_pids(r, queue) >= {w.pid for w in self.workers},
                30,
                f"{count} workers to register",
            )

    def by_pid(self, pid: int) -> WorkerProcess:
        return next(w for w in self.workers if w.pid == pid)

    def stop_all(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []


def _registered_pids(r: Redis, queue: str) -> set[int]:
    pids = set()
    for key in r.smembers(f"rq:workers:{queue}"):
        pid = r.hget(key, "pid")
        if pid:
            pids.add(int(pid))
    return pids


@pytest.fixture(scope="session")
def worker_pool(
    service_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
) -> Iterator[WorkerPool]:
    pool = WorkerPool(service_env, tmp_path_factory.mktemp("workers"), redis_server.url)
    yield pool
    pool.stop_all()


@pytest.fixture
def workers(worker_pool: WorkerPool) -> WorkerPool:
    """Two live workers for this test (restarted if an earlier test killed one)."""
    worker_pool.ensure(2)
    return worker_pool


# --- API --------------------------------------------------------------------------------------
class ApiProcess:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "service.cli",
                "api",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            cwd=REPO,
            env=env,
            stdout=log_path.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(self._up, 30, f"the API on port {self.port} (log: {log_path})")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the API exited at start; see {self.log_path}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


@pytest.fixture(scope="session")
def start_api(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ApiProcess]]:
    """Start an extra API process with some settings overridden (``STACKFUSE_X=...``)."""
    started: list[ApiProcess] = []
    log_dir = tmp_path_factory.mktemp("api")

    def start(**overrides: str) -> ApiProcess:
        api = ApiProcess({**service_env, **overrides}, log_dir / f"api-{len(started)}.log")
        started.append(api)
        return api

    yield start
    for api in started:
        api.stop()


@pytest.fixture(scope="session")
def api(start_api: Callable[..., ApiProcess]) -> ApiProcess:
    """The session's API process."""
    return start_api()


@pytest.fixture
def client(api: ApiProcess) -> Iterator[httpx.Client]:
    with api.client() as c:
        yield c


def wait_job(
    client: httpx.Client,
    job_id: str,
    statuses: set[str] | frozenset[str] = frozenset({"succeeded", "failed", "cancelled"}),
    timeout: float = 300,
    **fields: Any,
) -> dict[str, Any]:
    """Poll GET /jobs/{id} until its status is in ``statuses`` (and the given fields match)."""

    def ready() -> dict[str, Any] | None:
        job = client.get(f"/jobs/{job_id}").json()
        ok = job["status"] in statuses and all(job.get(k) == v for k, v in fields.items())
        return job if ok else None

    return wait_for(ready, timeout, f"job {job_id} to reach {sorted(statuses)} {fields}", 0.2)


# --- modules ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def module_json() -> str:
    """A small stacked-attention Relax module as TVM JSON (imports TVM in the test process).

    head_dim_v 32 != head_dim 64 keeps it on the SM80-class kernel (~12 s of nvcc on 2 cores)
    rather than the Hopper one (~45-120 s, 4 GB): these tests are about the service. The Hopper
    path is built end to end in tests/worker/test_build.py.
    """
    from tests.models import stacked_attention_module
    from worker.toolchain import import_tvm

    tvm = import_tvm()
    return str(tvm.ir.save_json(stacked_attention_module(2, 64, 4, 64, 32)))


_variants = iter(range(1, 1_000_000))


@pytest.fixture
def fresh_module(module_json: str) -> Callable[[], str]:
    """Distinct module texts (new sha256, so no cache hit) that compile to the same kernel:
    trailing whitespace is insignificant to JSON, so nvcc is not run again."""
    return lambda: module_json + " " * next(_variants)
