"""The HTTP API against a real Redis and a real uvicorn process; no worker needed.

Covers the request side of issue #3: 202 + Location, the problem+json answer for every class of
bad request (413 with and without Content-Length and with a lying one, 400, 415, 422, 404, 405),
idempotency, 409 while a job is unfinished, health/readiness, OpenAPI, and that the API process
never loads TVM.
"""

from __future__ import annotations

import contextlib
import hashlib
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
    before = set(redis_server.client().lrange("rq:queue:stackfuse", 0, -1))
    r = client.post("/optimize", json=body(module))
    assert r.status_code in (400, 413, 422)
    assert_problem(r, r.status_code, type_)
    # nothing enqueued
    assert set(redis_server.client().lrange("rq:queue:stackfuse", 0, -1)) <= before


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


# --- hostile bodies (issue #33) ------------------------------------------------------------------
def _post_raw(client: httpx.Client, content: bytes) -> httpx.Response:
    return client.post("/optimize", content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 1000 + b"]" * 1000,  # Python's parser would recurse past its limit
        b'{"module": ' + b"1" * 4301 + b"}",  # int() refuses past 4,300 digits
        b'{"module": "x", "target": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # off-loop path
        b'{"module": "x", "options": {"a": [' + b"1," * 100 + b"1]}}",
    ],
    ids=["nested-arrays", "long-integer", "nested-in-a-large-body", "many-values"],
)
def test_hostile_outer_body_is_a_422_not_a_500(client: httpx.Client, content: bytes) -> None:
    assert_problem(_post_raw(client, content), 422, "invalid-request")


