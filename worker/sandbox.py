"""Run a tool (nvcc, the linker, a validation child) as a contained subprocess.

Each run gets a wall-clock timeout, rlimits (CPU seconds, address space, file size, core dumps
off), its own process group (killed whole on timeout), and an environment holding only what the
tool needs: no secrets such as REDIS_URL reach it. Output sent back to clients goes through
:func:`excerpt`, which keeps only lines about files the job itself generated.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from service.errors import TimeLimitExceeded

#: Environment variables a tool may inherit; everything else is dropped.
_PASS_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    cpu_s: int | None = None
    memory_bytes: int | None = None
    file_bytes: int | None = None


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    output: str
    seconds: float


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    if extra:
        env.update(extra)
    return env


def _limiter(limits: Limits):  # type: ignore[no-untyped-def]
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limits.cpu_s is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
        if limits.memory_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        if limits.file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))

    return apply


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    limits: Limits,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    what: str = "tool",
) -> Completed:
    """Run ``argv`` to completion under ``limits``; raise TimeLimitExceeded past the timeout.

    A non-zero exit is returned, not raised: the caller knows what the failure means.
    """
    import time

    args = tuple(str(a) for a in argv)
    started = time.monotonic()
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=dict(env) if env is not None else clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_limiter(limits),
    )
    try:
        out, _ = proc.communicate(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise TimeLimitExceeded(
            f"{what} ran past its {limits.timeout_s:.0f} s limit and was stopped",
            limit_seconds=limits.timeout_s,
        ) from None
    return Completed(
        argv=args,
        returncode=proc.returncode,
        output=out.decode("utf-8", errors="replace"),
        seconds=time.monotonic() - started,
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def excerpt(output: str, allowed: Iterable[Path], *, limit: int = 2000) -> str:
    """The part of a tool's output fit to show a client.

    Compiler diagnostics quote source lines. Only diagnostics that name one of ``allowed`` (the
    job's own generated files) are kept, with paths shortened to their file names; any quoted
    line of any other file is dropped, so a hostile input cannot get a server file's content
    echoed back. The result is cut to ``limit`` characters.
    """
    names = {str(p): p.name for p in allowed}
    diag = re.compile(r"^(?P<path>[^\s:()]+)(?:\((?P<l1>\d+)\)|:(?P<l2>\d+)(?::\d+)?)?\s*:\s*(?P<rest>.*)$")
    kept: list[str] = []
    keep_following = False
    for line in output.splitlines():
        m = diag.match(line)
        if m and m.group("path") in names:
            lineno = m.group("l1") or m.group("l2") or "?"
            kept.append(f"{names[m.group('path')]}:{lineno}: {m.group('rest')}")
            keep_following = True
        elif m and ("/" in m.group("path") or m.group("path").endswith((".h", ".hpp", ".cu", ".cuh", ".cc"))):
            keep_following = False
        elif keep_following and line.strip().startswith(("^", "detected during", "instantiation")):
            continue
        elif keep_following and line.startswith(" "):
            # a quoted line of our own generated source: harmless, helps a reader
            kept.append(line[:200])
    text = "\n".join(kept)
    return text[:limit] if text else "(no diagnostics about the generated source)"
