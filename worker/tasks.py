"""RQ entry points: the compile task, the worker class that runs it, and `stackfuse worker`.

Failure policy (issue #3/#4):

- a deterministic failure (``InputError``, ``CompileError``, a time limit, a bug in our code) is
  recorded in the job record by the task itself and the RQ job is failed *without* a retry;
- a retryable ``InfrastructureError`` raised by the compiler, a work-horse that dies (SIGKILL,
  segfault, OOM kill) and a worker that is lost as a whole (no heartbeat for ``worker_ttl_s``)
  are retried up to ``job_retries`` times, then failed with a message that says what happened
  how often ("the compiler process died (signal 11, SIGSEGV) 3 times; giving up");
- nothing a job does can kill the worker: every job runs in a forked work-horse, which also dies
  with its worker (PR_SET_PDEATHSIG), so a lost worker's job never runs twice at once;
- a retry goes to the front of the queue (``service.jobs.enqueue_commands``); RQ's scheduler,
  which enqueues retries that wait out an interval, runs in a child of one worker that is told
  SIGTERM when that worker dies however it dies (PR_SET_PDEATHSIG), so it releases its lock and
  another worker's scheduler takes over at its next maintenance, instead of an orphan holding
  the lock.

Each worker's maintenance also enqueues the periodic gc job (``service.retention``).

Importing this module does not import TVM; the horse imports it through ``worker.pipeline``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import json
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from redis import Redis
from redis import exceptions as redis_errors
from redis.exceptions import RedisError
from rq import Queue, Worker, get_current_job
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import AbandonedJobError
from rq.job import Job
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException
from rq.utils import now as rq_now

from service import logs, metrics, retention
from service.errors import (
    CompileError,
    InfrastructureError,
    StackfuseError,
    TimeLimitExceeded,
)
from service.jobs import AttemptCause, JobRecords
from service.settings import Settings, get_settings
from service.spec import CompileOptions, Target
from service.storage import LocalStore

log = logging.getLogger("stackfuse.worker")

#: Seconds between two progress writes for the same stage and detail.
_PROGRESS_MIN_INTERVAL_S = 0.5
_PR_SET_PDEATHSIG = 1


# --- test-only fault injection ----------------------------------------------------------------
class FaultPlan:
    """Deliberate failures for the kill/crash tests. Inert unless the worker's environment has
    ``STACKFUSE_FAULT_INJECTION=1``; never reachable from a request.

    ``STACKFUSE_FAULT_PLAN_FILE`` names a JSON file, read at the start of each job (so a test
    can add entries while workers run), keyed by input sha256::

        {"<sha256>": {"segfault": true}}                 # real SIGSEGV inside compile_module
        {"<sha256>": {"sleep_s": 20, "attempts": [1]}}   # stall mid-compile on attempt 1 only
        {"<sha256>": {"raise": "compile-error", "at": "codegen"}}  # deterministic failure
        {"<sha256>": {"raise": "infrastructure-error"}}            # retryable failure

    The fault fires at the first progress report of stage ``at`` (default: the first report
    after ``ingest``, i.e. once TVM has loaded the module), on the listed attempts (default all).
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.plan: dict[str, dict[str, Any]] = {}
        path = env.get("STACKFUSE_FAULT_PLAN_FILE")
        if env.get("STACKFUSE_FAULT_INJECTION") == "1" and path:
            try:
                self.plan = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                log.warning("fault injection: plan %s unreadable: %s", path, exc)

    def hook(self, input_sha256: str, attempt: int) -> Callable[[str], None] | None:
        fault = self.plan.get(input_sha256)
        if not fault or attempt not in fault.get("attempts", [attempt]):
            return None
        fired = False

        def maybe_fire(stage: str) -> None:
            nonlocal fired
            at = fault.get("at")
            if fired or (stage != at if at else stage in ("starting", "ingest")):
                return
            fired = True
            if fault.get("sleep_s"):
                log.warning("fault injection: sleeping %s s at %s", fault["sleep_s"], stage)
                time.sleep(float(fault["sleep_s"]))
            if fault.get("segfault"):
                log.warning("fault injection: segfault at %s", stage)
                ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash inside TVM would
            if fault.get("raise") == "compile-error":
                raise CompileError(f"injected deterministic failure at {stage} (test only)")
            if fault.get("raise") == "infrastructure-error":
                raise InfrastructureError(f"injected machine failure at {stage} (test only)")

        return maybe_fire


