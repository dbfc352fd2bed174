"""Retention: the one place that deletes what the service no longer needs.

:func:`collect` (run by `stackfuse gc` and by the workers' periodic gc job) removes

- stored objects (modules, libraries, reports) that no job record and no compile cache entry
  names: those of records that expired (``result_ttl_s`` / ``failure_ttl_s``), of enqueues that
  failed, and half-written puts of processes that died;
- kernel cache entries (CUTLASS objects, TVM fatbins) unused for ``kernel_cache_ttl_s``, and then
  the least recently used ones while the cache is over ``kernel_cache_max_bytes``;
- ``work/<job>.<attempt>`` directories of attempts that are over (the attempt's horse was killed
  before its own cleanup ran).

Nothing younger than ``gc_min_age_s`` is deleted. That is what makes collecting safe next to
running API and worker processes without a lock: a module is stored a moment before the record
naming it is written, and a put or a cache hit refreshes the mtime of an object it is about to
reference (:meth:`service.storage.Store.keep`), so an object that is referenced or about to be is
either named in Redis or young. The store's own delete re-checks the mtime after moving the object
aside. A kernel cache entry is "used" when it is built or read (its atime: the filesystem's
default ``relatime`` updates it at least daily, fine for a TTL in days); an entry whose build lock
is held is skipped.

The periodic job: every worker's maintenance (each ``maintenance_interval_s``) tries to take the
lease :data:`GC_LEASE_KEY` for ``gc_interval_s``; the one that gets it enqueues :data:`GC_TASK`,
which runs in a work-horse like a compile.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service import jobs, metrics, tenancy
from service.settings import Settings
from service.storage import LocalStore

if TYPE_CHECKING:
    from redis import Redis
    from rq import Queue

#: Held by the worker that enqueued the latest gc job, for ``gc_interval_s``.
GC_LEASE_KEY = f"{jobs.PREFIX}:gc:lease"
#: The RQ task, named by import path (the worker's entry point).
GC_TASK = "worker.tasks.gc_job"
GC_JOB_TIMEOUT_S = 1800
#: How long RQ keeps a gc job's result (its :class:`Collected`, as JSON).
GC_RESULT_TTL_S = 24 * 3600
#: Keys asked per SCAN / HMGET round trip.
SCAN_BATCH = 1000
#: Subdirectories of the kernel cache that hold entries, and the suffix of each entry's main file
#: (worker.nvcc.cache_entry); ``stub/`` (the driver stub) is not an entry.
KERNEL_KINDS = {"objects": ".o", "fatbins": ".fatbin"}


@dataclass
class Collected:
    """What one collection deleted (or, with ``dry_run``, would delete)."""

    dry_run: bool = False
    objects: int = 0
    object_bytes: int = 0
    objects_kept: int = 0
    temporaries: int = 0
    kernels: int = 0
    kernel_bytes: int = 0
    kernels_kept: int = 0
    work_dirs: int = 0
    work_dir_bytes: int = 0
    tenant_jobs_released: int = 0
    deleted: list[str] = field(default_factory=list)

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        return (
            f"{verb} {self.objects} object(s) ({self.object_bytes} bytes; {self.objects_kept} "
            f"kept), {self.temporaries} temporary file(s), {self.kernels} kernel cache entr"
            f"{'y' if self.kernels == 1 else 'ies'} ({self.kernel_bytes} bytes; "
            f"{self.kernels_kept} kept), {self.work_dirs} attempt director"
            f"{'y' if self.work_dirs == 1 else 'ies'} ({self.work_dir_bytes} bytes)"
        )


def collect(conn: Redis, settings: Settings, *, dry_run: bool = False) -> Collected:
    """One garbage collection over the store, the kernel cache and the work directories."""
    now = time.time()
    older_than = now - settings.gc_min_age_s
    out = Collected(dry_run=dry_run)
    store = LocalStore.for_data_dir(settings.data_dir, fsync=settings.store_fsync)
    _collect_objects(conn, store, older_than, out)
    _collect_kernels(settings, now, older_than, out)
    _collect_work_dirs(conn, settings.data_dir / "work", older_than, out)
    if not dry_run:
        # the tenants' quota accounting forgets jobs whose records expired
        oldest = (now - jobs.record_ttl(settings)) * 1_000_000
        out.tenant_jobs_released = tenancy.reconcile(conn, jobs.record_key, jobs.TERMINAL, oldest)
        with conn.pipeline(transaction=False) as pipe:
            metrics.count_gc(pipe, "object", out.objects, out.object_bytes)
            metrics.count_gc(pipe, "kernel", out.kernels, out.kernel_bytes)
            metrics.count_gc(pipe, "work_dir", out.work_dirs, out.work_dir_bytes)
            metrics.count_gc(pipe, "temporary", out.temporaries, 0)
            pipe.execute()
    return out


# --- stored objects -----------------------------------------------------------------------------
def referenced_objects(conn: Redis) -> set[str]:
    """sha256 of every object a job record or a compile cache entry names."""
    refs: set[str] = set()
    for batch in _scan(conn, jobs.RECORD_PATTERN):
        with conn.pipeline(transaction=False) as pipe:
            for key in batch:
                pipe.hmget(key, list(jobs.OBJECT_FIELDS))
            for values in pipe.execute():
                refs.update(_text(v) for v in values if v)
    for batch in _scan(conn, jobs.CACHE_INDEX_PATTERN):
        for raw in conn.mget(batch):
            entry = jobs.parse_cache_entry(raw)
            if entry:
                refs.update((entry["artifact_sha256"], entry["report_sha256"]))
    return refs


def _collect_objects(conn: Redis, store: LocalStore, older_than: float, out: Collected) -> None:
    refs = referenced_objects(conn)
    for obj in store.objects():
        if obj.sha256 in refs or obj.mtime >= older_than:
            out.objects_kept += 1
            continue
        if out.dry_run or store.delete(obj.sha256, older_than=older_than):
            out.objects += 1
            out.object_bytes += obj.size
            out.deleted.append(f"object {obj.sha256}")
        else:
            out.objects_kept += 1
    for path in store.stale_temporaries(older_than):
        if not out.dry_run:
            path.unlink(missing_ok=True)
        out.temporaries += 1


# --- the kernel cache ---------------------------------------------------------------------------
@dataclass
class KernelEntry:
    """One cache key's files (entry, source, metadata, lock) in a kernel cache shard."""

    kind: str
    key: str
    files: list[Path]
    size: int
    last_used: float


