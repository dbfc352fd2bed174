"""What request handlers share, built once per app in its lifespan."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aredis
from redis import Redis
from redis import exceptions as redis_errors
from rq import Queue

from service.jobs import make_queue
from service.settings import Settings
from service.spec import toolchain_fingerprint
from service.storage import LocalStore, Store
from service.tenancy import Authenticator

log = logging.getLogger("stackfuse.api")

#: Seconds a Redis command may take before the API answers 503 instead of hanging.
_SOCKET_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 2.0
#: A pooled connection that died with a Redis restart fails once; retry it on a new socket.
_RETRY_ON = [redis_errors.ConnectionError, redis_errors.TimeoutError]


@dataclass
class AppState:
    """What handlers share; built in the lifespan, reached through ``api.StateDep``."""

    settings: Settings
    redis: aredis.Redis
    sync_redis: Redis  # RQ is sync; used from worker threads only
    queue: Queue
    store: Store
    toolchain: str
    auth: Authenticator


def build_state(settings: Settings) -> AppState:
    sync_conn = Redis.from_url(
        settings.redis_url,
        socket_timeout=_SOCKET_TIMEOUT_S,
        socket_connect_timeout=_CONNECT_TIMEOUT_S,
        retry_on_error=_RETRY_ON,
    )
    redis = aredis.Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        max_connections=512,
        socket_timeout=_SOCKET_TIMEOUT_S,
        socket_connect_timeout=_CONNECT_TIMEOUT_S,
        retry_on_error=_RETRY_ON,
    )
    return AppState(
        settings=settings,
        redis=redis,
        sync_redis=sync_conn,
        queue=make_queue(sync_conn, settings),
        store=LocalStore.for_data_dir(settings.data_dir, fsync=settings.store_fsync),
        toolchain=toolchain_fingerprint(),
        auth=Authenticator(redis, settings),
    )


async def warm_up(state: AppState) -> None:
    """Ask Redis its version once, off the event loop: RQ caches it, and enqueueing (recorded,
    see jobs.enqueue_commands) would otherwise ask it synchronously on the first request."""
    import anyio
    from redis.exceptions import RedisError

    try:
        await anyio.to_thread.run_sync(state.queue.get_redis_server_version)
    except RedisError as exc:  # Redis down at start: the API starts anyway and answers 503
        log.warning("Redis does not answer at start (%s); will ask again on first use", exc)