def _module_of_nested_arrays(size: int, depth: int = 40) -> str:
    block = "[" * depth + "]" * depth + ","
    return "[" + block * (size // len(block)) + "[]]"


def test_module_past_the_value_limit_is_refused_before_it_is_parsed(
    start_api: Callable[..., ApiProcess], redis_server: RedisServer
) -> None:
    """A module of nested arrays (the shape that cost ~46x its size to parse) is counted, not
    parsed; the check runs in the decoding child, and the API still answers /healthz after."""
    small = start_api(STACKFUSE_MAX_JSON_VALUES="100000")
    queued = redis_server.client()
    before = set(queued.lrange("rq:queue:stackfuse", 0, -1))
    with small.client() as c:
        r = c.post("/optimize", json=body(_module_of_nested_arrays(LIMIT // 2)))
        problem = assert_problem(r, 413, "limit-exceeded")
        assert problem["setting"] == "max_json_values" and problem["limit"] == 100_000
        deep = "[" * 65 + "]" * 65
        problem = assert_problem(c.post("/optimize", json=body(deep)), 413, "limit-exceeded")
        assert problem["setting"] == "max_json_depth" and problem["actual"] == 65
        assert c.get("/healthz").status_code == 200
    # nothing enqueued by the refused requests (earlier tests' jobs may leave the queue meanwhile)
    assert set(queued.lrange("rq:queue:stackfuse", 0, -1)) <= before


def test_large_bodies_are_spooled_and_the_spool_is_removed(
    start_api: Callable[..., ApiProcess], tmp_path: Path, fresh_module: Callable[[], str]
) -> None:
    """Bodies over parse_in_process_bytes go through a temporary file (and the decoding child)
    whether accepted or refused; no file is left behind."""
    spooling = start_api(TMPDIR=str(tmp_path))
    with spooling.client() as c:
        module = fresh_module() + " " * 40_000
        accepted = c.post("/optimize", json=body(module))
        assert accepted.status_code == 202, accepted.text
        assert c.get(accepted.headers["location"]).json()["input_sha256"] == (
            hashlib.sha256(module.encode()).hexdigest()
        )
        refused = c.post("/optimize", json=body("[" * 30_000 + "]" * 30_000))
        assert_problem(refused, 413, "limit-exceeded")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("stackfuse-body-")]


def test_a_body_the_decoding_child_cannot_afford_is_a_problem_not_a_crash(
    start_api: Callable[..., ApiProcess],
) -> None:
    """Under a tiny RLIMIT_AS the child fails (MemoryError: 413 naming parse_memory_bytes, or
    dies: 503); either way the API answers, and decodes the next large body with a new child."""
    starved = start_api(STACKFUSE_PARSE_MEMORY_BYTES=str(50 * 1024 * 1024))
    with starved.client() as c:
        module = "[" + ",".join(["[[1,2],[3,4]]"] * 120_000) + "]"
        r = c.post("/optimize", json=body(module))
        assert r.status_code in (413, 503) and r.headers["content-type"] == PROBLEM, r.text
        if r.status_code == 413:
            assert r.json()["setting"] == "parse_memory_bytes"
        assert c.get("/healthz").status_code == 200
        again = c.post("/optimize", json=body("[" * 70 + "]" * 70 + " " * 20_000))
        assert_problem(again, 413, "limit-exceeded")


def test_tvmscript_is_checked_at_the_api(
    start_api: Callable[..., ApiProcess], redis_server: RedisServer
) -> None:
    small = start_api(STACKFUSE_MAX_SCRIPT_BYTES="4096")
    before = set(redis_server.client().lrange("rq:queue:stackfuse", 0, -1))
    with small.client() as c:
        big = body("# padding\n" * 1000, format="tvmscript")
        problem = assert_problem(c.post("/optimize", json=big), 413, "limit-exceeded")
        assert problem["setting"] == "max_script_bytes" and problem["actual"] == 10_000
        garbage = body("import os\nos.system('true')\n", format="tvmscript")
        assert_problem(c.post("/optimize", json=garbage), 422, "forbidden-script")
        assert_problem(
            c.post("/optimize", json=body("def (", format="tvmscript")), 422, "invalid-module"
        )
        nested = body("x = " + "(" * 5000 + ")" * 5000, format="tvmscript")
        r = c.post("/optimize", json=nested)
        assert r.status_code in (413, 422) and r.headers["content-type"] == PROBLEM
    assert set(redis_server.client().lrange("rq:queue:stackfuse", 0, -1)) <= before


# --- header limits and read timeouts (raw sockets: clients that misbehave) ---------------------
def _exchange(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send ``data``, then read until the server closes the connection."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                out += chunk
        return out
    finally:
        sock.close()


def test_oversize_header_is_431(api: ApiProcess) -> None:
    huge = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (1024 * 1024) + b"\r\n\r\n"
    status, headers, problem = _parse(_exchange(api.port, huge))
    assert status == 431 and headers["content-type"] == PROBLEM
    assert problem["type"] == "https://stackfuse.dev/problems/headers-too-large"


def test_too_many_headers_is_431(api: ApiProcess) -> None:
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(500))
    status, _, problem = _parse(_exchange(api.port, b"GET /healthz HTTP/1.1\r\n" + many + b"\r\n"))
    assert status == 431 and "headers" in str(problem["detail"])


def test_header_just_under_the_limit_is_served(client: httpx.Client) -> None:
    assert client.get("/healthz", headers={"X-Pad": "p" * 20_000}).status_code == 200


@pytest.fixture(scope="module")
def impatient_api(start_api: Callable[..., ApiProcess]) -> ApiProcess:
    return start_api(
        STACKFUSE_HEADER_TIMEOUT_S="1",
        STACKFUSE_BODY_IDLE_TIMEOUT_S="1",
        STACKFUSE_BODY_TIMEOUT_S="3",
        STACKFUSE_KEEP_ALIVE_TIMEOUT_S="1",
    )


def test_half_sent_headers_get_408_and_are_closed(impatient_api: ApiProcess) -> None:
    status, headers, problem = _parse(_exchange(impatient_api.port, b"GET /healthz HTTP/1.1\r\n"))
    assert status == 408 and headers["connection"] == "close"
    assert problem["type"] == "https://stackfuse.dev/problems/request-timeout"


def test_short_body_gets_408_and_is_closed(impatient_api: ApiProcess) -> None:
    head = POST + b"Content-Length: 1000\r\n\r\n"
    status, _, problem = _parse(_exchange(impatient_api.port, head + b'{"module": "'))
    assert status == 408 and "body" in str(problem["detail"])


def test_slow_drip_body_gets_408(impatient_api: ApiProcess) -> None:
    """Bytes every half second keep the idle timer quiet; the body deadline still ends it."""
    sock = socket.create_connection(("127.0.0.1", impatient_api.port), timeout=30)
    try:
        sock.sendall(POST + b"Content-Length: 1000\r\n\r\n")
        out = b""
        for _ in range(40):
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.5)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        status, _, _ = _parse(out)
        assert status == 408
    finally:
        sock.close()


def test_idle_connection_is_closed(impatient_api: ApiProcess) -> None:
    assert _exchange(impatient_api.port, b"") == b""  # closed by the server, nothing sent


def test_keep_alive_still_works_within_the_timeouts(impatient_api: ApiProcess) -> None:
    with impatient_api.client() as c:
        for _ in range(3):
            assert c.get("/healthz").status_code == 200


# --- secrets, OpenAPI ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:1/0?password=hunter2", "redis://default:hunter2@127.0.0.1:1/0"],
)
def test_readyz_never_shows_the_redis_password(
    start_api: Callable[..., ApiProcess], url: str
) -> None:
    with start_api(STACKFUSE_REDIS_URL=url).client() as c:
        r = c.get("/readyz")
        assert_problem(r, 503, "infrastructure-error")
        assert "hunter2" not in r.text and "127.0.0.1:1" in r.text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:hunter2@h:1/0", "redis://***@h:1/0"),
        ("redis://u:hun@ter2@h/0", "redis://***@h/0"),
        ("redis://h/0?password=hunter2&db=1", "redis://h/0?password=***&db=1"),
        ("rediss://h/0?PASSWORD=hunter2", "rediss://h/0?PASSWORD=***"),
        ("unix:///run/r.sock?db=0&password=hunter2", "unix:///run/r.sock?db=0&password=***"),
        ("redis://h/0#hunter2", "redis://h/0"),
        ("redis://[::1/0?password=hunter2", "***"),
    ],
)
def test_redact_url_hides_every_credential_form(url: str, shown: str) -> None:
    from service.settings import redact_url

    assert redact_url(url) == shown


def test_openapi_refs_resolve_and_errors_are_problem_json(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()

    def refs(node: object) -> Iterable[str]:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"], ref
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for code, response in op["responses"].items():
                if int(code) >= 400:
                    assert list(response["content"]) == [PROBLEM], (path, method, code)
    assert "431" in doc["paths"]["/optimize"]["post"]["responses"]


# --- /docs works offline ------------------------------------------------------------------------
def test_docs_load_only_local_assets(client: httpx.Client) -> None:
    """Swagger UI's page names only assets this API serves (no CDN), and each one answers."""
    import re

    for page in ("/docs", "/redoc"):
        r = client.get(page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", r.text)
        urls += re.findall(r"""url:\s*['"]([^'"]+)['"]""", r.text)  # the OpenAPI document
        assets = [u for u in urls if u.endswith((".js", ".css", ".png", ".json"))]
        assert len(assets) >= 2, r.text
        for url in urls:
            assert not re.match(r"^(https?:)?//", url), f"{page} loads {url} from elsewhere"
        for url in assets:
            got = client.get(url)
            assert got.status_code == 200 and len(got.content) > 100, url