def kernel_entries(root: Path) -> list[KernelEntry]:
    entries: list[KernelEntry] = []
    for kind, suffix in KERNEL_KINDS.items():
        base = root / kind
        if not base.is_dir():
            continue
        for shard in base.iterdir():
            groups: dict[str, list[Path]] = {}
            for path in shard.iterdir() if shard.is_dir() else ():
                groups.setdefault(path.name.split(".", 1)[0], []).append(path)
            for key, files in groups.items():
                size, last_used = 0, 0.0
                for path in files:
                    try:
                        st = path.stat()
                    except FileNotFoundError:
                        continue
                    size += st.st_size
                    used = max(st.st_mtime, st.st_atime) if path.suffix == suffix else st.st_mtime
                    last_used = max(last_used, used)
                entries.append(KernelEntry(kind, key, files, size, last_used))
    return entries


def _collect_kernels(settings: Settings, now: float, older_than: float, out: Collected) -> None:
    entries = kernel_entries(settings.resolved_kernel_cache_dir())
    entries.sort(key=lambda e: e.last_used)
    expired = now - settings.kernel_cache_ttl_s
    total = sum(e.size for e in entries)
    budget = settings.kernel_cache_max_bytes
    for entry in entries:  # least recently used first
        over_budget = budget > 0 and total > budget and entry.last_used < older_than
        if (entry.last_used < expired or over_budget) and _delete_kernel(entry, out.dry_run):
            total -= entry.size
            out.kernels += 1
            out.kernel_bytes += entry.size
            out.deleted.append(f"kernel {entry.kind}/{entry.key}")
        else:
            out.kernels_kept += 1


