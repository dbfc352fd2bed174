"""Attack benchmark of the HTTP API (not a test): hostile bodies and headers, while a probe
measures ``/healthz`` latency and a sampler the API's memory.

Starts its own redis-server and one API process (`stackfuse api`, default limits: 64 MiB
bodies), no worker. A probe thread sends ``GET /healthz`` on one keep-alive connection every
10 ms; a sampler reads the RSS of the API process and, apart, of its descendants (the
forkserver and the child that decodes large bodies) every 20 ms. Then each attack runs in turn
(and one twice at once), each in its own window: the answer it got, how long it took, the
probe's p50/p99/max latency and the peak RSS during it. A quiet window comes first.

Writes ``benchmarks/results/attack_api.json`` and ``attack_api.md``.

    python benchmarks/attack_api.py
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Probe(threading.Thread):
    """GET /healthz every ``interval`` s on one keep-alive connection; latencies in ms."""

    def __init__(self, port: int, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.port, self.interval = port, interval
        self.samples: list[tuple[float, float]] = []  # (start, ms)
        self.failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                conn.request("GET", "/healthz")
                r = conn.getresponse()
                r.read()
                ok = r.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            elapsed = (time.monotonic() - start) * 1000
            if ok:
                self.samples.append((start, elapsed))
            else:
                self.failures += 1
            time.sleep(max(0.0, self.interval - elapsed / 1000))


class Sampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int, int]] = []  # (t, api rss, descendants rss)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            kids = sum(_rss(p) for p in _descendants(self.pid))
            self.samples.append((time.monotonic(), _rss(self.pid), kids))
            time.sleep(self.interval)


def _send(port: int, data: bytes) -> tuple[int | None, str, str]:
    """Send ``data`` on a fresh connection; ``(status, content-type, detail)`` of the answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=300)
    try:
        try:
            view = memoryview(data)
            for i in range(0, len(data), MiB):
                sock.sendall(view[i : i + MiB])
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out:
                    head, _, rest = out.partition(b"\r\n\r\n")
                    lengths = [
                        ln
                        for ln in head.split(b"\r\n")
                        if ln.lower().startswith(b"content-length:")
                    ]
                    if lengths and len(rest) >= int(lengths[0].split(b":")[1]):
                        break
        except (ConnectionResetError, TimeoutError):
            pass
    finally:
        sock.close()
    if not out:
        return None, "", "no answer"
    head, _, rest = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
    try:
        detail = str(json.loads(rest).get("detail", ""))[:160]
    except ValueError:
        detail = rest[:160].decode("latin-1")
    return int(lines[0].split()[1]), headers.get("content-type", ""), detail


