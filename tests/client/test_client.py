"""stackfuse.Client against the real API, Redis and RQ workers of the session (tests/conftest).

What the API cannot be made to answer yet (401, 429) comes from a small real HTTP server here,
which also shows the headers the client sends.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import stackfuse
from stackfuse import errors
from tests.conftest import ApiProcess, WorkerPool, add_fault


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def sf(api: ApiProcess) -> Iterator[stackfuse.Client]:
    with stackfuse.Client(api.url, timeout=30) as c:
        yield c


# --- the whole way: submit, wait with progress, download --------------------------------------
@pytest.mark.slow
@pytest.mark.nvcc
def test_submit_wait_download_and_report(
    sf: stackfuse.Client, workers: WorkerPool, fresh_module: Callable[[], str], tmp_path: Path
) -> None:
    model = tmp_path / "model.json"
    model.write_text(fresh_module())
    job = sf.submit(model, target="sm_90")  # a path
    assert job.status == "queued" and not job.cached
    seen: list[stackfuse.Progress] = []
    assert job.wait(progress=seen.append, timeout=600) is job
    assert job.status == "succeeded" and seen[-1].status == "succeeded"
    assert seen[-1].fraction == 1.0 and all(p.job_id == job.id for p in seen)
    elapsed = [p.elapsed for p in seen]
    assert elapsed == sorted(elapsed) and elapsed[-1] > 0
    assert len({(p.status, p.stage) for p in seen}) >= 2  # it saw the job move

    files = job.download(tmp_path / "out" / "nested")
    assert files.library.name == f"stackfuse-{job.id}.so"  # the server's download name
    assert hashlib.sha256(files.library.read_bytes()).hexdigest() == job.artifact_sha256
    assert files.report.name == "report.json"
    report = json.loads(files.report.read_text())
    assert report == job.report()
    assert report["summary"]["fused_stacked"] == 1
    assert report["library"]["file"] == files.library.name
    assert sorted(p.name for p in files.library.parent.iterdir()) == sorted(
        [files.library.name, "report.json"]
    )  # no partial files left behind

    again = sf.job(job.id)
    assert again.status == "succeeded" and again.data == job.data
    # the same module as text: answered from the compile cache, already finished
    cached = sf.submit(model.read_text(), target={"arch": "sm_90"})
    assert cached.cached and cached.status == "succeeded" and cached.id != job.id
    assert cached.wait(timeout=5).report()["cached"] is True


# --- failures a waiting client sees ---------------------------------------------------------
def test_a_failed_job_raises_jobfailed_and_a_slow_one_timeout(
    sf: stackfuse.Client,
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    fault_plan_file: Path,
) -> None:
    module = fresh_module()
    fault = {"sleep_s": 4, "raise": "compile-error", "at": "codegen"}
    add_fault(fault_plan_file, sha(module), **fault)
    job = sf.submit(module.encode())  # bytes
    with pytest.raises(errors.Timeout, match=f"job {job.id} still"):
        job.wait(timeout=1.0)
    assert not job.done
    with pytest.raises(errors.JobFailed) as failed:
        job.wait(timeout=120)
    assert failed.value.job is job and job.status == "failed"
    assert failed.value.error["type"] == "compile-failed"
    assert "injected deterministic failure" in str(failed.value)
    assert job.report()["error"]  # partitioning ran, so a failed job has its report
    with pytest.raises(errors.Conflict) as conflict:
        job.download(Path(str(fault_plan_file) + ".out"))
    assert conflict.value.type == "not-ready"
    assert not Path(str(fault_plan_file) + ".out").exists()


def test_problems_become_the_exceptions_of_their_family(
    sf: stackfuse.Client, fresh_module: Callable[[], str]
) -> None:
    with pytest.raises(errors.BadRequest) as bad:
        sf.submit(fresh_module(), target="sm_75")
    e = bad.value
    assert (e.status, e.type, e.title) == (422, "unknown-target", "Unknown target")
    assert "sm_80" in e.detail and e.problem["status"] == 422
    assert isinstance(e, errors.APIError) and isinstance(e, stackfuse.StackfuseError)

    with pytest.raises(errors.InvalidModule) as invalid:
        sf.submit("{}")
    assert invalid.value.type == "invalid-module" and isinstance(invalid.value, errors.BadRequest)

    with pytest.raises(errors.PayloadTooLarge) as big:
        sf.submit('{"x": "' + "a" * (3 * 1024 * 1024) + '"}')  # over the session's 2 MiB
    assert big.value.status == 413

    with pytest.raises(errors.NotFound) as missing:
        sf.job("0" * 32)
    assert missing.value.status == 404 and missing.value.type == "not-found"

    queued = sf.submit(fresh_module(), target="sm_80")
    with pytest.raises(errors.Conflict) as early:
        sf._request("GET", f"/jobs/{queued.id}/artifact")
    assert early.value.type == "not-ready" and early.value.retry_after is not None

    with pytest.raises(errors.StackfuseError, match="cannot read"):
        sf.submit(Path("/nonexistent/model.json"))
    with pytest.raises(errors.StackfuseError, match="cannot read"):
        sf.submit("no-such-model.json")  # one line, not JSON: a path


def test_an_unreachable_api_is_a_connection_error(tmp_path: Path) -> None:
    with (
        stackfuse.Client("http://127.0.0.1:1") as c,
        pytest.raises(errors.ConnectionError, match=r"cannot reach the API at http://127\.0"),
    ):
        c.job("0" * 32)


def test_the_default_url_is_stackfuse_url_then_serve_then_host_and_port(
    api: ApiProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.cli import write_serve_state
    from service.settings import Settings

    for var in ("STACKFUSE_URL", "STACKFUSE_API_HOST", "STACKFUSE_API_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STACKFUSE_DATA_DIR", str(tmp_path))
    assert stackfuse.default_url() == "http://127.0.0.1:8000"
    monkeypatch.setenv("STACKFUSE_API_PORT", "8123")
    assert stackfuse.default_url() == "http://127.0.0.1:8123"
    write_serve_state(Settings(data_dir=tmp_path), api.url)  # a live serve (this pid)
    assert stackfuse.default_url() == api.url
    with stackfuse.Client() as c:
        assert c.url == api.url
        with pytest.raises(errors.NotFound):
            c.job("0" * 32)  # it answered
    monkeypatch.setenv("STACKFUSE_URL", "http://example.invalid:9")
    assert stackfuse.default_url() == "http://example.invalid:9"


# --- what the API does not answer yet: a small server of our own -------------------------------
class _Peer(BaseHTTPRequestHandler):
    """Answers each path as ``answers`` says and records the headers it got."""

    answers: dict[str, tuple[int, dict[str, str], dict[str, Any]]] = {}
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        self.seen.append({k.lower(): v for k, v in self.headers.items()})
        status, headers, body = self.answers.get(self.path, (404, {}, {"title": "Not found"}))
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/problem+json")
        self.send_header("Content-Length", str(len(raw)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def peer() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Peer.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _problem(slug: str, status: int, title: str) -> dict[str, Any]:
    return {"type": errors.PROBLEM_BASE + slug, "title": title, "status": status, "detail": "d"}


def test_the_api_key_is_sent_as_a_bearer_token_and_401_429_are_mapped(
    peer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Peer.answers = {
        "/jobs/a": (401, {}, _problem("unauthorized", 401, "Unauthorized")),
        "/jobs/b": (429, {"Retry-After": "7"}, _problem("rate-limited", 429, "Too many")),
        "/jobs/c": (503, {"Retry-After": "5"}, _problem("infrastructure-error", 503, "Down")),
        "/jobs/d": (502, {}, {"not": "a problem"}),
    }
    monkeypatch.setenv("STACKFUSE_API_KEY", "from-env")
    with stackfuse.Client(peer) as c:
        with pytest.raises(errors.Unauthorized) as unauthorized:
            c.job("a")
        assert unauthorized.value.type == "unauthorized" and unauthorized.value.status == 401
        with pytest.raises(errors.RateLimited) as limited:
            c.job("b")
        assert limited.value.retry_after == 7.0
        with pytest.raises(errors.ServerError) as down:
            c.job("c")
        assert down.value.retry_after == 5.0 and down.value.title == "Down"
        with pytest.raises(errors.ServerError) as odd:
            c.job("d")
        assert odd.value.title == "HTTP 502"
    assert {h.get("authorization") for h in _Peer.seen} == {"Bearer from-env"}
    _Peer.seen.clear()
    with stackfuse.Client(peer, api_key="explicit") as c, pytest.raises(errors.Unauthorized):
        c.job("a")
    assert _Peer.seen[-1]["authorization"] == "Bearer explicit"
    monkeypatch.delenv("STACKFUSE_API_KEY")
    with stackfuse.Client(peer) as c, pytest.raises(errors.Unauthorized):
        c.job("a")
    assert "authorization" not in _Peer.seen[-1]


# --- listing and cancelling (GET /jobs, DELETE /jobs/{id}) ------------------------------------
def test_list_pages_through_the_jobs(sf: stackfuse.Client, fresh_module: Callable[[], str]) -> None:
    mine = {sf.submit(fresh_module(), target="sm_80").id for _ in range(3)}
    first = sf.page(limit=2)
    assert len(first.jobs) <= 2 and all(isinstance(j, stackfuse.Job) for j in first.jobs)
    listed = [j.id for j in sf.list(limit=2)]
    assert mine <= set(listed) and len(listed) == len(set(listed))
    if first.next_cursor:
        second = sf.page(limit=2, cursor=first.next_cursor)
        assert not {j.id for j in second.jobs} & {j.id for j in first.jobs}


def test_cancel_a_queued_job_and_not_a_finished_one(
    sf: stackfuse.Client, fresh_module: Callable[[], str], fault_plan_file: Path
) -> None:
    module = fresh_module()
    add_fault(fault_plan_file, sha(module), sleep_s=30)
    job = sf.submit(module, target="sm_80")
    assert job.cancel() is job and job.status == "cancelled"
    with pytest.raises(errors.JobCancelled):
        job.wait(timeout=30)
    with pytest.raises(errors.Conflict):
        sf.cancel(job.id)
    with pytest.raises(errors.NotFound):
        sf.cancel("0" * 32)


@pytest.mark.slow
@pytest.mark.nvcc
def test_the_api_serves_the_report_page(
    sf: stackfuse.Client, workers: WorkerPool, fresh_module: Callable[[], str]
) -> None:
    job = sf.submit(fresh_module()).wait(timeout=600)
    r = sf._request("GET", f"/jobs/{job.id}/report.html")
    assert r.headers["content-type"].startswith("text/html")
    report = job.report()
    assert report["sites"][0]["verdict"] in r.text and "<svg" in r.text
    with pytest.raises(errors.NotFound):
        sf._request("GET", f"/jobs/{'0' * 32}/report.html")
    queued = sf.submit(fresh_module(), target="sm_80")
    with pytest.raises(errors.Conflict):
        sf._request("GET", f"/jobs/{queued.id}/report.html")
