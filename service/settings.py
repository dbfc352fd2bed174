"""Every tunable of Stackfuse, in one place.

Values come from the environment (prefix ``STACKFUSE_``; ``REDIS_URL`` is also read bare, as
container platforms set it). Defaults are chosen so that ``stackfuse serve`` works on a fresh
machine with nothing configured. Nothing here imports TVM, FastAPI or RQ.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024
GiB = 1024 * MiB


def default_data_dir() -> Path:
    """Per user, not per working directory: ``$XDG_DATA_HOME/stackfuse`` (default
    ``~/.local/share/stackfuse``), so that running from another folder reuses the caches."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "stackfuse"


class Settings(BaseSettings):
    """Runtime configuration shared by the API, the workers and the CLI."""

    model_config = SettingsConfigDict(env_prefix="STACKFUSE_", extra="ignore")

    # --- infrastructure -------------------------------------------------------------------
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("STACKFUSE_REDIS_URL", "REDIS_URL"),
        description="Redis holding the queue and job records.",
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Content-addressed store shared by API and workers (inputs, outputs); "
        "default $XDG_DATA_HOME/stackfuse (~/.local/share/stackfuse).",
    )
    kernel_cache_dir: Path | None = Field(
        default=None,
        description="Kernel objects by sha256(source, flags, nvcc); default <data_dir>/kernels.",
    )
    queue_name: str = "stackfuse"

    # --- API ------------------------------------------------------------------------------
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_workers: int = Field(
        default=1, description="API processes `stackfuse api` runs (the check is CPU-bound)."
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Logs of the API and the workers: text, or json (one JSON object per line "
        "with the job id, for log collectors).",
    )
    max_body_bytes: int = Field(default=64 * MiB, description="Largest POST /optimize body.")
    retry_after_s: int = Field(default=2, description="Retry-After sent while a job runs.")
    max_idempotency_key_chars: int = Field(default=255, description="Longest Idempotency-Key.")
    parse_in_process_bytes: int = Field(
        default=16 * 1024,
        description="Bodies larger than this are decoded and checked in a child process, off "
        "the event loop (the structural check costs ~0.3 ms per KiB).",
    )
    parse_processes: int = Field(
        default=1, description="Child processes per API process that decode large bodies."
    )
    parse_memory_bytes: int = Field(
        default=4 * GiB,
        description="Address space of a decoding child (RLIMIT_AS); a body needing more is a 413.",
    )
    parse_tasks_per_process: int = Field(
        default=64, description="Bodies a decoding child handles before it is replaced."
    )
    max_header_bytes: int = Field(
        default=32 * 1024, description="Request line and headers of one request, in bytes (431)."
    )
    max_header_count: int = Field(default=100, description="Headers of one request (431).")
    header_timeout_s: float = Field(
        default=10.0, description="From a request's first byte to the end of its headers (408)."
    )
    body_idle_timeout_s: float = Field(
        default=15.0, description="Longest wait for the next bytes of a request body (408)."
    )
    body_timeout_s: float = Field(
        default=120.0, description="From the end of the headers to the end of the body (408)."
    )
    keep_alive_timeout_s: int = Field(
        default=30,
        description="An open connection without a request in progress is closed after this.",
    )

    # --- API keys and tenants (service/tenancy.py) ------------------------------------------
    auth_required: bool = Field(
        default=False,
        description="Refuse requests without a valid API key even while no key exists yet "
        "(otherwise, with no keys, the API is open: one implicit tenant, 'local').",
    )
    auth_cache_ttl_s: float = Field(
        default=2.0,
        description="How long an API process reuses a key lookup (and whether keys exist); "
        "a revoked key, or the first key created, takes effect within this. 0: ask Redis "
        "every request.",
    )
    metrics_public: bool = Field(
        default=False,
        description="GET /metrics without a key while keys are configured (else admin only).",
    )
    tenant_max_active_jobs: int = Field(
        default=32,
        description="Jobs of one tenant queued or running at once; past it POST /optimize is "
        "a 429. 0: no limit. The open mode's tenant has none.",
    )
    tenant_max_stored_bytes: int = Field(
        default=50 * GiB,
        description="Bytes the live jobs of one tenant name in the store (module, library, "
        "report; each job counted in full); at or past it POST /optimize is a 429. 0: no "
        "limit. The open mode's tenant has none.",
    )
    quota_retry_after_s: int = Field(
        default=30, description="Retry-After of a 429 for too many jobs queued or running."
    )
    storage_quota_retry_after_s: int = Field(
        default=3600,
        description="Retry-After of a 429 for bytes stored: space is given back as the "
        "tenant's job records expire (result_ttl_s) and gc reconciles the count.",
    )

    # --- module limits (checked before TVM parses anything, then on the loaded IR) ----------
    max_json_nodes: int = 500_000  # wire check costs ~11 us per node of API CPU
    max_json_values: int = Field(
        default=4_000_000,
        description="JSON values (objects, arrays, strings, numbers) in a TVM JSON module, "
        "counted before it is parsed; TVM writes ~5.6 per node.",
    )
    max_json_depth: int = 64
    max_functions: int = 256
    max_bindings: int = 100_000
    max_tensor_rank: int = 8
    max_dim: int = 2**31 - 1
    max_tensor_elements: int = 2**40
    max_constant_bytes: int = 2 * GiB
    max_string_bytes: int = 4096
    max_ir_depth: int = Field(
        default=256,
        description="Longest reference chain in the IR graph (TVM's loader and passes recurse).",
    )
    max_script_bytes: int = Field(default=8 * MiB, description="Largest TVMScript text accepted.")
    max_script_depth: int = Field(default=64, description="Deepest syntax tree in TVMScript.")

    # --- jobs -----------------------------------------------------------------------------
    job_timeout_s: int = Field(default=1800, description="Wall time of one job in a work-horse.")
    job_retries: int = Field(default=2, description="Retries after an infrastructure death.")
    job_retry_intervals_s: list[int] = Field(default_factory=lambda: [5, 30])
    result_ttl_s: int = Field(default=7 * 24 * 3600, description="Finished job records kept.")
    failure_ttl_s: int = Field(default=7 * 24 * 3600, description="Failed job records kept.")
    idempotency_ttl_s: int = 24 * 3600
    worker_heartbeat_s: int = 10
    worker_ttl_s: int = Field(default=60, description="A worker silent this long is lost.")
    maintenance_interval_s: int = Field(
        default=30,
        description="How often a worker looks for jobs of lost workers (and re-queues them).",
    )
    worker_count: int | None = Field(
        default=None, description="RQ workers `stackfuse worker` starts; default one per GPU."
    )
    shutdown_grace_s: int = Field(
        default=10,
        description="`stackfuse serve`: how long Ctrl-C waits for a running job before killing it.",
    )
    store_fsync: bool = Field(
        default=True, description="fsync stored objects before publishing them (crash safety)."
    )

    # --- retention (service/retention.py: `stackfuse gc` and the workers' periodic gc job) ---
    gc_interval_s: int = Field(
        default=3600, description="How often one worker enqueues the gc job; 0: never."
    )
    gc_min_age_s: int = Field(
        default=3600,
        description="Nothing younger is collected: a module is stored just before its job "
        "record is written, and an attempt directory may belong to a worker that is only slow.",
    )
    kernel_cache_ttl_s: int = Field(
        default=30 * 24 * 3600, description="Kernel cache entries unused this long are deleted."
    )
    kernel_cache_max_bytes: int = Field(
        default=0,
        description="Disk budget of the kernel cache: least recently used entries go first "
        "beyond it; 0: no budget.",
    )

    # --- toolchain ------------------------------------------------------------------------
    cuda_home: Path | None = Field(default=None, description="CUDA toolkit root; found if unset.")
    nvcc_timeout_s: int = 600
    nvcc_memory_bytes: int = 8 * GiB
    nvcc_threads: int = 2
    link_timeout_s: int = 300
    link_cudart: Literal["shared", "static"] = Field(
        default="shared",
        description="shared: the library needs libcudart.so.13 (as TVM's CUDA runtime does); "
        "static: embed it (+1.5 MB).",
    )
    max_output_file_bytes: int = 2 * GiB
    error_excerpt_chars: int = 2000

    # --- validation (runs the built library on a GPU, in a separate process) ---------------
    validate_on_gpu: bool = Field(default=True, description="Validate on a GPU when there is one.")
    validate_timeout_s: int = 300
    validate_cpu_s: int = 300
    validate_memory_bytes: int = 64 * GiB

    @field_validator("data_dir", "kernel_cache_dir")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        """Absolute from the start: nvcc and the validation child run in other directories, so a
        relative path would name a different place there."""
        return path.expanduser().absolute() if path is not None else None

    def resolved_kernel_cache_dir(self) -> Path:
        return self.kernel_cache_dir or (self.data_dir / "kernels")


#: Query parameters that carry a credential in a connection URL (redis-py reads ``password``).
_SECRET_PARAMS = frozenset({"password", "pass", "pwd", "secret", "token", "auth", "key"})


def redact_url(url: str) -> str:
    """``url`` fit for a message or a log: userinfo (``user:pass@``) and credential query
    parameters (``?password=...``) replaced by ``***``; unparseable input is hidden whole."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "***@" + netloc.rsplit("@", 1)[1]
        query = urlencode(
            [
                (k, "***" if k.lower() in _SECRET_PARAMS else v)
                for k, v in parse_qsl(parts.query, keep_blank_values=True)
            ],
            safe="*",
        )
        head = f"{parts.scheme}://{netloc}" if "//" in url else f"{parts.scheme}:{netloc}"
        return head + parts.path + (f"?{query}" if query else "")
    except ValueError:
        return "***"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once; tests build their own ``Settings`` instead."""
    return Settings()