def _delete_kernel(entry: KernelEntry, dry_run: bool) -> bool:
    """Delete an entry's files under its build lock; False when a build holds the lock."""
    lock_path = next((p for p in entry.files if p.name == f"{entry.key}.lock"), None)
    if lock_path is None:
        if not dry_run:
            for path in entry.files:
                path.unlink(missing_ok=True)
        return True
    try:
        lock = lock_path.open("a")
    except FileNotFoundError:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # nvcc is building it right now
        if not dry_run:
            for path in entry.files:  # the lock last, while held
                if path != lock_path:
                    path.unlink(missing_ok=True)
            lock_path.unlink(missing_ok=True)
    return True


# --- attempt directories ------------------------------------------------------------------------
def _collect_work_dirs(conn: Redis, work: Path, older_than: float, out: Collected) -> None:
    """``work/<job>.<attempt>`` is live only while its record says that attempt is running."""
    if not work.is_dir():
        return
    for path in work.iterdir():
        job_id, _, attempt = path.name.partition(".")
        if not (jobs.is_job_id(job_id) and attempt.isdigit() and path.is_dir()):
            continue
        status, attempts = (
            _text(v) if v else None
            for v in conn.hmget(jobs.record_key(job_id), ["status", "attempts"])
        )
        running = status == "running" and attempts == attempt
        if running or path.stat().st_mtime >= older_than:
            continue
        size = _tree_size(path)
        if not out.dry_run:
            shutil.rmtree(path, ignore_errors=True)
        out.work_dirs += 1
        out.work_dir_bytes += size
        out.deleted.append(f"work {path.name}")


def _tree_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except FileNotFoundError:
                continue
    return total


# --- helpers ------------------------------------------------------------------------------------
def _scan(conn: Redis, pattern: str) -> Iterator[list[Any]]:
    cursor = 0
    while True:
        cursor, keys = conn.scan(cursor, match=pattern, count=SCAN_BATCH)
        if keys:
            yield keys
        if int(cursor) == 0:
            return


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- the periodic job ---------------------------------------------------------------------------
def maybe_enqueue(conn: Redis, queue: Queue, settings: Settings) -> str | None:
    """Enqueue a gc job when no worker did within ``gc_interval_s``: its RQ job id, or None."""
    if settings.gc_interval_s <= 0:
        return None
    if not conn.set(GC_LEASE_KEY, jobs.now_iso(), nx=True, ex=settings.gc_interval_s):
        return None
    job = queue.enqueue_call(
        GC_TASK,
        job_id=f"gc-{uuid.uuid4().hex}",
        timeout=GC_JOB_TIMEOUT_S,
        result_ttl=GC_RESULT_TTL_S,
        failure_ttl=GC_RESULT_TTL_S,
        description="garbage collection (service.retention)",
    )
    return str(job.id)


# --- `stackfuse gc` -------------------------------------------------------------------------------
def add_cli(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gc",
        help="delete stored objects no job names, unused kernels and dead attempt directories",
        description="Runs the collection the workers run every STACKFUSE_GC_INTERVAL_S: objects "
        "no job record or cache entry names, kernel cache entries unused for "
        "STACKFUSE_KERNEL_CACHE_TTL_S (then beyond STACKFUSE_KERNEL_CACHE_MAX_BYTES), attempt "
        "directories of attempts that are over; nothing younger than STACKFUSE_GC_MIN_AGE_S.",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--verbose", "-v", action="store_true", help="name every deleted item")
    p.set_defaults(func=_cmd_gc)


def _cmd_gc(args: argparse.Namespace, settings: Settings) -> int:
    from redis import Redis
    from redis.exceptions import RedisError

    try:
        with Redis.from_url(settings.redis_url, socket_connect_timeout=5) as conn:
            result = collect(conn, settings, dry_run=args.dry_run)
    except RedisError as exc:
        # the URL may carry a password: not printed
        print(f"stackfuse: error: Redis does not answer ({type(exc).__name__})", file=sys.stderr)
        return 3  # service.cli.EXIT_INFRA
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return 0
    if args.verbose:
        for item in result.deleted:
            print(item)
    print(result.summary())
    return 0