# --- the task ---------------------------------------------------------------------------------
class JobCancelled(CompileError):
    """The job's record finished while it ran (cancelled): stop, retry nothing. Its record
    is not changed (a finished record never is)."""

    type = "cancelled"
    title = "Job cancelled"


class _Progress:
    """The pipeline's progress callback: writes stage/progress to the job record (throttled,
    best effort: a lost progress write must not fail a compile) and runs fault hooks."""

    def __init__(self, records: JobRecords, job_id: str, fault: Callable[[str], None] | None):
        self.records = records
        self.job_id = job_id
        self.fault = fault
        self._last: tuple[str, str] = ("", "")
        self._last_at = 0.0

    def __call__(self, stage: str, fraction: float, detail: str = "") -> None:
        now = time.monotonic()
        if (stage, detail) != self._last or now - self._last_at >= _PROGRESS_MIN_INTERVAL_S:
            self._last, self._last_at = (stage, detail), now
            try:
                written = self.records.progress(self.job_id, stage, fraction, detail)
            except Exception as exc:  # Redis hiccup: the next report retries
                log.warning("job %s: progress not recorded: %s", self.job_id, exc)
                written = True
            if not written:  # finished meanwhile: cancelled (DELETE /jobs/{id})
                raise JobCancelled(f"job {self.job_id} was cancelled; stopping its compile")
        if self.fault is not None:
            self.fault(stage)


def _no_retry(job: Job | None) -> None:
    """Make RQ fail the job without a retry (it checks ``retries_left`` after we raise)."""
    if job is not None:
        job.retries_left = 0


def _count_stages(rq_job: Job, report_path: Path) -> None:
    """The report's stage timings into the stage-duration histogram (best effort: the job has
    succeeded whatever happens here)."""
    try:
        timings = json.loads(report_path.read_text()).get("timings", {})
        with rq_job.connection.pipeline(transaction=False) as pipe:
            metrics.count_stages(pipe, timings)
            pipe.execute()
    except (OSError, ValueError, RedisError) as exc:
        log.warning("job %s: stage timings not counted: %s", rq_job.id, exc)


