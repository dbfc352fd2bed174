"""The HTTP API against a real Redis and a real uvicorn process; no worker needed.

Covers the request side of issue #3: 202 + Location, the problem+json answer for every class of
bad request (413 with and without Content-Length and with a lying one, 400, 415, 422, 404, 405),
idempotency, 409 while a job is unfinished, health/readiness, OpenAPI, and that the API process
never loads TVM.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import ApiProcess, RedisServer

PROBLEM = "application/problem+json"
LIMIT = 2 * 1024 * 1024  # STACKFUSE_MAX_BODY_BYTES of the session's API


def body(module: str = '{"root_index": 0}', **extra: object) -> dict[str, object]:
    return {"module": module, **extra}


def assert_problem(r: httpx.Response, status: int, type_: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM
    problem = r.json()
    assert problem["type"] == f"https://stackfuse.dev/problems/{type_}"
    assert problem["status"] == status
    assert problem["title"] and problem["detail"]
    return problem


# --- submit -----------------------------------------------------------------------------------
def test_submit_answers_202_with_job_location_and_retry_after(
    client: httpx.Client, redis_server: RedisServer, fresh_module: Callable[[], str]
) -> None:
    module = fresh_module()
    r = client.post("/optimize", json=body(module, target={"arch": "sm_80"}))
    assert r.status_code == 202
    job = r.json()
    assert r.headers["location"] == f"/jobs/{job['id']}"
    assert int(r.headers["retry-after"]) >= 1
    assert job["status"] == "queued" and job["cached"] is False and job["attempts"] == 0
    assert job["target"] == {"arch": "sm_80"}
    assert job["links"] == {"self": f"/jobs/{job['id']}", "artifact": None, "report": None}

    got = client.get(r.headers["location"])
    assert got.status_code == 200 and got.json()["id"] == job["id"]
    assert "retry-after" in got.headers

    # the RQ job carries ids and hashes only, serialized as JSON (not pickle)
    rq = redis_server.client()
    import zlib

    data = json.loads(zlib.decompress(rq.hget(f"rq:job:{job['id']}", "data")))
    func, _, args, _ = data
    assert func == "worker.tasks.compile_job"
    assert args[0] == job["id"] and args[1] == job["input_sha256"]
    assert len(json.dumps(args)) < 1000  # no module text in the queue


@pytest.mark.parametrize("kind", ["artifact", "report"])
def test_artifact_and_report_are_409_while_queued(
    client: httpx.Client, kind: str, fresh_module: Callable[[], str]
) -> None:
    job = client.post("/optimize", json=body(fresh_module())).json()
    r = client.get(f"/jobs/{job['id']}/{kind}")
    assert_problem(r, 409, "not-ready")


# --- bad requests: one problem+json per class ---------------------------------------------------
def test_not_json_is_400(client: httpx.Client) -> None:
    r = client.post(
        "/optimize", content=b'{"module": ', headers={"content-type": "application/json"}
    )
    assert "line 1" in str(assert_problem(r, 400, "malformed-json")["detail"])


def test_wrong_content_type_is_415(client: httpx.Client) -> None:
    r = client.post("/optimize", content=json.dumps(body()), headers={"content-type": "text/plain"})
    assert_problem(r, 415, "unsupported-media-type")
    r = client.post("/optimize", content=json.dumps(body()))  # no Content-Type at all
    assert_problem(r, 415, "unsupported-media-type")


def test_an_empty_or_non_json_module_says_what_is_wrong_with_module(
    client: httpx.Client,
) -> None:
    problem = assert_problem(client.post("/optimize", json=body("")), 422, "invalid-request")
    assert "module" in str(problem["detail"]) and "JSON" not in str(problem["title"])
    problem = assert_problem(client.post("/optimize", json=body("not json")), 422, "invalid-module")
    assert str(problem["detail"]).startswith("'module' is not TVM JSON")
    assert "tvmscript" in str(problem["detail"])


def test_unknown_target_is_422(client: httpx.Client) -> None:
    r = client.post("/optimize", json=body(target={"arch": "sm_75"}))
    problem = assert_problem(r, 422, "unknown-target")
    assert "sm_75" in str(problem["detail"]) and "sm_90" in problem["supported"]  # type: ignore[operator]


@pytest.mark.parametrize(
    "payload",
    [
        [1, 2],
        {"modul": "x"},
        {"module": 5},
        {"module": "x", "options": {"nope": 1}},
        {"module": "x", "format": "onnx"},
    ],
)
def test_wrong_shape_is_422(client: httpx.Client, payload: object) -> None:
    assert_problem(client.post("/optimize", json=payload), 422, "invalid-request")


@pytest.mark.parametrize(
    ("module", "type_"),
    [
        ('{"root_index": 0}', "invalid-module"),
        ("[1, 2", "invalid-module"),  # the body is JSON; the module in it is not
        ('{"root_index": 0, "nodes": [{"type": "tirx.PrimFunc"}]}', "forbidden-construct"),
    ],
)
def test_structurally_bad_tvm_json_is_refused_up_front(
    client: httpx.Client, redis_server: RedisServer, module: str, type_: str
) -> None:
    before = redis_server.client().llen("rq:queue:stackfuse")
    r = client.post("/optimize", json=body(module))
    assert r.status_code in (400, 413, 422)
    assert_problem(r, r.status_code, type_)
    assert redis_server.client().llen("rq:queue:stackfuse") == before  # nothing enqueued


@pytest.mark.parametrize("job_id", ["0" * 32, "not-a-job", "../../etc"])
def test_unknown_job_is_404(client: httpx.Client, job_id: str) -> None:
    for path in ("", "/artifact", "/report"):
        assert_problem(client.get(f"/jobs/{job_id}{path}"), 404, "not-found")


def test_unknown_route_and_method_are_problems(client: httpx.Client) -> None:
    assert_problem(client.get("/nowhere"), 404, "not-found")
    assert_problem(client.delete("/optimize"), 405, "method-not-allowed")


def test_oversize_body_with_content_length_is_413(client: httpx.Client) -> None:
    r = client.post("/optimize", json=body("x" * (LIMIT + 10)))
    assert "limit" in str(assert_problem(r, 413, "payload-too-large")["detail"])


# Raw sockets: httpx always frames bodies correctly; these clients do not.
def _raw(api: ApiProcess, head: bytes, chunks: Iterable[bytes]) -> bytes:
    sock = socket.create_connection(("127.0.0.1", api.port), timeout=30)
    try:
        sock.sendall(head)
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all: what we want
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        return data
    finally:
        sock.close()


def _parse(raw: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers["content-length"])
    return status, headers, json.loads(rest[:length])


def _chunked(total: int, size: int = 64 * 1024) -> Iterable[bytes]:
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        sent += n
        yield b"%x\r\n" % n + b"a" * n + b"\r\n"
    yield b"0\r\n\r\n"


POST = b"POST /optimize HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"


def test_chunked_body_without_content_length_is_413(api: ApiProcess) -> None:
    raw = _raw(api, POST + b"Transfer-Encoding: chunked\r\n\r\n", _chunked(LIMIT * 3))
    status, headers, problem = _parse(raw)
    assert status == 413 and headers["content-type"] == PROBLEM
    assert problem["type"] == "https://stackfuse.dev/problems/payload-too-large"


def test_declared_oversize_is_413_before_the_body_is_read(api: ApiProcess) -> None:
    raw = _raw(api, POST + b"Content-Length: %d\r\n\r\n" % (LIMIT * 50), [b'{"module": "'])
    status, _, problem = _parse(raw)
    assert status == 413 and "Content-Length" in str(problem["detail"])


def test_lying_content_length_is_a_400_problem(api: ApiProcess) -> None:
    # declares 12 bytes, sends far more: the server reads 12, and the rest is not HTTP
    payload = json.dumps(body("y" * 5000)).encode()
    raw = _raw(api, POST + b"Content-Length: 12\r\n\r\n", [payload])
    status, headers, problem = _parse(raw)
    assert status == 400 and headers["content-type"] == PROBLEM
    assert str(problem["type"]).startswith("https://stackfuse.dev/problems/")


# --- idempotency ------------------------------------------------------------------------------
def test_idempotency_key_same_body_same_job(
    client: httpx.Client, fresh_module: Callable[[], str]
) -> None:
    h = {"Idempotency-Key": "idem-same-1"}
    module = fresh_module()
    first = client.post("/optimize", json=body(module), headers=h)
    again = client.post("/optimize", json=body(module), headers=h)
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    # without the key, the same body is a new job
    assert client.post("/optimize", json=body(module)).json()["id"] != first.json()["id"]


def test_idempotency_key_different_body_is_422(
    client: httpx.Client, fresh_module: Callable[[], str]
) -> None:
    h = {"Idempotency-Key": "idem-diff-1"}
    module = fresh_module()
    first = client.post("/optimize", json=body(module), headers=h).json()
    r = client.post("/optimize", json=body(module, target={"arch": "sm_80"}), headers=h)
    assert assert_problem(r, 422, "idempotency-conflict")["job_id"] == first["id"]


def test_idempotency_key_concurrent_requests_make_one_job(
    api: ApiProcess, fresh_module: Callable[[], str]
) -> None:
    module = fresh_module()

    def submit(_: int) -> str:
        with api.client() as c:
            r = c.post("/optimize", json=body(module), headers={"Idempotency-Key": "race-1"})
            assert r.status_code == 202, r.text
            return str(r.json()["id"])

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(submit, range(16)))
    assert len(ids) == 1


def test_idempotency_key_too_long_is_400(client: httpx.Client) -> None:
    r = client.post("/optimize", json=body(), headers={"Idempotency-Key": "k" * 300})
    assert_problem(r, 400, "bad-request")


# --- health, docs, no TVM ---------------------------------------------------------------------
def test_healthz_and_openapi(client: httpx.Client) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {
        "/optimize",
        "/jobs/{job_id}",
        "/jobs/{job_id}/artifact",
        "/jobs/{job_id}/report",
        "/healthz",
        "/readyz",
    } <= set(paths)
    schema = paths["/optimize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "module" in schema["properties"]
    assert "sm_90" in schema["properties"]["target"]["description"]  # the default, documented


def test_readyz_needs_a_live_worker_and_redis(
    start_api: Callable[..., ApiProcess], fresh_module: Callable[[], str]
) -> None:
    lonely = start_api(STACKFUSE_QUEUE_NAME="nobody-listens")
    with lonely.client() as c:
        problem = assert_problem(c.get("/readyz"), 503, "infrastructure-error")
        assert "worker" in str(problem["detail"])
    dead = start_api(STACKFUSE_REDIS_URL="redis://127.0.0.1:1/0")
    with dead.client() as c:
        assert_problem(c.get("/readyz"), 503, "infrastructure-error")
        assert c.get("/healthz").status_code == 200  # the process itself is fine
        r = c.post("/optimize", json=body(fresh_module()))
        assert_problem(r, 503, "infrastructure-error")


def test_the_api_process_never_loads_tvm(
    api: ApiProcess, client: httpx.Client, fresh_module: Callable[[], str]
) -> None:
    assert client.post("/optimize", json=body(fresh_module())).status_code == 202
    maps = Path(f"/proc/{api.proc.pid}/maps").read_text()
    assert "libtvm" not in maps
    assert "site-packages/tvm" not in maps
