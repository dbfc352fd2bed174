"""Submit -> poll -> download through the real API, Redis, RQ workers and compiler.

The first test of the session pays for nvcc (~15 s); the others reuse the session's kernel cache.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import RedisServer, WorkerPool, add_fault, wait_job

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]


def submit(client: httpx.Client, module: str, **extra: object) -> dict[str, object]:
    r = client.post("/optimize", json={"module": module, **extra})
    assert r.status_code == 202, r.text
    return r.json()  # type: ignore[no-any-return]


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_submit_poll_download_load_and_report(
    client: httpx.Client, workers: WorkerPool, fresh_module: Callable[[], str], tmp_path: Path
) -> None:
    module = fresh_module()
    job = submit(client, module, target={"arch": "sm_90"})
    seen: set[str] = set()
    deadline = time.monotonic() + 600
    while job["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, f"job stuck: {job}"
        r = client.get(f"/jobs/{job['id']}")
        assert r.status_code == 200
        job = r.json()
        seen.add(str(job["stage"]))
        assert 0.0 <= float(job["progress"]) <= 1.0  # type: ignore[arg-type]
        if job["status"] in ("queued", "running"):
            assert "retry-after" in r.headers
        time.sleep(0.2)
    assert job["status"] == "succeeded", job
    assert job["cached"] is False and job["attempts"] == 1
    assert job["started_at"] and job["finished_at"] and job["error"] is None
    assert seen & {"ingest", "normalize", "partition", "codegen", "build", "link", "validate"}

    art = client.get(str(job["links"]["artifact"]))  # type: ignore[index]
    assert art.status_code == 200
    assert art.headers["content-type"] == "application/octet-stream"
    assert f'filename="stackfuse-{job["id"]}.so"' in art.headers["content-disposition"]
    digest = hashlib.sha256(art.content).hexdigest()
    assert art.headers["etag"] == f'"{digest}"' and job["artifact_sha256"] == digest
    again = client.get(str(job["links"]["artifact"]), headers={"If-None-Match": f'"{digest}"'})  # type: ignore[index]
    assert again.status_code == 304 and again.content == b""

    report = client.get(str(job["links"]["report"])).json()  # type: ignore[index]
    assert report["input_sha256"] == sha(module) == job["input_sha256"]
    assert report["library"]["sha256"] == digest
    assert report["summary"]["fused_stacked"] == 1 and report["error"] is None
    assert report["matches"][0]["kernel"]["family"].startswith("cutlass_fmha")
    assert report["validation"]["status"] == "not_run"  # no GPU here: said so in the report
    assert report["validation"]["reason"]

    # the library loads in TVM and exports the module's entry point
    from worker.toolchain import import_tvm

    tvm = import_tvm()
    lib_path = tmp_path / "model.so"
    lib_path.write_bytes(art.content)
    lib = tvm.runtime.load_module(str(lib_path))
    assert lib.implements_function("vm_load_executable")
    assert lib["vm_load_executable"]().kind == "relax.VirtualMachine"


def test_readyz_with_live_workers(client: httpx.Client, workers: WorkerPool) -> None:
    r = client.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json()["checks"]["workers"] >= 2


def test_cache_hit_finishes_at_once_without_recompiling(
    client: httpx.Client,
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    redis_server: RedisServer,
) -> None:
    module = fresh_module()
    first = wait_job(client, str(submit(client, module)["id"]))
    assert first["status"] == "succeeded" and first["cached"] is False

    hit = submit(client, module)
    assert hit["status"] == "succeeded" and hit["cached"] is True  # in the POST answer itself
    assert hit["id"] != first["id"] and hit["attempts"] == 0
    assert hit["artifact_sha256"] == first["artifact_sha256"]
    assert hit["links"]["artifact"] and hit["links"]["report"]  # type: ignore[index]
    assert not redis_server.client().exists(f"rq:job:{hit['id']}")  # nothing was enqueued
    art = client.get(f"/jobs/{hit['id']}/artifact")
    assert hashlib.sha256(art.content).hexdigest() == first["artifact_sha256"]
    # its report is the first job's, told as its own: cached, the first compile's time apart
    original = client.get(f"/jobs/{first['id']}/report").json()
    report = client.get(f"/jobs/{hit['id']}/report").json()
    assert original["cached"] is False and original["compile_s"] > 0
    assert report["cached"] is True and report["original_job"] == first["id"]
    assert report["compile_s"] == 0 and report["original_compile_s"] == original["compile_s"]
    assert report["library"]["file"] == f"stackfuse-{hit['id']}.so"
    assert original["library"]["file"] == f"stackfuse-{first['id']}.so"
    assert all(m["kernel"]["cached"] for m in report["matches"])

    # different options or target: a different cache key, so a real compile
    other = submit(client, module, options={"normalize": False})
    assert other["cached"] is False and other["status"] == "queued"
    assert wait_job(client, str(other["id"]))["status"] == "succeeded"


def test_invalid_module_fails_once_with_a_clear_error(
    client: httpx.Client, workers: WorkerPool
) -> None:
    # the API checks TVMScript's syntax and constructs; what only TVM's parser can judge (the
    # matmul's shapes) is accepted there and refused by the worker's ingest
    script = (
        "from tvm.script import ir as I\nfrom tvm.script import relax as R\n\n"
        "@I.ir_module\nclass Module:\n    @R.function\n"
        '    def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):\n'
        "        y = R.matmul(x, x)\n        return y\n"
    )
    job = submit(client, script, format="tvmscript")
    done = wait_job(client, str(job["id"]))
    assert done["status"] == "failed" and done["attempts"] == 1
    assert done["error"]["type"] == "invalid-module"  # type: ignore[index]
    assert "TVM could not parse the TVMScript" in done["error"]["message"]  # type: ignore[index]
    assert "reduction length" in done["error"]["message"]  # type: ignore[index]
    time.sleep(3)  # longer than a retry interval: it must not come back
    later = client.get(f"/jobs/{job['id']}").json()
    assert later["status"] == "failed" and later["attempts"] == 1
    r = client.get(f"/jobs/{job['id']}/report")
    assert r.status_code == 404  # failed before partitioning: no report, and it says so
    assert "partition" in r.json()["detail"]


def test_compile_error_after_partitioning_fails_once_and_keeps_the_report(
    client: httpx.Client,
    workers: WorkerPool,
    fresh_module: Callable[[], str],
    fault_plan_file: Path,
) -> None:
    module = fresh_module()
    add_fault(fault_plan_file, sha(module), **{"raise": "compile-error", "at": "codegen"})
    done = wait_job(client, str(submit(client, module)["id"]))
    assert done["status"] == "failed" and done["attempts"] == 1
    assert done["error"]["type"] == "compile-failed"  # type: ignore[index]
    assert "injected deterministic failure" in done["error"]["message"]  # type: ignore[index]
    assert done["links"]["artifact"] is None  # type: ignore[index]
    assert done["links"]["report"] == f"/jobs/{done['id']}/report", done  # type: ignore[index]
    report = client.get(str(done["links"]["report"])).json()  # type: ignore[index]
    assert report["summary"]["fused_stacked"] == 1  # partitioning ran and is reported
    assert report["error"]["type"] == "compile-failed"
    assert client.get(f"/jobs/{done['id']}/artifact").status_code == 409
