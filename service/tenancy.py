"""API keys and tenants: who a caller is, and what a tenant holds. No FastAPI, no TVM.

A key is ``sf_`` + 32 random bytes (``secrets.token_urlsafe``), shown once by
``stackfuse keys create`` and stored only as its sha256. A fast hash is enough here: the
token has 256 bits of entropy, so nobody can search for it from its hash, which is what slow
password hashes (bcrypt, argon2) defend against for low-entropy passwords; and it keeps the
per-request check to one Redis lookup.

Modes: while no key has ever been created (and ``auth_required`` is off) the API is open:
every caller is the implicit tenant :data:`LOCAL_TENANT`, with no quotas, as before keys
existed. Once a key exists (revoked ones count, so revoking the last key does not reopen the
API) every route but ``/healthz``, ``/readyz`` and the OpenAPI document needs
``Authorization: Bearer <key>``; jobs, artifacts, reports, idempotency keys and compile cache
entries then belong to the key's tenant.

Redis layout (all under :data:`service.jobs.PREFIX`):

- ``key:<sha256>``: hash ``key_id``, ``tenant``, ``admin`` (0/1), ``revoked`` (0/1),
  ``created_at``; the one lookup of a request;
- ``keys``: hash ``key_id -> sha256``, for ``keys list`` / ``keys revoke`` and to tell whether
  keys are configured;
- ``tenant:<name>:jobs``: zset ``job_id -> created (us)``, read by ``GET /jobs``;
- ``tenant:<name>:active``: zset of the tenant's queued or running jobs (its job quota);
- ``tenant:<name>:stored``: hash ``job_id -> bytes`` of finished jobs, and
  ``tenant:<name>:stored_bytes``, their sum (its storage quota). Retention
  (:func:`reconcile`) drops the jobs whose records expired.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from service.errors import Forbidden, QuotaExceeded, RequestError, Unauthorized
from service.settings import Settings

if TYPE_CHECKING:
    from redis import Redis
    from redis.asyncio import Redis as AsyncRedis

PREFIX = "stackfuse"  # service.jobs.PREFIX (jobs imports this module)
#: The tenant of every caller while the API is open (no keys configured).
LOCAL_TENANT = "local"
TOKEN_PREFIX = "sf_"
KEYS_INDEX = f"{PREFIX}:keys"
#: Tenant names end up in Redis keys and in logs: a short slug, no separators.
_TENANT = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_KEY_ID = re.compile(r"^key_[0-9a-f]{16}$")
#: Entries of an API process's key cache before it is cleared (bounds its memory).
_CACHE_MAX = 4096
#: Longest Authorization header read (a token is 46 characters).
_MAX_AUTHORIZATION = 256


def key_record(digest: str) -> str:
    return f"{PREFIX}:key:{digest}"


def tenant_key(tenant: str, what: str) -> str:
    """``jobs``, ``active``, ``stored`` or ``stored_bytes`` of ``tenant``."""
    return f"{PREFIX}:tenant:{tenant}:{what}"


#: SCAN patterns retention reconciles.
ACTIVE_PATTERN = tenant_key("*", "active")
STORED_PATTERN = tenant_key("*", "stored")
JOBS_PATTERN = tenant_key("*", "jobs")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_tenant(name: str) -> str:
    if not _TENANT.match(name):
        raise RequestError(
            f"tenant {name[:64]!r} is not a valid name: 1 to 63 of a-z, 0-9, '-' and '_', "
            "starting with a letter or digit"
        )
    return name


# --- keys (the admin CLI; sync Redis) --------------------------------------------------------
@dataclass(frozen=True)
class KeyInfo:
    """A key as `keys list` shows it: never the token, never its hash."""

    key_id: str
    tenant: str
    admin: bool
    revoked: bool
    created_at: str

    @classmethod
    def of(cls, raw: dict[Any, Any]) -> KeyInfo:
        r = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            key_id=r.get("key_id", ""),
            tenant=r.get("tenant", ""),
            admin=r.get("admin") == "1",
            revoked=r.get("revoked") == "1",
            created_at=r.get("created_at", ""),
        )


def create_key(conn: Redis, tenant: str, *, admin: bool = False) -> tuple[str, KeyInfo]:
    """A new key for ``tenant``: ``(token, info)``. The token is not stored; only its hash."""
    check_tenant(tenant)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    digest = hash_token(token)
    info = KeyInfo(
        key_id=f"key_{secrets.token_hex(8)}",
        tenant=tenant,
        admin=admin,
        revoked=False,
        created_at=datetime.now(UTC).isoformat(),
    )
    with conn.pipeline(transaction=True) as pipe:
        pipe.hset(
            key_record(digest),
            mapping={
                "key_id": info.key_id,
                "tenant": tenant,
                "admin": "1" if admin else "0",
                "revoked": "0",
                "created_at": info.created_at,
            },
        )
        pipe.hset(KEYS_INDEX, info.key_id, digest)
        pipe.execute()
    return token, info


def list_keys(conn: Redis) -> list[KeyInfo]:
    digests = [_text(d) for d in conn.hvals(KEYS_INDEX)]
    with conn.pipeline(transaction=False) as pipe:
        for digest in digests:
            pipe.hgetall(key_record(digest))
        rows = pipe.execute()
    keys = [KeyInfo.of(raw) for raw in rows if raw]
    return sorted(keys, key=lambda k: (k.created_at, k.key_id))


def revoke_key(conn: Redis, key_id: str) -> KeyInfo | None:
    """Mark a key revoked (kept, so `keys list` shows it); None when there is no such key."""
    digest = conn.hget(KEYS_INDEX, key_id) if _KEY_ID.match(key_id) else None
    if digest is None:
        return None
    record = key_record(_text(digest))
    if not conn.exists(record):
        return None
    conn.hset(record, "revoked", "1")
    return KeyInfo.of(conn.hgetall(record))


def keys_configured(conn: Redis) -> bool:
    return bool(conn.exists(KEYS_INDEX))


# --- callers (the API; asyncio Redis) ---------------------------------------------------------
@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant its jobs belong to, and whether it may administer."""

    tenant: str
    admin: bool = False
    key_id: str | None = None  # None: the open mode's implicit caller

    @property
    def open(self) -> bool:
        return self.key_id is None