def compile_job(job_id: str, input_sha256: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Compile one stored module; the RQ job's function. Arguments are ids and hashes only.

    Returns a small summary on success. On failure the job record already says why when this
    raises; the raise only tells RQ the job failed (and whether to retry, see module doc).
    """
    settings = get_settings()
    rq_job = get_current_job()
    assert rq_job is not None, "compile_job runs inside an RQ work-horse"
    records = JobRecords(rq_job.connection, settings)
    attempt = records.start(
        job_id,
        worker=os.environ.get("RQ_WORKER_ID", ""),
        pid=os.getpid(),
        worker_pid=os.getppid(),
    )
    if attempt == 0:  # delivered again after it finished: nothing to do
        return {"status": "already-finished"}
    store = LocalStore.for_data_dir(settings.data_dir, fsync=settings.store_fsync)
    work = settings.data_dir / "work" / f"{job_id}.{attempt}"
    try:
        with logs.job_scope(job_id):
            return _compile(
                records, store, settings, job_id, input_sha256, spec, work, rq_job, attempt
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _compile(
    records: JobRecords,
    store: LocalStore,
    settings: Settings,
    job_id: str,
    input_sha256: str,
    spec: dict[str, Any],
    work: Path,
    rq_job: Job,
    attempt: int,
) -> dict[str, Any]:
    from worker.pipeline import REPORT_NAME, compile_module

    def stored_report() -> str | None:
        path = work / REPORT_NAME
        return store.put_file(path) if path.is_file() else None

    try:
        target = Target.model_validate(spec["target"])
        options = CompileOptions.model_validate(spec["options"])
        try:
            with store.open(input_sha256) as f:
                module = f.read()
        except FileNotFoundError:
            raise InfrastructureError(
                f"the module {input_sha256[:12]} is missing from the store at "
                f"{settings.data_dir}: do the API and this worker share STACKFUSE_DATA_DIR?"
            ) from None
        work.mkdir(parents=True, exist_ok=True)
        result = compile_module(
            module,
            target=target,
            options=options,
            out_dir=work,
            settings=settings,
            progress=_Progress(records, job_id, FaultPlan().hook(input_sha256, attempt)),
            fmt=spec.get("format", "tvm-json"),
            library_file=f"stackfuse-{job_id}.so",  # the artifact's download name
        )
        artifact = store.put_file(result.library)
        report = store.put_file(result.report_path)
        records.succeed(job_id, artifact_sha256=artifact, report_sha256=report)
        _count_stages(rq_job, result.report_path)
        log.info("job %s: succeeded", job_id, extra={"artifact_sha256": artifact})
        return {"status": "succeeded", "artifact_sha256": artifact, "report_sha256": report}
    except StackfuseError as err:
        if isinstance(err.__cause__, JobTimeoutException):  # RQ's alarm, wrapped by the pipeline
            _timed_out(records, settings, job_id, rq_job, stored_report())
        if err.retryable:
            log.warning("job %s: %s (retryable): %s", job_id, err.type, err)
            records.note_error(job_id, err)
            raise  # RQ retries; StackfuseWorker.handle_job_failure updates the record
        log.info("job %s: failed: %s: %s", job_id, err.type, err)
        records.fail(job_id, err, report_sha256=stored_report())
        _no_retry(rq_job)
        raise
    except JobTimeoutException:
        _timed_out(records, settings, job_id, rq_job, stored_report())
    except Exception as exc:
        # A bug of ours, not of the input nor the machine: retrying would fail the same way.
        log.exception("job %s: unexpected error in the compiler", job_id)
        internal = StackfuseError(
            f"internal error in the compiler ({type(exc).__name__}); the operators have the "
            "traceback in the worker log"
        )
        records.fail(job_id, internal, report_sha256=stored_report())
        _no_retry(rq_job)
        raise


def _timed_out(
    records: JobRecords, settings: Settings, job_id: str, rq_job: Job, report: str | None
) -> NoReturn:
    limit = rq_job.timeout or settings.job_timeout_s
    records.fail(
        job_id,
        TimeLimitExceeded(
            f"the job ran past its {limit} s time limit and was stopped", limit_seconds=limit
        ),
        report_sha256=report,
    )
    _no_retry(rq_job)
    raise TimeLimitExceeded(f"job {job_id} timed out")


def gc_job() -> dict[str, Any]:
    """The periodic garbage collection (service.retention); RQ keeps its result for a day."""
    rq_job = get_current_job()
    assert rq_job is not None, "gc_job runs inside an RQ work-horse"
    result = retention.collect(rq_job.connection, get_settings())
    log.info("gc: %s", result.summary())
    out = dataclasses.asdict(result)
    out.pop("deleted")
    return out


# --- the worker -------------------------------------------------------------------------------
def _die_with_parent(sig: int, parent_pid: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies. False when the
    parent is already gone (it died before the request took effect) or it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux
        return True
    return os.getppid() == parent_pid


class StackfuseScheduler(RQScheduler):
    """RQ's scheduler, in a child that stops (releasing its locks) when its worker dies."""

    _worker_pid = 0

    def start(self) -> Any:
        self._worker_pid = os.getpid()
        return super().start()

    def work(self) -> None:
        # SIGTERM, not SIGKILL: RQ's scheduler stops on it and releases its locks first
        if not _die_with_parent(signal.SIGTERM, self._worker_pid):
            self.stop()
            return
        super().work()


def _signal_text(signum: int) -> str:
    try:
        return f"signal {signum}, {signal.Signals(signum).name}"
    except ValueError:
        return f"signal {signum}"


class StackfuseWorker(Worker):
    """RQ's forking worker, plus: job records kept in step with RQ's failure handling, lost-job
    detection after ``worker_ttl_s`` (RQ hard-codes +60 s), and horses that die with it."""

    def __init__(self, *args: Any, settings: Settings, **kwargs: Any) -> None:
        kwargs.setdefault("exception_handlers", [self._on_exception])
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.records = JobRecords(self.connection, settings)
        self._horse_wait_status: int | None = None

    # lost-job detection: an execution not heartbeaten for worker_ttl_s is abandoned
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return max(self.worker_ttl, self.job_monitoring_interval + 5)

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing compiler dumps no core
        faulthandler.enable()  # ...but leaves its Python stack in the worker log
        if not _die_with_parent(signal.SIGKILL, self.pid or 0):  # the worker died before prctl
            os._exit(1)

    def _start_scheduler(
        self,
        burst: bool = False,
        logging_level: str | None = "INFO",
        date_format: str = DEFAULT_LOGGING_DATE_FORMAT,
        log_format: str = DEFAULT_LOGGING_FORMAT,
    ) -> None:
        """RQ's own, with :class:`StackfuseScheduler` in place of RQScheduler."""
        self.scheduler = StackfuseScheduler(
            self.queues,
            connection=self.connection,
            logging_level=logging_level if logging_level is not None else self.log.level,
            date_format=date_format,
            log_format=log_format,
            serializer=self.serializer,
        )
        self.scheduler.acquire_locks()
        if self.scheduler.acquired_locks:
            if burst:
                try:
                    self.scheduler.register_birth()
                    self.scheduler.enqueue_scheduled_jobs()
                finally:
                    self.scheduler.release_locks()
                    self.scheduler.register_death()
            else:
                self.scheduler.start()

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        try:
            retention.maybe_enqueue(self.connection, self.queues[0], self.settings)
        except Exception:  # gc waits for the next maintenance; serving jobs must go on
            log.exception("could not enqueue the gc job")

    def handle_work_horse_killed(self, job: Job, retpid: int, ret_val: int, rusage: Any) -> None:
        self._horse_wait_status = ret_val
        super().handle_work_horse_killed(job, retpid, ret_val, rusage)

    def handle_job_failure(
        self,
        job: Job,
        queue: Queue,
        started_job_registry: Any = None,
        exc_string: str = "",
        execution: Any = None,
    ) -> None:
        try:
            self._record_failure(job)
        except Exception:  # the record is advisory; RQ's own bookkeeping must still happen
            log.exception("job %s: could not update its record", job.id)
        super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)

    def _record_failure(self, job: Job) -> None:
        status, self._horse_wait_status = self._horse_wait_status, None
        if self._is_horse:  # the task raised: it noted the error (or recorded a final failure)
            cause = AttemptCause("error", "the compiler failed", {})
        elif status is not None and os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            started = job.started_at
            ran = (time.time() - started.timestamp()) if started else 0.0
            if job.timeout and job.timeout > 0 and ran >= job.timeout:
                # killed by the monitor past the time limit: deterministic, not retried
                self.records.fail(
                    job.id,
                    TimeLimitExceeded(
                        f"the job ran past its {job.timeout} s time limit and was killed",
                        limit_seconds=job.timeout,
                    ),
                )
                job.retries_left = 0
                return
            cause = AttemptCause(
                "crashed", f"the compiler process died ({_signal_text(sig)})", {"signal": sig}
            )
        else:
            code = os.WEXITSTATUS(status) if status is not None else -1
            cause = AttemptCause(
                "exited",
                f"the compiler process exited unexpectedly (status {code})",
                {"exit_status": code},
            )
        self.records.attempt_ended(job.id, cause, will_retry=job.should_retry)

    def _on_exception(self, job: Job, exc_type: type, exc_value: Any, tb: Any) -> bool | None:
        """Exception handler; also called by registry cleanup for a lost worker's jobs."""
        if exc_type is AbandonedJobError or isinstance(exc_value, AbandonedJobError):
            cause = AttemptCause(
                "lost",
                "the worker running this job was lost "
                f"(no heartbeat for {self.settings.worker_ttl_s} s)",
                {},
            )
            will_retry = bool(job.retries_left and job.retries_left > 0)
            try:
                self.records.attempt_ended(job.id, cause, will_retry=will_retry)
            except Exception:
                log.exception("job %s: could not update its record", job.id)
            _attempt_over(job)
        return None  # let RQ's default handling continue


