"""Run a tool (nvcc, the linker, a validation child) as a contained subprocess.

Each run gets a wall-clock timeout, rlimits (CPU seconds, memory, file size, open files, core
dumps off), its own session and process group (killed whole on timeout and again when the tool
exits, so no grandchild outlives it), ``PR_SET_PDEATHSIG`` (the tool dies with the worker that
started it), ``PR_SET_NO_NEW_PRIVS`` (no setuid gain), umask 077, a bounded capture of its output,
and an environment holding only what the tool needs: no secrets such as REDIS_URL reach it.
Output sent back to clients goes through :func:`excerpt`, which keeps only diagnostics about
files the job itself generated.

What this does not do (see SECURITY.md): namespaces or seccomp. A tool that calls ``setsid()``
leaves the process group, and the filesystem is the worker's; run workers in a container.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.errors import TimeLimitExceeded

#: Environment variables a tool may inherit; everything else is dropped.
_PASS_ENV = ("PATH", "LANG", "LC_ALL", "TMPDIR", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")

MiB = 1024 * 1024

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
# Resolved before any fork: a child between fork and exec must not load libraries.
try:
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None


@dataclass(frozen=True)
class Limits:
    """What one run may use. ``None`` leaves a limit as the worker has it."""

    timeout_s: float
    cpu_s: int | None = None
    memory_bytes: int | None = None
    file_bytes: int | None = None
    #: ``address_space`` (RLIMIT_AS) for compilers; ``data`` (RLIMIT_DATA: heap and private
    #: writable mappings) for a process that initializes CUDA, which reserves far more address
    #: space than it uses and fails under RLIMIT_AS.
    memory_kind: Literal["address_space", "data"] = "address_space"
    open_files: int | None = 4096
    #: output kept from the tool (first and last halves); the rest is counted, not stored
    output_bytes: int = 4 * MiB


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    output: str
    seconds: float

    def describe(self) -> str:
        """The exit in words: ``exit 1``, ``killed by SIGXFSZ (file size limit)``..."""
        if self.returncode >= 0:
            return f"exit {self.returncode}"
        try:
            name = signal.Signals(-self.returncode).name
        except ValueError:
            name = f"signal {-self.returncode}"
        why = _SIGNAL_MEANING.get(name)
        return f"killed by {name}" + (f" ({why})" if why else "")


_SIGNAL_MEANING = {
    "SIGXCPU": "CPU time limit",
    "SIGXFSZ": "file size limit",
    "SIGKILL": "killed",
    "SIGSEGV": "crashed",
    "SIGABRT": "aborted",
    "SIGBUS": "crashed",
}


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's PATH/locale/TMPDIR/LD_LIBRARY_PATH/CUDA_VISIBLE_DEVICES, plus ``extra``."""
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    if extra:
        env.update(extra)
    return env


def _limiter(limits: Limits) -> Callable[[], None]:
    """Runs in the child between fork and exec: only syscalls, nothing that allocates much."""

    def apply() -> None:
        os.umask(0o077)
        if _prctl is not None:
            _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limits.cpu_s is not None:
            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
        if limits.memory_bytes is not None:
            kind = (
                resource.RLIMIT_AS
                if limits.memory_kind == "address_space"
                else (resource.RLIMIT_DATA)
            )
            resource.setrlimit(kind, (limits.memory_bytes, limits.memory_bytes))
        if limits.file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        if limits.open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))

    return apply


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    limits: Limits,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    what: str = "tool",
) -> Completed:
    """Run ``argv`` to completion under ``limits``.

    Raises TimeLimitExceeded past the wall-clock timeout or the CPU limit. Any other exit,
    including a crash or another limit, is returned: the caller knows what the failure means
    (``Completed.describe()`` words it).
    """
    args = tuple(str(a) for a in argv)
    child_env = dict(env) if env is not None else clean_env()
    child_env.setdefault("HOME", str(cwd) if cwd is not None else "/nonexistent")
    started = time.monotonic()
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=child_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
        preexec_fn=_limiter(limits),
    )
    assert proc.stdout is not None
    capture = _Capture(limits.output_bytes)
    timed_out = False
    try:
        timed_out = not _pump(proc, capture, started + limits.timeout_s)
    finally:
        _kill_group(proc)
        _drain(proc, capture, grace_s=1.0)
        proc.stdout.close()
        proc.wait()
    seconds = time.monotonic() - started
    if timed_out:
        raise TimeLimitExceeded(
            f"{what} ran past its {limits.timeout_s:g} s limit and was stopped",
            limit_seconds=limits.timeout_s,
        )
    if proc.returncode == -signal.SIGXCPU:
        raise TimeLimitExceeded(
            f"{what} used more than its {limits.cpu_s} s of CPU time and was stopped",
            limit_cpu_seconds=limits.cpu_s,
        )
    return Completed(argv=args, returncode=proc.returncode, output=capture.text(), seconds=seconds)


