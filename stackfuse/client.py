"""The Python client of the Stackfuse API (httpx; never imports TVM, the worker or torch).

    import stackfuse

    client = stackfuse.Client()                    # $STACKFUSE_URL, else the local `serve`
    job = client.submit("model.json", target="sm_90")
    job.wait(progress=print)                       # raises JobFailed if the job fails
    library, report = job.download("out/")        # out/stackfuse-<job>.so, out/report.json

Every error is a :mod:`stackfuse.errors` exception.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from stackfuse import errors

#: seconds one HTTP request may take (connect, each read); downloads stream within it
DEFAULT_TIMEOUT_S = 60.0
#: polls of :meth:`Job.wait` follow the server's Retry-After, kept within these bounds (seconds)
MIN_POLL_S, MAX_POLL_S = 0.5, 5.0
#: job statuses after which a job never changes again
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
#: the file `stackfuse serve` writes into its data dir: the API URL it listens at, and its pid
SERVE_STATE = "serve.json"
#: page size of :meth:`Client.list` (the API's default)
DEFAULT_PAGE = 50

ModuleSource = str | bytes | os.PathLike[str]


# --- where the API is -------------------------------------------------------------------------
def default_data_dir() -> Path:
    """``$STACKFUSE_DATA_DIR``, else the per-user default `stackfuse serve` uses."""
    from service.settings import default_data_dir as per_user  # pure Python, no TVM

    raw = os.environ.get("STACKFUSE_DATA_DIR")
    return Path(raw).absolute() if raw else per_user()


def served_url(data_dir: Path | None = None) -> str | None:
    """The URL a live ``stackfuse serve`` of ``data_dir`` wrote, if any."""
    import json

    try:
        state = json.loads(((data_dir or default_data_dir()) / SERVE_STATE).read_text())
        os.kill(int(state["pid"]), 0)
        return str(state["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def default_url(
    data_dir: Path | None = None, host: str | None = None, port: int | None = None
) -> str:
    """``$STACKFUSE_URL``, else the URL a running ``stackfuse serve`` wrote, else
    ``http://$STACKFUSE_API_HOST:$STACKFUSE_API_PORT`` (127.0.0.1:8000)."""
    host = host or os.environ.get("STACKFUSE_API_HOST") or "127.0.0.1"
    port = port or int(os.environ.get("STACKFUSE_API_PORT") or 8000)
    return os.environ.get("STACKFUSE_URL") or served_url(data_dir) or f"http://{host}:{port}"


# --- what a job looks like ------------------------------------------------------------------
@dataclass(frozen=True)
class Progress:
    """What :meth:`Job.wait` hands its ``progress`` callable at every poll."""

    job_id: str
    status: str
    stage: str
    detail: str
    #: 0.0 .. 1.0
    fraction: float
    #: seconds since the wait began
    elapsed: float

    def __str__(self) -> str:
        label = f"{self.status}: {self.stage} {self.detail}".strip()
        return f"[{self.elapsed:6.1f}s] {self.fraction * 100:5.1f}% {label}"


class Downloaded(NamedTuple):
    library: Path
    report: Path


class Page(NamedTuple):
    jobs: list[Job]
    next_cursor: str | None


