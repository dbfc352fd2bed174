"""Running the API under uvicorn, and the local Redis that `stackfuse serve` brings along.

:class:`ProblemHTTPProtocol` is uvicorn's httptools protocol with the limits a server on a
network needs, each refused with a problem+json response and ``Connection: close``:

- malformed HTTP (e.g. a body longer than its Content-Length, seen as a garbage second
  request): 400, instead of uvicorn's text/plain;
- request line + headers over ``max_header_bytes``, or more than ``max_header_count`` headers:
  431. Counted while they arrive, so at most one read (256 KiB) more is ever buffered;
- headers not complete ``header_timeout_s`` after a request's first byte: 408;
- a body that stalls for ``body_idle_timeout_s``, or is not complete ``body_timeout_s`` after
  its headers: 408 (time the application spends not reading does not count);
- a connection with no request in progress is closed after ``keep_alive_timeout_s``, also when
  it never sent a request at all (uvicorn arms that timer only after a first response).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.errors import HeadersTooLarge, RequestError, RequestTimeout, ToolchainError
from service.problems import PROBLEM_MEDIA_TYPE, problem_body
from service.settings import Settings, get_settings

log = logging.getLogger("stackfuse.api")

_IDLE, _HEAD, _BODY = "idle", "head", "body"
#: How long a refused connection is still read (and dropped) before it is closed.
_LINGER_S = 2.0


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal is in ``_refusal``."""


class ProblemHTTPProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header limits, read timeouts and problem+json errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits: Settings = get_settings()
        self._phase = _IDLE
        self._head_raw = 0  # bytes read while the head was incomplete (upper bound)
        self._head_bytes = 0  # exact, from the parser's callbacks
        self._header_count = 0
        self._refusal: RequestError | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._discarding = False  # refused: what still arrives is read and dropped

    # -- connection -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self._unset_keepalive_if_required()
        if self._phase == _HEAD:
            self._head_raw += len(data)
        elif self._phase == _BODY:
            self._arm_idle()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(self._refusal)
            else:
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._phase == _HEAD and self._head_raw > self.limits.max_header_bytes:
            self._refuse(self._headers_too_large(f"over {self.limits.max_header_bytes} bytes"))

    # -- parser callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEAD
        self._head_raw = self._head_bytes = self._header_count = 0
        self._set_deadline(self.limits.header_timeout_s, "the request headers")

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            self._refusal = HeadersTooLarge(
                f"the request has more than {self.limits.max_header_count} headers",
                limit_headers=self.limits.max_header_count,
            )
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._head_bytes > self.limits.max_header_bytes:
            self._refusal = self._headers_too_large(f"{self._head_bytes} bytes")
            raise _Refused
        self._phase = _BODY
        self._set_deadline(self.limits.body_timeout_s, "the request body")
        self._arm_idle()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._cancel_timers()
        super().on_message_complete()

    # -- refusals ---------------------------------------------------------------------------
    def _headers_too_large(self, size: str) -> HeadersTooLarge:
        return HeadersTooLarge(
            f"the request line and headers are {size}; the limit is "
            f"{self.limits.max_header_bytes} bytes",
            limit_bytes=self.limits.max_header_bytes,
        )

    def send_400_response(self, msg: str) -> None:
        self._refuse(RequestError(f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})"))

    def _refuse(self, err: RequestError) -> None:
        """Answer ``err`` unless a response already began, then close the connection."""
        self._cancel_timers()
        cycle = self.cycle
        # a response of this request began (or, for the next request's head, one is under way)
        answered = (
            cycle is not None
            and cycle.response_started
            and (self._phase == _BODY or not cycle.response_complete)
        )
        if not self.transport.is_closing() and not answered:
            body = json.dumps(problem_body(err)).encode()
            head = b"".join(
                [
                    STATUS_LINE[err.status],
                    f"content-type: {PROBLEM_MEDIA_TYPE}\r\n".encode(),
                    f"content-length: {len(body)}\r\n".encode(),
                    b"connection: close\r\n\r\n",
                ]
            )
            self.transport.write(head + body)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's receive() sees http.disconnect
            cycle.message_event.set()
        self._linger()

    def _linger(self) -> None:
        """Close after the answer, reading (and dropping) what the client still sends for a
        moment: closing with unread input makes the kernel send a reset, which can destroy the
        answer before the client reads it."""
        self._discarding = True
        if self.transport.is_closing() or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(_LINGER_S, self.transport.close)

    # -- timers -----------------------------------------------------------------------------
    def _set_deadline(self, seconds: float, what: str, after: float | None = None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        wait = seconds if after is None else after
        self._deadline = self.loop.call_later(wait, self._deadline_expired, what, seconds)

    def _deadline_expired(self, what: str, seconds: float) -> None:
        if self.flow.read_paused:  # e.g. a pipelined request waiting for the one before it
            self._set_deadline(seconds, what, after=1.0)
            return
        self._expired(what, seconds)

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self.loop.call_later(self.limits.body_idle_timeout_s, self._idle_expired)

    def _idle_expired(self) -> None:
        if self.flow.read_paused:  # the application is not reading; the client is not late
            self._arm_idle()
            return
        self._expired("the next bytes of the request body", self.limits.body_idle_timeout_s)

    def _expired(self, what: str, seconds: float) -> None:
        if self._phase == _IDLE or self.transport.is_closing():
            return
        log.info("closing a connection from %s: %s took over %g s", self.client, what, seconds)
        self._refuse(RequestTimeout(f"{what} did not arrive within {seconds:g} s"))

    def _cancel_timers(self) -> None:
        for timer in (self._deadline, self._idle):
            if timer is not None:
                timer.cancel()
        self._deadline = self._idle = None


def run_api(
    settings: Settings, host: str | None = None, port: int | None = None, workers: int | None = None
) -> None:
    """Serve the API until SIGINT/SIGTERM. Each process builds its app from the environment
    (``create_app()`` reads ``get_settings()``), so ``settings`` only chooses where to listen."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    uvicorn.run(
        "service.app:create_app",
        # json: uvicorn's loggers propagate to the handler create_app installs (service.logs)
        log_config=None if settings.log_format == "json" else LOGGING_CONFIG,
        factory=True,
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=workers or settings.api_workers,
        http="service.server:ProblemHTTPProtocol",
        timeout_keep_alive=settings.keep_alive_timeout_s,
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