def run_python(
    code: str,
    args: Sequence[str] = (),
    *,
    limits: Limits,
    module: bool = False,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    what: str = "python child",
) -> Completed:
    """Run Python ``code`` (or ``-m code`` when ``module``) in a child under :func:`run`.

    Isolated mode (``-I``: no user site, no PYTHON* variables) with this repository and the
    worker's ``sys.path`` passed explicitly, so the child imports ``worker``/``service`` and the
    installed packages but nothing from the environment.
    """
    paths = [p for p in sys.path if p and Path(p).is_absolute()]
    repo = str(Path(__file__).resolve().parent.parent)
    boot = f"import sys; sys.path[:0] = {[repo, *paths]!r}; "
    if module:
        boot += f"import runpy; sys.argv[0] = {code!r}; runpy.run_module({code!r}, "
        boot += "run_name='__main__', alter_sys=True)"
    else:
        boot += f"exec(compile({code!r}, '<stackfuse-child>', 'exec'), {{'__name__': '__main__'}})"
    return run(
        [sys.executable, "-I", "-c", boot, *args], limits=limits, cwd=cwd, env=env, what=what
    )


class _Capture:
    """Keeps the first and last ``limit // 2`` bytes; counts what falls between."""

    def __init__(self, limit: int) -> None:
        self.half = max(1, limit // 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            extra = len(self.tail) - self.half
            if extra > 0:
                self.dropped += extra
                del self.tail[:extra]

    def text(self) -> str:
        middle = f"\n[... {self.dropped} bytes of output dropped ...]\n" if self.dropped else ""
        data = bytes(self.head).decode("utf-8", "replace") + middle
        return data + bytes(self.tail).decode("utf-8", "replace")


def _pump(proc: subprocess.Popen[bytes], capture: _Capture, deadline: float) -> bool:
    """Read output until the tool exits; False if the deadline passed first."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return proc.poll() is not None
            for _ in sel.select(timeout=min(left, 0.2)):
                chunk = _read(fd)
                if chunk:
                    capture.add(chunk)
                elif chunk == b"":  # EOF: every writer closed the pipe
                    try:
                        proc.wait(timeout=max(0.01, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        return False
                    return True
            if proc.poll() is not None:
                return True


def _drain(proc: subprocess.Popen[bytes], capture: _Capture, grace_s: float) -> None:
    """Collect what is left in the pipe; stop at EOF or after ``grace_s`` (a writer that
    escaped the process group may hold the pipe open)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    end = time.monotonic() + grace_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < end:
            if not sel.select(timeout=max(0.0, end - time.monotonic())):
                return
            chunk = _read(fd)
            if not chunk:
                return
            capture.add(chunk)


def _read(fd: int) -> bytes | None:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the tool's whole process group (the tool is its leader: start_new_session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# --- what a client may see of a tool's output ------------------------------------------------

#: ``path:line[:col]: rest`` (gcc, clang, ld) or ``path(line): rest`` (nvcc/EDG)
_DIAG = re.compile(
    r"^(?P<path>[^\s:()\"']+)(?:\((?P<l1>\d+)\)|:(?P<l2>\d+)(?::\d+)?)?\s*:\s*(?P<rest>.*)$"
)
#: context lines that point at other files, whatever their indentation
_CONTEXT = re.compile(
    r"^\s*(detected during|instantiation of|required from|In file included|from |"
    r"in expansion of|note:)"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_QUOTED_LINES = 2
_LINE_CHARS = 300


def excerpt(output: str, allowed: Iterable[Path], *, limit: int = 2000) -> str:
    """The part of a tool's output fit to show a client.

    Compiler diagnostics quote source lines. Only diagnostics that name one of ``allowed`` (the
    job's own generated files, by full path or, when printed without a directory, by file
    name) are kept, with paths shortened to file names, each followed by at most two indented
    lines (the quoted line of that file and its caret). Every other line is dropped (diagnostics
    about other files, their quoted lines, include chains, instantiation contexts), so a hostile
    input cannot get a server file's content echoed back. Escape sequences and control
    characters are removed; lines are cut to 300 characters and the result to ``limit``.
    """
    names: dict[str, str] = {}
    for p in allowed:
        names[str(p)] = p.name
        names[os.path.normpath(str(p))] = p.name
        names[p.name] = p.name  # printed bare (the tool ran in the file's directory)
    kept: list[str] = []
    omitted = 0
    follow = 0
    for raw in output.splitlines():
        line = "".join(c for c in _ANSI.sub("", raw) if c.isprintable() or c == "\t")
        m = _DIAG.match(line)
        path = m.group("path") if m else None
        if m and path in names:
            lineno = m.group("l1") or m.group("l2") or "?"
            kept.append(f"{names[path]}:{lineno}: {m.group('rest')}"[:_LINE_CHARS])
            follow = _QUOTED_LINES
        elif follow and line[:1] in (" ", "\t") and not _CONTEXT.match(line) and not m:
            kept.append(line[:_LINE_CHARS])
            follow -= 1
        else:
            follow = 0
            if line.strip():
                omitted += 1
    if not kept:
        return "(no diagnostics about the generated source)"
    if omitted:
        kept.append(f"({omitted} lines about other files or without a location omitted)")
    text = "\n".join(kept)
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."