class Job:
    """One job as the API last described it (``GET /jobs/{id}``); :meth:`refresh` asks again."""

    def __init__(self, client: Client, data: dict[str, Any]) -> None:
        self._client = client
        self.data: dict[str, Any] = data
        #: the Retry-After of the last answer about this job (seconds), if it sent one
        self._retry_after: float | None = None

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.status}>"

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def status(self) -> str:
        """queued, running, succeeded, failed or cancelled."""
        return str(self.data["status"])

    @property
    def stage(self) -> str:
        return str(self.data.get("stage", ""))

    @property
    def detail(self) -> str:
        return str(self.data.get("detail", ""))

    @property
    def fraction(self) -> float:
        return float(self.data.get("progress", 0.0))

    @property
    def cached(self) -> bool:
        """Answered from the compile cache: nothing was compiled for this job."""
        return bool(self.data.get("cached"))

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @property
    def error(self) -> dict[str, Any] | None:
        """Why the job failed (``type``, ``title``, ``message``), once it has."""
        err = self.data.get("error")
        return dict(err) if isinstance(err, dict) else None

    @property
    def links(self) -> dict[str, str | None]:
        return dict(self.data.get("links") or {})

    @property
    def artifact_sha256(self) -> str | None:
        return self.data.get("artifact_sha256")

    @property
    def url(self) -> str:
        """The job's own URL (absolute)."""
        return self._client.url + self._path("self")

    def _path(self, link: str) -> str:
        path = self.links.get(link)
        if link == "self" and not path:
            return f"/jobs/{self.id}"
        if not path:
            raise errors.Conflict(
                409,
                {
                    "type": errors.PROBLEM_BASE + "not-ready",
                    "title": "Not ready",
                    "detail": f"job {self.id} is {self.status}; it has no {link} (yet)",
                },
            )
        return path

    def refresh(self) -> Job:
        """Ask the API for the job's state now; returns the job itself."""
        response = self._client._request("GET", self._path("self"))
        self._retry_after = _retry_after(response)
        self.data = response.json()
        return self

    def wait(
        self,
        progress: Callable[[Progress], object] | None = None,
        timeout: float | None = None,
        poll: float | None = None,
    ) -> Job:
        """Poll until the job is finished; ``progress`` is called at every poll (and once at the
        end). Polls follow the server's Retry-After (within 0.5-5 s) unless ``poll`` (seconds)
        is given. Raises :class:`~stackfuse.errors.JobFailed` (or ``JobCancelled``) when the
        job ends without a library, :class:`~stackfuse.errors.Timeout` after ``timeout`` s."""
        started = time.monotonic()
        while True:
            if progress is not None:
                progress(self.progress(time.monotonic() - started))
            if self.done:
                break
            waited = time.monotonic() - started
            if timeout is not None and waited > timeout:
                raise errors.Timeout(
                    f"job {self.id} still {self.status} after {timeout:g} s "
                    f"({self.stage} {self.detail})".rstrip()
                )
            if poll is not None:
                pause = poll
            else:
                pause = min(max(self._retry_after or 1.0, MIN_POLL_S), MAX_POLL_S)
            if timeout is not None:
                pause = max(0.0, min(pause, timeout - waited + 0.01))
            time.sleep(pause)
            self.refresh()
        if self.status == "cancelled":
            raise errors.JobCancelled(self)
        if self.status == "failed":
            raise errors.JobFailed(self)
        return self

    def progress(self, elapsed: float = 0.0) -> Progress:
        return Progress(self.id, self.status, self.stage, self.detail, self.fraction, elapsed)

    def report(self) -> dict[str, Any]:
        """The fusion report (``worker.report.Report`` as JSON); also there for a failed job
        whose partitioning ran."""
        body = self._client._request("GET", self._path("report")).json()
        if not isinstance(body, dict):
            raise errors.StackfuseError(f"the report of job {self.id} is not a JSON object")
        return body

    def download(self, directory: str | os.PathLike[str]) -> Downloaded:
        """Write the library (under the server's download name, ``stackfuse-<job>.so``) and
        ``report.json`` into ``directory`` (made if missing); the library's sha256 is checked
        against the job's. Files appear whole or not at all."""
        if not self.links.get("artifact"):
            self.refresh()
        artifact = self._path("artifact")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        library = self._client._download(artifact, out, f"stackfuse-{self.id}.so")
        expected = self.artifact_sha256
        if expected and _sha256(library) != expected:
            library.unlink()
            raise errors.StackfuseError(
                f"the library of job {self.id} arrived damaged (sha256 is not {expected})"
            )
        report = self._client._download(self._path("report"), out, "report.json", "report.json")
        return Downloaded(library, report)

    def cancel(self) -> Job:
        """Cancel the job (queued or running); raises Conflict if it has already finished."""
        self.data = self._client.cancel(self.id).data
        return self


