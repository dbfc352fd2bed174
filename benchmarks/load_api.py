"""Load benchmark of the HTTP API (not a test): many concurrent clients submit and poll.

Starts its own redis-server (free port, temp dir, AOF on as in production) and one API process
(`stackfuse api`, one uvicorn process), and no worker: jobs only queue, nothing compiles. Each
client loops for ``--seconds``: POST /optimize with a distinct small module (a real stacked-
attention module in TVM JSON, made distinct by trailing whitespace, so no idempotency or cache
path is taken), then GET /jobs/{id} ``--polls`` times, waiting what Retry-After says between
polls, give or take ``--jitter`` (the default, "paced": clients as the API asks them to
behave), or not at all (``--saturate``: closed loop, no think time: the throughput ceiling).

Clients are asyncio tasks with one keep-alive HTTP/1.1 connection each, on raw streams: httpx
costs several times the server's CPU per request, and on a 2-core machine that would measure
the client.

Writes p50/p90/p99/max latency of POST /optimize and GET /jobs/{id}, throughput and errors to
``benchmarks/results/load_api.json`` (one entry per mode), with the date, command and machine.

    python benchmarks/load_api.py                     # paced, 200 clients, 30 s
    python benchmarks/load_api.py --saturate --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import uvloop

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "load_api.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def make_module() -> str:
    """A real module (TVM JSON) like a client would send; TVM runs here, not in the API."""
    sys.path.insert(0, str(REPO))
    from tests.models import stacked_attention_module
    from worker.toolchain import import_tvm

    tvm = import_tvm()
    return str(tvm.ir.save_json(stacked_attention_module(2, 64, 4, 64)))


def whitespace_tag(n: int) -> str:
    """``n`` written in base 4 with the four JSON whitespace characters: a few bytes that make
    the text distinct without changing the module it encodes."""
    digits = " \t\n\r"
    out = ""
    while True:
        n, r = divmod(n, 4)
        out += digits[r]
        if n == 0:
            return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(ms: list[float], seconds: float) -> dict[str, float | int]:
    return {
        "count": len(ms),
        "per_s": round(len(ms) / seconds, 1),
        "p50_ms": round(percentile(ms, 50), 2),
        "p90_ms": round(percentile(ms, 90), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2) if ms else float("nan"),
        "mean_ms": round(statistics.fmean(ms), 2) if ms else float("nan"),
    }


class Conn:
    """One keep-alive HTTP/1.1 connection on raw asyncio streams: a client that costs far less
    CPU than httpx, so on a small machine the numbers are about the server, not the client."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b""
    ) -> tuple[int, dict[str, str], bytes]:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        payload = await self.reader.readexactly(int(headers.get("content-length", "0")))
        if headers.get("connection") == "close":
            self.writer.close()
        return status, headers, payload


async def client_loop(
    port: int,
    module: str,
    idx: int,
    until: float,
    args: argparse.Namespace,
    post_ms: list[float],
    get_ms: list[float],
    errors: dict[str, int],
) -> None:
    conn = Conn(port)
    n = 0
    await asyncio.sleep(random.uniform(0, args.ramp))  # clients do not start in lockstep
    while time.monotonic() < until:
        n += 1
        text = module + whitespace_tag(idx * 1_000_000 + n)  # distinct sha256, same module
        payload = json.dumps({"module": text, "target": {"arch": "sm_90"}}).encode()
        t0 = time.perf_counter()
        status, headers, _ = await conn.request("POST", "/optimize", payload)
        post_ms.append((time.perf_counter() - t0) * 1000)
        if status != 202:
            errors[f"POST {status}"] = errors.get(f"POST {status}", 0) + 1
            continue
        location = headers["location"]
        wait = float(headers.get("retry-after", "1"))
        for _ in range(args.polls):
            if not args.saturate:  # as Retry-After says, give or take --jitter
                await asyncio.sleep(wait * random.uniform(1 - args.jitter, 1 + args.jitter))
            if time.monotonic() >= until:
                return
            t0 = time.perf_counter()
            status, headers, _ = await conn.request("GET", location)
            get_ms.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                errors[f"GET {status}"] = errors.get(f"GET {status}", 0) + 1
            wait = float(headers.get("retry-after", wait))


async def run_load(port: int, module: str, args: argparse.Namespace) -> dict[str, Any]:
    post_ms: list[float] = []
    get_ms: list[float] = []
    errors: dict[str, int] = {}
    start = time.monotonic()
    until = start + args.seconds
    await asyncio.gather(
        *(
            client_loop(port, module, i, until, args, post_ms, get_ms, errors)
            for i in range(args.clients)
        )
    )
    elapsed = time.monotonic() - start
    return {
        "mode": "saturate" if args.saturate else "paced",
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "polls_per_job": args.polls,
        "ramp_s": args.ramp,
        "jitter": args.jitter,
        "post_optimize": summary(post_ms, elapsed),
        "get_job": summary(get_ms, elapsed),
        "requests_per_s": round((len(post_ms) + len(get_ms)) / elapsed, 1),
        "errors": errors,
        "goal_post_p99_ms": 25,
        "goal_met": percentile(post_ms, 99) <= 25,
    }


def group_cpu_s(pgid: int) -> float:
    """CPU seconds used so far by every process in a process group (the API and its workers)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: process group
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def cpu_pressure() -> str:
    """Linux PSI for the CPU: how often runnable tasks waited (other tenants included)."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "unavailable"


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "loadavg_at_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "note": "client and server share the machine's cores (loopback)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--polls", type=int, default=3, help="GETs per submitted job")
    parser.add_argument("--saturate", action="store_true", help="no think time between requests")
    parser.add_argument("--ramp", type=float, default=2.0, help="clients start within this")
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.2,
        help="each wait is Retry-After x uniform(1-j, 1+j): clients drift apart, as real ones do",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="STACKFUSE_X=V",
        help="a setting for the API process (repeatable), e.g. STACKFUSE_STORE_FSYNC=false",
    )
    args = parser.parse_args()

    module = make_module()
    tmp = Path(tempfile.mkdtemp(prefix="stackfuse-bench-"))
    redis_port, api_port = free_port(), free_port()
    redis = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(tmp),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
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
        STACKFUSE_QUEUE_NAME="bench",
    )
    api = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "api", "--port", str(api_port)],
        cwd=REPO,
        env=env,
        stdout=(tmp / "api.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{api_port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 30, "the API")
        pressure_before = cpu_pressure()
        cpu_before = group_cpu_s(api.pid)
        result = uvloop.run(run_load(api_port, module, args))  # uvicorn[standard] brings it
        requests = result["post_optimize"]["count"] + result["get_job"]["count"]
        result["server_cpu_ms_per_request"] = round(
            1000 * (group_cpu_s(api.pid) - cpu_before) / max(1, requests), 2
        )
        result["cpu_pressure_before"] = pressure_before
        result["cpu_pressure_after"] = cpu_pressure()
    finally:
        api.terminate()
        api.wait(15)
        redis.terminate()
        redis.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)

    result.update(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        command="python "
        + " ".join(
            [
                str(Path(sys.argv[0]).relative_to(REPO))
                if Path(sys.argv[0]).is_absolute()
                else sys.argv[0],
                *sys.argv[1:],
            ]
        ),
        server="1 uvicorn process per STACKFUSE_API_WORKERS (stackfuse api: httptools, uvloop), "
        "redis-server with AOF everysec, store fsync on unless overridden, no worker",
        settings_overrides=args.set,
        module_bytes=len(module),
        machine=machine(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    doc[result["mode"]] = result
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
