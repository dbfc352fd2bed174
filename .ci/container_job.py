""".ci/containers' client (stdlib only, runs on the host).

``wait URL``: until /readyz answers 200 (Redis and a live worker), 120 s at most.
``run URL MODEL ARCH``: submit the module, poll the job to success, download the artifact and
check it is a non-empty ELF shared library whose sha256 is the job's ``artifact_sha256``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait(base: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            status, body = get(base + "/readyz")
            if status == 200:
                print(f"/readyz: {body.decode()}")
                return
        except OSError as exc:
            status, body = 0, str(exc).encode()
        if time.monotonic() > deadline:
            sys.exit(f"/readyz not ready after {limit_s} s: {status} {body[:300]!r}")
        time.sleep(1)


def run(base: str, model: str, arch: str, limit_s: float = 600.0) -> None:
    with open(model) as f:
        module = f.read()
    body = json.dumps({"module": module, "target": {"arch": arch}}).encode()
    req = urllib.request.Request(
        base + "/optimize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 202, r.status
        job: dict[str, Any] = json.load(r)
    print(f"job {job['id']} {job['status']}")
    deadline = time.monotonic() + limit_s
    while job["status"] not in ("succeeded", "failed"):
        if time.monotonic() > deadline:
            sys.exit(f"job still {job['status']} after {limit_s} s")
        time.sleep(2)
        status, raw = get(base + job["links"]["self"])
        assert status == 200, (status, raw[:300])
        job = json.loads(raw)
    if job["status"] != "succeeded":
        sys.exit(f"job failed: {job.get('error')}")
    status, lib = get(base + job["links"]["artifact"])
    assert status == 200, status
    sha = hashlib.sha256(lib).hexdigest()
    assert lib[:4] == b"\x7fELF" and lib[16] == 3, "the artifact is not an ELF shared object"
    assert sha == job["artifact_sha256"], (sha, job["artifact_sha256"])
    status, raw = get(base + job["links"]["report"])
    summary = json.loads(raw)["summary"] if status == 200 else {}
    print(f"artifact: {len(lib)} bytes, sha256 {sha} (the job's); summary {summary}")


if __name__ == "__main__":
    if sys.argv[1] == "wait":
        wait(sys.argv[2])
    else:
        run(sys.argv[2], sys.argv[3], sys.argv[4])
