"""The fusion report: what matched where, what was refused and why, and what was built.

Plain pydantic, no TVM import, so the API can serve and document it. ``schema_version`` is bumped
on any incompatible change; fields are only ever added within one version.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

SCHEMA_VERSION = 1

Dim = int | str  # a static extent, or the name of a symbolic one ("b", "seq_len")


class Where(BaseModel):
    """A place in the client's module, by its own names (never used in generated code)."""

    function: str = Field(description="Relax function holding the site.")
    site: str = Field(description="Stable id of the attention call, e.g. 'main/attention#0'.")
    binding: str = Field(description="Name of the variable the attention result is bound to.")


class Layout(BaseModel):
    """How the kernel addresses Q, K and V: element offsets from each operand's base pointer and
    element strides per row (sequence position), head and batch."""

    source: Literal["stacked", "separate"]
    q_offset: int
    k_offset: int
    v_offset: int
    row_stride: dict[str, int] = Field(description="q/k/v stride between sequence positions.")
    head_stride: dict[str, int] = Field(description="q/k/v stride between heads.")
    batch_stride: dict[str, Dim] = Field(description="q/k/v stride between batch entries.")
    order: str = Field(default="qkv", description="Order of the blocks in the stacked row.")
    packing: Literal["blocked", "per_head", "separate"] = "blocked"


class KernelChoice(BaseModel):
    family: Literal["cutlass_fmha_sm80", "cutlass_fmha_hopper"]
    symbol: str
    reason: str
    config: dict[str, int | bool | str] = Field(default_factory=dict)
    workspace_bytes: Dim = 0
    compile_seconds: float = 0.0
    cache_hit: bool = False


class Match(BaseModel):
    """One attention site that became a single CUTLASS kernel."""

    where: Where
    pattern: str
    kind: Literal["stacked", "plain"]
    variant: Literal["split", "strided_slice", "interleaved", "none"]
    bias: bool
    causal: Literal["none", "TopLeft", "BottomRight"]
    dtype: str
    shapes: dict[str, list[Dim]]
    bindings: list[str] = Field(description="Client bindings the kernel replaces.")
    scale: float
    layout: Layout
    kernel: KernelChoice | None = None


class CheckFailure(BaseModel):
    """One reason a candidate was refused by one pattern."""

    where: Where
    pattern: str
    check: str
    expected: str
    actual: str
    message: str


class Rewrite(BaseModel):
    """A normalization applied before matching (transpose pair cancelled, attention recovered)."""

    rewrite: str
    where: Where | None = None
    message: str


class Summary(BaseModel):
    attention_sites: int = 0
    fused_stacked: int = 0
    fused_plain: int = 0
    not_offloaded: int = 0


class Library(BaseModel):
    sha256: str
    size_bytes: int
    file: str = "model.so"


class Validation(BaseModel):
    status: Literal["not_run", "passed", "failed", "error"]
    reason: str = ""
    device: str | None = None
    max_abs_error: float | None = None
    tolerance: float | None = None
    seconds_fused: float | None = None
    seconds_reference: float | None = None


class Report(BaseModel):
    schema_version: int = SCHEMA_VERSION
    input_sha256: str
    target: dict[str, str]
    toolchain: dict[str, str] = Field(default_factory=dict)
    normalizations: list[Rewrite] = Field(default_factory=list)
    matches: list[Match] = Field(default_factory=list)
    check_failures: list[CheckFailure] = Field(default_factory=list)
    summary: Summary = Field(default_factory=Summary)
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per stage.")
    library: Library | None = None
    validation: Validation = Field(
        default_factory=lambda: Validation(status="not_run", reason="not requested")
    )
    error: dict[str, str] | None = Field(
        default=None, description="Set when the job failed after partitioning ran."
    )