# --- the client -------------------------------------------------------------------------------
class Client:
    """A connection to one Stackfuse API. Use it as a context manager, or :meth:`close` it.

    ``url`` defaults to :func:`default_url`; ``api_key`` to ``$STACKFUSE_API_KEY`` (sent as
    ``Authorization: Bearer <key>``); ``timeout`` is seconds per HTTP request."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        key = api_key if api_key is not None else os.environ.get("STACKFUSE_API_KEY")
        headers = {"User-Agent": "stackfuse-client/0.1"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._http = httpx.Client(
            base_url=self.url, timeout=timeout, headers=headers, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def __repr__(self) -> str:
        return f"<stackfuse.Client {self.url}>"

    # --- requests ---------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; an error status or a transport failure raised as ours."""
        with _translated(self.url):
            response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise errors.from_response(response)
        return response

    def _download(self, path: str, out: Path, fallback: str, name: str | None = None) -> Path:
        """Stream ``path`` into ``out``, under ``name`` or the server's download name."""
        with _translated(self.url), self._http.stream("GET", path) as response:
            if response.status_code >= 400:
                response.read()
                raise errors.from_response(response)
            target = out / (name or _download_name(response, fallback))
            tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                with tmp.open("wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
        return target

    # --- the API ----------------------------------------------------------------------------
    def submit(
        self,
        module: ModuleSource,
        *,
        target: str | dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        format: str | None = None,
    ) -> Job:
        """Queue a compile of ``module`` and return its job (already finished when it was
        answered from the compile cache).

        ``module`` is a path (``pathlib.Path``, or a ``str`` naming a file) or the module
        itself: bytes, or a ``str`` that starts with ``{`` (TVM JSON) or spans lines
        (TVMScript). ``target`` is an arch (``"sm_80"``) or ``{"arch": ...}``; left out, the
        server builds for sm_90. ``format`` (``tvm-json`` or ``tvmscript``) defaults to what
        the text looks like. An ``idempotency_key`` makes a retried submit return the same job.
        """
        text = read_module(module)
        body: dict[str, Any] = {"module": text, "format": format or guess_format(text)}
        if target is not None:
            body["target"] = {"arch": target} if isinstance(target, str) else dict(target)
        if options is not None:
            body["options"] = options
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        response = self._request("POST", "/optimize", json=body, headers=headers)
        job = Job(self, response.json())
        job._retry_after = _retry_after(response)
        return job

    def job(self, job_id: str) -> Job:
        """The job ``job_id`` as the API describes it now."""
        return Job(self, {"id": job_id, "status": "queued"}).refresh()

    def page(self, limit: int = DEFAULT_PAGE, cursor: str | None = None) -> Page:
        """One page of this key's jobs (``GET /jobs``), newest first, and the cursor of the
        next page (None on the last)."""
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        body = self._request("GET", "/jobs", params=params).json()
        return Page([Job(self, j) for j in body.get("jobs", [])], body.get("next_cursor"))

    def list(self, limit: int = DEFAULT_PAGE, cursor: str | None = None) -> Iterator[Job]:
        """Every job of this key, page after page (``limit`` per page) from ``cursor``."""
        while True:
            page = self.page(limit, cursor)
            yield from page.jobs
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def cancel(self, job_id: str) -> Job:
        """``DELETE /jobs/{id}``: the job as cancelled; Conflict when it has already
        finished, NotFound when there is no such job."""
        return Job(self, self._request("DELETE", f"/jobs/{job_id}").json())


# --- helpers ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _translated(url: str) -> Iterator[None]:
    """httpx's transport errors as ours (the one boundary where they are turned)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise errors.Timeout(f"the API at {url} did not answer in time: {exc}") from exc
    except httpx.TransportError as exc:
        raise errors.ConnectionError(f"cannot reach the API at {url}: {exc}") from exc


def read_module(module: ModuleSource) -> str:
    """The module's text: read from a path, decoded from bytes, or the string itself."""
    if isinstance(module, bytes):
        return _decode(module, "the module")
    if isinstance(module, str) and (module.lstrip().startswith("{") or "\n" in module):
        return module
    path = Path(module)
    try:
        return _decode(path.read_bytes(), str(path))
    except OSError as exc:
        raise errors.StackfuseError(f"cannot read {path}: {exc.strerror or exc}") from None


def _decode(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.StackfuseError(f"{what} is not UTF-8 text: {exc}") from None


def guess_format(text: str) -> str:
    """``tvm-json`` for JSON (it starts with ``{``), else ``tvmscript``."""
    return "tvm-json" if text.lstrip().startswith("{") else "tvmscript"


_FILENAME = re.compile(r'filename="?([^";]+)"?')


def _download_name(response: httpx.Response, fallback: str) -> str:
    """The file name the server gave (Content-Disposition), if it is a plain one."""
    m = _FILENAME.search(response.headers.get("content-disposition", ""))
    name = m.group(1).strip() if m else ""
    if not name or name != Path(name).name or name.startswith("."):
        return fallback
    return name


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