def _post(body: bytes) -> bytes:
    return (
        b"POST /optimize HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


def attacks() -> dict[str, list[bytes]]:
    block = b"[" * 40 + b"]" * 40 + b","
    nested = b"[" + block * (59 * MiB // len(block)) + b"[]]"
    nested_body = b'{"module": "' + nested + b'"}'
    script = b"# x\\n" * (60 * MiB // 5)
    return {
        "module of nested arrays, 59 MiB": [_post(nested_body)],
        "two of those at once": [_post(nested_body), _post(nested_body)],
        "1,000 nested arrays as the body": [_post(b"[" * 1000 + b"]" * 1000)],
        "4,301-digit integer in the body": [_post(b'{"module": ' + b"1" * 4301 + b"}")],
        "TVMScript, 60 MiB": [_post(b'{"format": "tvmscript", "module": "' + script + b'"}')],
        "128 MiB request header": [
            b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Big: " + b"a" * (128 * MiB) + b"\r\n\r\n"
        ],
    }


def _window(probe: Probe, sampler: Sampler, start: float, end: float) -> dict[str, Any]:
    lat = sorted(ms for t, ms in probe.samples if start <= t <= end)
    mem = [(a, k) for t, a, k in sampler.samples if start <= t <= end]
    q = (
        statistics.quantiles(lat, n=100, method="inclusive")
        if len(lat) >= 2
        else [float("nan")] * 99
    )
    return {
        "healthz_requests": len(lat),
        "healthz_p50_ms": round(q[49], 2),
        "healthz_p99_ms": round(q[98], 2),
        "healthz_max_ms": round(max(lat), 2) if lat else None,
        "api_rss_peak_mib": round(max((a for a, _ in mem), default=0) / MiB, 1),
        "children_rss_peak_mib": round(max((k for _, k in mem), default=0) / MiB, 1),
        "api_plus_children_peak_mib": round(max((a + k for a, k in mem), default=0) / MiB, 1),
    }


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="stackfuse-attack-"))
    redis_port, api_port = free_port(), free_port()
    redis = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(redis_port),
            "--dir",
            str(tmp),
            "--save",
            "",
        ],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STACKFUSE_")}
    env.update(
        STACKFUSE_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        STACKFUSE_DATA_DIR=str(tmp / "data"),
        PYTHONPATH=str(REPO),
    )
    api = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "api",
            "--host",
            "127.0.0.1",
            "--port",
            str(api_port),
        ],
        cwd=REPO,
        env=env,
        stdout=(tmp / "api.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rows: list[dict[str, Any]] = []
    try:

        def up() -> bool:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", api_port, timeout=1)
                conn.request("GET", "/healthz")
                return conn.getresponse().status == 200
            except OSError:
                return False

        wait_until(up, 60, "the API")
        probe, sampler = Probe(api_port), Sampler(api.pid)
        probe.start()
        sampler.start()
        time.sleep(1)
        start = time.monotonic()
        time.sleep(5)
        rows.append(
            {
                "attack": "none (quiet)",
                "body_mib": 0,
                **_window(probe, sampler, start, time.monotonic()),
            }
        )
        for name, payloads in attacks().items():
            results: list[tuple[int | None, str, str]] = []
            start = time.monotonic()
            threads = [
                threading.Thread(target=lambda p=p, out=results: out.append(_send(api_port, p)))
                for p in payloads
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.monotonic() - start
            time.sleep(0.5)
            window = _window(probe, sampler, start, time.monotonic())
            _, ctype, detail = results[0]
            rows.append(
                {
                    "attack": name,
                    "body_mib": round(len(payloads[0]) / MiB, 1),
                    "status": sorted(str(r[0]) for r in results),
                    "content_type": ctype,
                    "detail": detail,
                    "seconds": round(elapsed, 2),
                    **window,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            time.sleep(2)  # let memory settle between attacks
        probe.stop.set()
        sampler.stop.set()
        failures = probe.failures
    finally:
        api.terminate()
        api.wait(30)
        redis.terminate()
        redis.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "benchmark": "attack_api",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": "python benchmarks/attack_api.py",
        "machine": f"{platform.node()} ({os.cpu_count()} cores), "
        f"Python {platform.python_version()}",
        "healthz_failures": failures,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attack_api.json").write_text(json.dumps(doc, indent=2) + "\n")
    (RESULTS / "attack_api.md").write_text(_markdown(doc))


def _markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# The API under hostile requests",
        "",
        f"`{doc['command']}`, {doc['date']}, {doc['machine']}. One API process",
        "(default limits, 64 MiB bodies), Redis, no worker. `/healthz` probed every 10 ms on a",
        "keep-alive connection during each attack; RSS sampled every 20 ms: the API process, and",
        "apart its descendants (the forkserver and the child that decodes bodies over 16 KiB).",
        "Goal (issue #33): API RSS under 4x the body, `/healthz` p99 under 50 ms. Before this",
        "design, one 59 MiB module of nested arrays took the API to 3.3 GB and stalled `/healthz`",
        "for 17 s (issue #33).",
        "",
        f"Failed `/healthz` probes: {doc['healthz_failures']}.",
        "",
        "| attack | body MiB | answer | s | /healthz p50 / p99 / max ms | API RSS MiB "
        "| children RSS MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        answer = ", ".join(r.get("status", ["-"]))
        lines.append(
            f"| {r['attack']} | {r['body_mib']} | {answer} | {r.get('seconds', '-')} | "
            f"{r['healthz_p50_ms']} / {r['healthz_p99_ms']} / {r['healthz_max_ms']} | "
            f"{r['api_rss_peak_mib']} | {r['children_rss_peak_mib']} |"
        )
    lines += ["", "Details of each answer are in `attack_api.json`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