def _attempt_over(job: Job) -> None:
    """Mark a lost worker's attempt ended before RQ retries the job. RQ puts a retry at the
    front only for a job with an ``ended_at`` (``Job.should_enqueue_at_front``); its worker
    writes one when a job fails or its horse dies, but a lost worker never does, so without
    this the retry went to the back of the queue."""
    if job.ended_at is None:
        job.ended_at = rq_now()


def make_worker(settings: Settings, name: str | None = None) -> StackfuseWorker:
    conn = Redis.from_url(
        settings.redis_url, retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError]
    )
    return StackfuseWorker(
        [settings.queue_name],
        name=name or f"stackfuse-{socket.gethostname()}-{os.getpid()}",
        connection=conn,
        serializer=JSONSerializer,
        settings=settings,
        worker_ttl=settings.worker_ttl_s,
        job_monitoring_interval=settings.worker_heartbeat_s,
        maintenance_interval=settings.maintenance_interval_s,
        default_result_ttl=settings.result_ttl_s,
    )


def run_worker(settings: Settings, *, burst: bool = False) -> bool:
    """Run one worker in this process until SIGTERM/SIGINT (or the queue is empty, burst)."""
    logs.configure(settings.log_format)  # before RQ's own handlers, which it then leaves out
    worker = make_worker(settings)
    return worker.work(burst=burst, with_scheduler=True, logging_level="INFO")