OPEN_CALLER = Caller(LOCAL_TENANT, admin=True)


@dataclass(frozen=True)
class Quota:
    """What a tenant may hold at once; 0 is no limit."""

    max_active_jobs: int = 0
    max_stored_bytes: int = 0

    @classmethod
    def for_caller(cls, caller: Caller, settings: Settings) -> Quota | None:
        if caller.open:
            return None
        return cls(settings.tenant_max_active_jobs, settings.tenant_max_stored_bytes)


class Authenticator:
    """Turns an ``Authorization`` header into a :class:`Caller`, with one Redis round trip
    (key record + whether keys exist, pipelined) and a small in-process cache of
    ``auth_cache_ttl_s`` (so a revocation takes effect within that time)."""

    def __init__(self, redis: AsyncRedis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self._mode: tuple[float, bool] | None = None  # (until, keys configured)
        self._keys: dict[str, tuple[float, Caller | None]] = {}

    def _cached_mode(self, now: float) -> bool | None:
        if self._mode is not None and self._mode[0] > now:
            return self._mode[1]
        return None

    def _remember(self, now: float, configured: bool, digest: str | None, who: Any) -> None:
        ttl = self.settings.auth_cache_ttl_s
        if ttl <= 0:
            return
        self._mode = (now + ttl, configured)
        if digest is not None and who is not None:  # a known key (valid or revoked) only
            if len(self._keys) >= _CACHE_MAX:
                self._keys.clear()
            self._keys[digest] = (now + ttl, who if isinstance(who, Caller) else None)

    async def caller(self, authorization: str | None) -> Caller:
        """The caller, or :class:`Unauthorized` when keys are configured and the header does
        not carry a valid one. The token is never logged nor put in an error."""
        now = time.monotonic()
        token = _bearer(authorization)
        digest = hash_token(token) if token else None
        if digest is not None:
            hit = self._keys.get(digest)
            if hit is not None and hit[0] > now:
                if hit[1] is not None:
                    return hit[1]
                raise _invalid("the API key was revoked")
        configured = self._cached_mode(now)
        record: dict[str, str] = {}
        if digest is not None or configured is None:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.exists(KEYS_INDEX)
                if digest is not None:
                    pipe.hgetall(key_record(digest))
                results = await pipe.execute()
            configured = bool(results[0])
            if digest is not None:
                record = {_text(k): _text(v) for k, v in results[1].items()}
        keyed = configured or self.settings.auth_required
        if not keyed:
            self._remember(now, bool(configured), None, None)
            return OPEN_CALLER  # open mode: any Authorization header is ignored
        if not record:
            self._remember(now, bool(configured), None, None)
            if authorization is None:
                raise Unauthorized(
                    "this API needs a key: send 'Authorization: Bearer <key>' (an operator "
                    "creates keys with `stackfuse keys create --tenant NAME`)",
                    challenge='Bearer realm="stackfuse"',
                )
            if token is None:
                raise Unauthorized(
                    "the Authorization header must be 'Bearer <key>'",
                    challenge='Bearer realm="stackfuse", error="invalid_request"',
                )
            raise _invalid("the API key is not valid")
        if record.get("revoked") == "1":
            self._remember(now, True, digest, False)
            raise _invalid("the API key was revoked")
        who = Caller(
            tenant=record.get("tenant", ""),
            admin=record.get("admin") == "1",
            key_id=record.get("key_id", ""),
        )
        self._remember(now, True, digest, who)
        return who

    async def admin(self, authorization: str | None) -> Caller:
        """An admin caller (any caller while the API is open), else 401/403."""
        who = await self.caller(authorization)
        if not who.admin:
            raise Forbidden("this route needs an admin key (`stackfuse keys create --admin`)")
        return who


def _invalid(message: str) -> Unauthorized:
    return Unauthorized(message, challenge='Bearer realm="stackfuse", error="invalid_token"')


def _bearer(authorization: str | None) -> str | None:
    if not authorization or len(authorization) > _MAX_AUTHORIZATION:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token.startswith(TOKEN_PREFIX):
        return None
    return token


# --- quotas and accounting (queued on a sync or asyncio pipeline) ------------------------------
#: Reserve a slot among a tenant's active jobs. KEYS[1]=active zset; ARGV=job id, score,
#: oldest score kept (older members are leftovers of expired records), limit (0: none).
#: Returns 1 when reserved, else -(jobs active).
RESERVE_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
local limit = tonumber(ARGV[4])
if limit > 0 then
  local n = redis.call('ZCARD', KEYS[1])
  if n >= limit then return -n end
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""

#: Count a finished job's stored bytes once. KEYS[1]=stored hash, KEYS[2]=sum; ARGV=job, bytes.
_ACCOUNT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('INCRBY', KEYS[2], ARGV[2])
end
return 1
"""

#: Give a job's bytes back. KEYS as _ACCOUNT; ARGV=job. Returns the bytes released.
_RELEASE_STORED = """
local n = redis.call('HGET', KEYS[1], ARGV[1])
if not n then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[2], n)
return tonumber(n)
"""


def score_now() -> int:
    """Microseconds since the epoch: exact as a Redis zset score (under 2**53)."""
    return time.time_ns() // 1000


def account_stored(pipe: Any, tenant: str, job_id: str, nbytes: int) -> None:
    pipe.eval(
        _ACCOUNT, 2, tenant_key(tenant, "stored"), tenant_key(tenant, "stored_bytes"), job_id,
        str(max(0, nbytes)),
    )  # fmt: skip


def release_active(pipe: Any, tenant: str, job_id: str) -> None:
    pipe.zrem(tenant_key(tenant, "active"), job_id)


def quota_refused_jobs(active: int, limit: int, settings: Settings) -> QuotaExceeded:
    return QuotaExceeded(
        f"this tenant has {active} jobs queued or running, its limit; submit again when one "
        "finishes (or cancel one with DELETE /jobs/{id})",
        quota="active_jobs",
        limit=limit,
        retry_after_s=settings.quota_retry_after_s,
    )


def quota_refused_bytes(stored: int, limit: int, settings: Settings) -> QuotaExceeded:
    return QuotaExceeded(
        f"this tenant's jobs hold {stored} bytes in the store, at or past its limit of "
        f"{limit}; space is given back as its job records expire",
        quota="stored_bytes",
        limit=limit,
        stored=stored,
        retry_after_s=settings.storage_quota_retry_after_s,
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- reconciliation (retention; sync Redis) ---------------------------------------------------
def reconcile(conn: Redis, record_key: Any, terminal: frozenset[str], oldest: float) -> int:
    """Drop what expired job records left in the tenants' accounting: active slots of jobs
    whose record is gone or finished, stored bytes of jobs whose record is gone, list entries
    older than any live record (``oldest``, a :func:`score_now` value). Returns the number of
    stored-byte entries released."""
    released = 0
    for key in _scan(conn, ACTIVE_PATTERN):
        members = [_text(m) for m in conn.zrange(key, 0, -1)]  # type: ignore[arg-type]
        with conn.pipeline(transaction=False) as pipe:
            for job_id in members:
                pipe.hget(record_key(job_id), "status")
            statuses = pipe.execute()
        stale = [m for m, s in zip(members, statuses, strict=True) if not s or _text(s) in terminal]
        if stale:
            conn.zrem(key, *stale)
    for key in _scan(conn, STORED_PATTERN):
        tenant = _text(key).split(":")[2]
        members = [_text(m) for m in conn.hkeys(key)]
        with conn.pipeline(transaction=False) as pipe:
            for job_id in members:
                pipe.exists(record_key(job_id))
            alive = pipe.execute()
        for job_id, exists in zip(members, alive, strict=True):
            if not exists:
                conn.eval(_RELEASE_STORED, 2, key, tenant_key(tenant, "stored_bytes"), job_id)
                released += 1
    for key in _scan(conn, JOBS_PATTERN):
        conn.zremrangebyscore(key, "-inf", f"({int(oldest)}")
    return released


def _scan(conn: Redis, pattern: str) -> list[Any]:
    return list(conn.scan_iter(match=pattern, count=1000))
