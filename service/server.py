"""Running the API under uvicorn, and the local Redis that `stackfuse serve` brings along.

The one uvicorn tweak: malformed HTTP (e.g. a body longer than its Content-Length, seen as a
garbage second request) is refused by uvicorn's protocol layer before the app runs, as
text/plain; :class:`ProblemHTTPProtocol` makes that a problem+json response like every other
error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.errors import RequestError, ToolchainError
from service.problems import PROBLEM_MEDIA_TYPE, problem_body
from service.settings import Settings


class ProblemHTTPProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering malformed HTTP with a problem+json 400."""

    def send_400_response(self, msg: str) -> None:
        err = RequestError(f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})")
        body = json.dumps(problem_body(err)).encode()
        head = (
            "HTTP/1.1 400 Bad Request\r\n"
            f"content-type: {PROBLEM_MEDIA_TYPE}\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self.transport.close()


def run_api(
    settings: Settings, host: str | None = None, port: int | None = None, workers: int | None = None
) -> None:
    """Serve the API until SIGINT/SIGTERM. Each process builds its app from the environment
    (``create_app()`` reads ``get_settings()``), so ``settings`` only chooses where to listen."""
    import uvicorn

    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=workers or settings.api_workers,
        http="service.server:ProblemHTTPProtocol",
        timeout_keep_alive=30,
        log_level="info",
        access_log=False,
    )


# --- local Redis ------------------------------------------------------------------------------
def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    from redis import Redis
    from redis.exceptions import RedisError

    try:
        conn = Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(conn.ping())
        finally:
            conn.close()
    except (RedisError, OSError):
        return False


def start_local_redis(
    settings: Settings, *, startup_timeout_s: float = 15.0
) -> subprocess.Popen[bytes]:
    """Start redis-server for ``settings.redis_url`` (a localhost URL), persisted with AOF in
    ``<data_dir>/redis``: what `stackfuse serve` does when nothing answers."""
    url = urlparse(settings.redis_url)
    if url.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ToolchainError(
            f"no Redis answers at {url.hostname}:{url.port}; start it, or point REDIS_URL at "
            "one (serve only starts a Redis on this machine)"
        )
    binary = shutil.which("redis-server")
    if binary is None:
        raise ToolchainError(
            "no Redis answers at REDIS_URL and redis-server is not installed "
            "(apt-get install redis-server, or set REDIS_URL)"
        )
    directory = Path(settings.data_dir) / "redis"
    directory.mkdir(parents=True, exist_ok=True)
    argv = [
        binary,
        "--bind", "127.0.0.1",
        "--port", str(url.port or 6379),
        "--dir", str(directory.resolve()),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        "--maxmemory-policy", "noeviction",
        "--daemonize", "no",
    ]  # fmt: skip
    log = (directory / "redis.log").open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ToolchainError(f"redis-server exited at start; see {directory / 'redis.log'}")
        if redis_answers(settings.redis_url, 0.5):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise ToolchainError(f"redis-server did not answer within {startup_timeout_s:.0f} s")