def gpu_ids(env: dict[str, str] | None = None) -> list[str]:
    """The GPUs this host lets workers use, as CUDA_VISIBLE_DEVICES entries: this process's own
    CUDA_VISIBLE_DEVICES when set (``CUDA_VISIBLE_DEVICES=2,3 stackfuse worker`` runs on GPUs 2
    and 3), else nvidia-smi's indices. Never asks CUDA: a CUDA-initialized parent cannot fork
    safely."""
    env = dict(os.environ) if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = []
        for entry in (d.strip() for d in visible.split(",")):
            if not entry or entry.startswith("-"):  # CUDA stops at the first invalid entry
                break
            ids.append(entry)
        return ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [
        line.split(":", 1)[0].split()[1]
        for line in out.splitlines()
        if line.startswith("GPU ") and ":" in line
    ]


def gpu_count() -> int:
    """GPUs on this host (see :func:`gpu_ids`)."""
    return len(gpu_ids())


def worker_env(index: int, ids: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment of worker ``index`` of `stackfuse worker --count N`: pinned to one GPU
    of ``ids`` (round robin when N exceeds them), unchanged on a host without GPUs."""
    out = dict(env)
    if ids:
        out["CUDA_VISIBLE_DEVICES"] = ids[index % len(ids)]
    return out


def run_workers(settings: Settings, count: int | None = None) -> int:
    """`stackfuse worker`: one RQ worker per GPU (one on a host without a GPU).

    A single worker runs in this process. Several run as child processes, each seeing one GPU
    (:func:`worker_env`); a child that dies is restarted; SIGTERM/SIGINT are passed on.
    """
    ids = gpu_ids()
    count = count or settings.worker_count or max(1, len(ids))
    if count == 1:
        run_worker(settings)
        return 0
    children: dict[int, subprocess.Popen[bytes]] = {}
    stopping = False

    def spawn(index: int) -> None:
        env = worker_env(index, ids, dict(os.environ))
        argv = [sys.executable, "-m", "service.cli", "worker", "--count", "1"]
        children[index] = subprocess.Popen(argv, env=env)

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for i in range(count):
        spawn(i)
    while True:
        alive = False
        for index, child in list(children.items()):
            code = child.poll()
            if code is None:
                alive = True
            elif not stopping:
                log.warning("worker %d exited with %s; restarting it", index, code)
                time.sleep(1)
                spawn(index)
                alive = True
        if not alive:
            return 0
        time.sleep(1)
