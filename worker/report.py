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
    family: Literal[
        "cutlass_fmha_sm80", "cutlass_fmha_hopper", "cutlass_gemm_sm90", "cutlass_gemm_sm80"
    ]
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


class GemmCheckFailure(BaseModel):
    """One reason a GEMM pattern refused a matmul."""

    pattern: str
    check: str
    expected: str
    actual: str
    message: str


class GemmSite(BaseModel):
    """One ``R.matmul`` call: the CUTLASS GEMM it became (with what its epilogue fused), or why
    it stayed in TVM."""

    where: Where
    offloaded: bool
    pattern: str = ""
    epilogue: list[str] = Field(
        default_factory=list,
        description="What the kernel's epilogue computes after A @ B: bias, an activation "
        "(relu, gelu, gelu_tanh, silu), residual.",
    )
    dtype: str = ""
    shapes: dict[str, list[Dim]] = Field(default_factory=dict)
    b_layout: str = Field(
        default="",
        description="k_major: B read as stored [N, K] (a permute_dims folded into the layout); "
        "n_major: B as stored [K, N].",
    )
    bindings: list[str] = Field(default_factory=list, description="Bindings the kernel replaces.")
    kernel: KernelChoice | None = None
    reason: str = Field(default="", description="Why the matmul stayed in TVM.")
    check_failures: list[GemmCheckFailure] = Field(default_factory=list)


class Rewrite(BaseModel):
    """A normalization applied before matching (transpose pair cancelled, attention recovered)."""

    rewrite: str
    where: Where | None = None
    message: str


class SiteReason(BaseModel):
    """Why an attention site is not fused stacked, or why a chain that computes attention was
    not seen as one, in a sentence a person can act on."""

    where: Where | None = None
    outcome: Literal["fused_plain", "not_offloaded", "not_attention"]
    reason: str


class Summary(BaseModel):
    attention_sites: int = 0
    fused_stacked: int = 0
    fused_plain: int = 0
    not_offloaded: int = 0
    not_attention: int = Field(
        default=0, description="matmul -> softmax -> matmul chains not recognised as attention."
    )
    gemm_sites: int = 0
    gemm_offloaded: int = 0
    gemm_configurations: int = Field(
        default=0, description="Distinct CUTLASS GEMM configurations the library links."
    )


class Library(BaseModel):
    sha256: str
    size_bytes: int
    file: str = "model.so"
    calling_convention: str = Field(
        default="main(*inputs, *params)",
        description="How to call the library: with weight transforms lifted, "
        "params = main_transform_params(params) once at load, then main(*inputs, *params).",
    )


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
    site_reasons: list[SiteReason] = Field(default_factory=list)
    gemms: list[GemmSite] = Field(default_factory=list)
    summary: Summary = Field(default_factory=Summary)
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds per stage.")
    library: Library | None = None
    validation: Validation = Field(
        default_factory=lambda: Validation(status="not_run", reason="not requested")
    )
    error: dict[str, str] | None = Field(
        default=None, description="Set when the job failed after partitioning ran."
    )
