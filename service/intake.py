"""A POST /optimize body, from bytes to a checked submission, and where that work runs.

Each step bounds the next: the body's own JSON is measured (:func:`service.wire.check_json_shape`:
depth, values, digits) before ``json.loads``; then the request schema; then the module: TVM JSON
through :mod:`service.wire` (measured, parsed, graph-checked), TVMScript by size and by the
worker's AST allow-list (:mod:`worker.tvmscript_allowlist`, which imports no TVM); then hashing.

Every step is CPU-bound and most are single C calls over the whole body (regex, ``json.loads``,
``ast.parse``) that hold the GIL for their duration, so a thread would still stall the event
loop. Bodies over ``parse_in_process_bytes`` are therefore spooled to a temporary file as they
arrive (:class:`Spool`) and decoded in a child process (:class:`Offload`): the API's event loop
only moves bytes, holds none of a large body, and ``/healthz`` answers meanwhile. The child runs
under ``RLIMIT_AS`` (``parse_memory_bytes``), so a body that costs too much to parse
is a 413, not a machine out of memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import resource
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from pydantic import ValidationError

from service import jobs
from service.errors import (
    InfrastructureError,
    InputError,
    InvalidRequest,
    LimitExceeded,
    MalformedJSON,
    UnknownTarget,
)
from service.schemas import OptimizeRequest
from service.settings import Settings
from service.spec import SUPPORTED_ARCHS
from service.wire import check_json_shape, check_module_json

log = logging.getLogger("stackfuse.api")

#: The body's own JSON is ``{"module", "format", "target": {"arch"}, "options": {...}}``: two
#: levels and under 20 values; these bounds refuse anything else before ``json.loads`` runs.
BODY_MAX_DEPTH = 4
BODY_MAX_VALUES = 64
_MISSING = object()


def decode(
    body: bytes | bytearray, settings: Settings, toolchain: str
) -> tuple[jobs.Submission, bytes]:
    """Parse, validate and hash one POST /optimize body; raise a StackfuseError (4xx) else."""
    try:
        check_json_shape(
            body,
            max_depth=BODY_MAX_DEPTH,
            max_values=BODY_MAX_VALUES,
            what="the request body",
            number_error=InvalidRequest,
        )
    except LimitExceeded as exc:
        raise InvalidRequest(
            f"{exc.message}: POST /optimize takes an object with 'module', 'format', 'target' "
            "and 'options'",
            limit=exc.detail["limit"],
            actual=exc.detail["actual"],
        ) from None
    try:  # UTF-8 only (RFC 8259): json.loads of bytes would also take UTF-16 and UTF-32
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedJSON(f"the body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    del body  # the child's copy is freed here (the caller holds none)
    try:
        data = json.loads(text)
        del text
    except json.JSONDecodeError as exc:
        raise MalformedJSON(
            f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (RecursionError, ValueError) as exc:  # backstops: the shape check refuses both
        raise InvalidRequest(f"the body cannot be parsed: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(
            f"the body must be a JSON object with a 'module' string, not a {type(data).__name__}"
        )
    module = data.pop("module", _MISSING)
    request = _request(data, module)
    del data
    assert isinstance(module, str)  # the schema said so
    try:
        module_bytes = module.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("'module' contains unpaired UTF-16 surrogates") from None
    del module  # the bytes are what is checked, hashed and stored
    if request.format == "tvm-json":
        # the structural check of the TVM JSON graph, without TVM (InputError: 413/422)
        try:
            check_module_json(module_bytes, settings)
        except MalformedJSON as exc:  # the body parsed; what is not JSON is the module in it
            raise InputError(
                f"'module' is not TVM JSON (tvm.ir.save_json of a Relax module): {exc.message}; "
                'for TVMScript text send "format": "tvmscript"'
            ) from None
    else:
        check_script(module_bytes, settings)
    return jobs.prepare(request, module_bytes, toolchain), module_bytes


def _request(data: dict[str, object], module: object) -> OptimizeRequest:
    """The request, validated with the module string's first character standing in for it (the
    schema would copy it; one character keeps its length check); anything else in its place is
    left for the schema to name."""
    if module is not _MISSING:
        data["module"] = module[:1] if isinstance(module, str) else module
    try:
        return OptimizeRequest.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]
        if any(e["loc"] and e["loc"][0] == "target" for e in errors):
            raise UnknownTarget(
                f"unknown target {json.dumps(data.get('target'))[:200]}; "
                f"supported archs: {', '.join(SUPPORTED_ARCHS)}",
                supported=list(SUPPORTED_ARCHS),
                errors=errors,
            ) from None
        raise InvalidRequest(
            "the body does not have the shape POST /optimize takes: "
            + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors),
            errors=errors,
        ) from None


def check_script(module_bytes: bytes, settings: Settings) -> None:
    """TVMScript, checked as the worker will before TVM's parser sees it: size, UTF-8, then the
    AST allow-list (which bounds depth: ``max_script_depth``). Nothing is evaluated."""
    from worker.tvmscript_allowlist import validate_tvmscript

    if len(module_bytes) > settings.max_script_bytes:
        raise LimitExceeded(
            f"TVMScript is {len(module_bytes)} bytes; the limit is {settings.max_script_bytes} "
            "(setting max_script_bytes)",
            setting="max_script_bytes",
            limit=settings.max_script_bytes,
            actual=len(module_bytes),
        )
    try:
        text = module_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"TVMScript is not UTF-8 (byte {exc.start})") from None
    validate_tvmscript(text, settings)


# --- where it runs --------------------------------------------------------------------------
def _child_init(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def _decode_file(path: str, settings: Settings, toolchain: str) -> tuple[jobs.Submission, str]:
    """In the child: decode the spooled body at ``path``; the module's bytes go to a file beside
    it (``<path>.module``), which the API reads back, instead of through the result pipe."""
    try:
        sub, module_bytes = decode(Path(path).read_bytes(), settings, toolchain)
    except MemoryError:
        raise LimitExceeded(
            f"checking this body needs more than {settings.parse_memory_bytes} bytes of memory "
            "(setting parse_memory_bytes)",
            setting="parse_memory_bytes",
            limit=settings.parse_memory_bytes,
        ) from None
    out = path + ".module"
    Path(out).write_bytes(module_bytes)
    return sub, out


class Spool:
    """A request body as it streams in: in memory up to ``limit`` bytes, then in a temporary
    file (``TMPDIR``), so a large body is never held in the API process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = bytearray()
        self.size = 0
        self.path: str | None = None
        self._fd: int | None = None

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._fd is None and self.size <= self.limit:
            self.buffer += chunk
            return
        if self._fd is None:
            self._fd, self.path = tempfile.mkstemp(prefix="stackfuse-body-")
            self._write_all(bytes(self.buffer))
            self.buffer = bytearray()
        self._write_all(chunk)

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def finish(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self.finish()
        if self.path is not None:
            for name in (self.path, self.path + ".module"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
            self.path = None


class Offload:
    """A pool of child processes that decode large bodies, one per API process, started on
    first use (``forkserver``: a clean interpreter, not a fork of the event loop's process)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.settings.parse_processes,
                mp_context=multiprocessing.get_context("forkserver"),
                initializer=_child_init,
                initargs=(self.settings.parse_memory_bytes,),
                # a child that parsed a large body keeps its heap; replacing it returns that
                max_tasks_per_child=self.settings.parse_tasks_per_process,
            )
        return self._pool

    async def decode(self, path: str, toolchain: str) -> tuple[jobs.Submission, bytes]:
        """Decode the spooled body at ``path`` in a child; the module bytes come back."""
        loop = asyncio.get_running_loop()
        try:
            # submit() from a thread: it starts child processes when the pool has none idle
            # (the first one also the forkserver), which blocks for as long as that takes
            future = await loop.run_in_executor(
                None, self._executor().submit, _decode_file, path, self.settings, toolchain
            )
            sub, module_path = await asyncio.wrap_future(future)
            module_bytes = await loop.run_in_executor(None, Path(module_path).read_bytes)
            return sub, module_bytes
        except BrokenProcessPool:
            log.warning("a body-decoding child process died; starting a new pool")
            self.close()
            raise InfrastructureError(
                "the process checking this request died; retry, or send a smaller module"
            ) from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
