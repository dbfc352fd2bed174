"""Request and response bodies of the HTTP API (pydantic only; no FastAPI, no TVM).

The same models document the API in OpenAPI and give `stackfuse submit` typed answers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.spec import CompileOptions, Target

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
ModuleFormat = Literal["tvm-json", "tvmscript"]

#: Statuses after which a job never changes again.
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class OptimizeRequest(BaseModel):
    """Body of POST /optimize."""

    model_config = ConfigDict(extra="forbid")

    module: str = Field(
        min_length=1, description="The Relax module, serialized as `format` says (not empty)."
    )
    format: ModuleFormat = Field(
        default="tvm-json", description="`tvm-json` (tvm.ir.save_json) or `tvmscript` text."
    )
    target: Target = Field(
        default_factory=Target,
        description='The GPU to build for; when left out, `{"arch": "sm_90"}` (Hopper).',
    )
    options: CompileOptions = Field(
        default_factory=CompileOptions, description="Compile options; every one has a default."
    )


class JobError(BaseModel):
    """Why a job failed: a stable type, a title, and a message a person can act on."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    message: str


class JobLinks(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    self_: str = Field(alias="self", serialization_alias="self")
    artifact: str | None = None
    report: str | None = None


class JobView(BaseModel):
    """What GET /jobs/{id} answers."""

    model_config = ConfigDict(populate_by_name=True)

    id: str
    status: JobStatus
    stage: str = Field(description="ingest, partition, codegen, build, link, validate, done ...")
    detail: str = Field(default="", description="e.g. 'kernel 2 of 3'.")
    progress: float = Field(ge=0.0, le=1.0)
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = Field(description="Times a worker started this job (retries included).")
    cached: bool = Field(description="Answered from the compile cache, without compiling.")
    input_sha256: str
    artifact_sha256: str | None = None
    target: Target
    options: CompileOptions
    format: ModuleFormat
    error: JobError | None = None
    last_error: JobError | None = Field(
        default=None, description="The failure that caused the latest retry, while retrying."
    )
    links: JobLinks


class JobList(BaseModel):
    """What GET /jobs answers: the caller's jobs, newest first, one page."""

    jobs: list[JobView]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last page."
    )


class Problem(BaseModel):
    """RFC 9457 problem details, the body of every error response."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None


class Health(BaseModel):
    status: Literal["ok"]
    checks: dict[str, Any] = Field(default_factory=dict)
