"""The fusion report: what matched where, what was refused and why, and what was built.

Plain pydantic, no TVM import, so the API can serve and document it. ``schema_version`` is bumped
on any incompatible change; fields are only ever added within one version.

Units: every duration is in seconds and its field name ends in ``_s``; sizes end in ``_bytes``.
Every site has a one-line ``verdict`` in plain English; ``sites`` lists them all (attention and
GEMM) in one place. A module that came through ``stackfuse import`` gets the user's own names
(torch module paths or ONNX initializer names, from the import manifest) under ``names``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, Field

#: 2: durations renamed to ``*_s`` (``timings`` keys, ``KernelChoice.compile_s``), ``cache_hit``
#: split into ``cached`` + ``original_compile_s``, ``verdict``, ``names``, ``sites`` added.
SCHEMA_VERSION = 2

Dim = int | str  # a static extent, or the name of a symbolic one ("b", "seq_len")


class Where(BaseModel):
    """A place in the client's module, by its own names (never used in generated code)."""

    function: str = Field(description="Relax function holding the site.")
    site: str = Field(description="Stable id of the attention call, e.g. 'main/attention#0'.")
    binding: str = Field(description="Name of the variable the attention result is bound to.")


class Ragged(BaseModel):
    """A ragged batch (``R.nn.attention_var_len``): sequences of different lengths packed one
    after another along the token axis of a batch of one. The kernel reads where each sequence
    starts from ``seqstart`` at run time and attends within each sequence."""

    seqstart_q: str = Field(description="The int32 [B+1] tensor of query offsets, by its name.")
    seqstart_k: str = Field(description="Key offsets: the same name when queries share them.")
    sequences: Dim = Field(description="B: seqstart's extent less one.")


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
    ragged: Ragged | None = Field(
        default=None, description="Set for a ragged batch: one batch entry of packed sequences."
    )


class UserNames(BaseModel):
    """Where a site is in the user's own model.

    ``weights`` (the module's parameters feeding the site: the projection weights and biases)
    and a ``layer`` read from their names are always filled in; ``module`` and ``projections``
    need the import manifest (``model.inputs.json``, which ``stackfuse compile`` and
    ``stackfuse submit`` read from beside the model)."""

    module: str = Field(
        default="",
        description="Torch module path (or ONNX name prefix) of the site, e.g. "
        "'transformer.h.3.attn' for an attention, 'transformer.h.3.mlp.c_fc' for a GEMM.",
    )
    projections: list[str] = Field(
        default_factory=list,
        description="Modules of the projections whose outputs the site reads (the QKV "
        "projection of an attention) or that the site is (a GEMM).",
    )
    layer: int | None = Field(
        default=None, description="Layer index (the first number in the path)."
    )
    weights: list[str] = Field(
        default_factory=list, description="The module's parameters feeding the site."
    )


KERNEL_NAMES = {
    "cutlass_fmha_sm80": "CUTLASS FMHA kernel (SM80 class)",
    "cutlass_fmha_hopper": "Hopper FMHA kernel",
    "cutlass_gemm_sm90": "CUTLASS Hopper GEMM",
}


class KernelChoice(BaseModel):
    family: Literal[
        "cutlass_fmha_sm80", "cutlass_fmha_hopper", "cutlass_gemm_sm90", "cutlass_gemm_sm80"
    ]
    symbol: str = Field(description="Name of the kernel's entry point in the library.")
    reason: str = Field(description="Why this kernel and configuration were chosen.")
    config: dict[str, int | bool | str] = Field(default_factory=dict)
    workspace_bytes: Dim = 0
    compile_s: float = Field(
        default=0.0,
        description="Seconds this compile spent getting the kernel (about 0 when cached).",
    )
    cached: bool = Field(
        default=False,
        description="The kernel came from the kernel cache (or the whole job from the compile "
        "cache): nothing was compiled for it.",
    )
    original_compile_s: float | None = Field(
        default=None, description="When cached and known: seconds its first compile took."
    )


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
    verdict: str = Field(default="", description="What happened to the site, in one line.")
    names: UserNames = Field(default_factory=UserNames)


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
    verdict: str = Field(default="", description="What happened to the matmul, in one line.")
    names: UserNames = Field(default_factory=UserNames)


class SiteVerdict(BaseModel):
    """One line per site, attention and GEMM alike: the view to read first."""

    kind: Literal["attention", "gemm"]
    where: Where
    offloaded: bool
    verdict: str
    names: UserNames = Field(default_factory=UserNames)


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
    file: str = Field(
        default="model.so",
        description="The library's file name: stackfuse-<job>.so as the service's artifact "
        "download names it, model.so from `stackfuse compile`.",
    )
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
    seconds_fused: float | None = Field(
        default=None, description="Seconds per call, built library."
    )
    seconds_reference: float | None = Field(
        default=None, description="Seconds per call, the TVM-only reference."
    )


class DynamicDim(BaseModel):
    """A symbolic dim of the module's inputs (``stackfuse import --dynamic``): the library
    takes any extent up to ``upper_bound`` at run time."""

    name: str = Field(description="The dim's name in the module: batch, seq.")
    upper_bound: int | None = Field(
        default=None, description="tir_var_upper_bound; memory is planned for this extent."
    )
    inputs: list[str] = Field(
        default_factory=list, description="Where it appears: 'input[axis]', e.g. 'ids[1]'."
    )


class Report(BaseModel):
    schema_version: int = SCHEMA_VERSION
    input_sha256: str
    target: dict[str, str]
    toolchain: dict[str, str] = Field(default_factory=dict)
    dynamic: list[DynamicDim] = Field(
        default_factory=list,
        description="The inputs' symbolic dims and their bounds; empty for a static module.",
    )
    normalizations: list[Rewrite] = Field(default_factory=list)
    matches: list[Match] = Field(default_factory=list)
    check_failures: list[CheckFailure] = Field(default_factory=list)
    site_reasons: list[SiteReason] = Field(default_factory=list)
    gemms: list[GemmSite] = Field(default_factory=list)
    sites: list[SiteVerdict] = Field(
        default_factory=list, description="Every site's verdict, attention sites first."
    )
    summary: Summary = Field(default_factory=Summary)
    cached: bool = Field(
        default=False,
        description="True when the job was answered from the compile cache: nothing was "
        "compiled for it, and the figures below are those of the job that built the library "
        "(original_job).",
    )
    original_job: str | None = Field(
        default=None, description="When cached: the job that built the library."
    )
    compile_s: float = Field(
        default=0.0, description="Seconds this job spent compiling (0 when cached)."
    )
    original_compile_s: float | None = Field(
        default=None, description="When cached: seconds the original compile took."
    )
    timings: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds per stage of the compile that built the library; keys are "
        "'<stage>_s' (ingest_s, normalize_s, partition_s, codegen_s, build_s, validate_s).",
    )
    library: Library | None = None
    validation: Validation = Field(
        default_factory=lambda: Validation(status="not_run", reason="not requested")
    )
    error: dict[str, str] | None = Field(
        default=None, description="Set when the job failed after partitioning ran."
    )


# --- what a person reads: verdicts, the user's names, a cached job's view ---------------------
_LAYER = re.compile(r"(?:^|[._])(\d+)(?=[._])")


def layer_of(name: str) -> int | None:
    """The first number standing alone in a dotted (or code-name) path with more path after
    it: 3 in 'transformer.h.3.attn' and 'p_transformer_h_3_attn_c_attn_weight', none in ONNX's
    node counter 'onnx::MatMul_7'."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _module_of(origin: str) -> str:
    """'transformer.h.3.attn.c_attn.weight' -> 'transformer.h.3.attn.c_attn'."""
    head, dot, _ = origin.rpartition(".")
    return head if dot else origin


def _common_module(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common: list[str] = []
    for group in zip(*parts, strict=False):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    if len(parts) == 1 or len(common) == len(parts[0]):  # one projection: the module above it
        common = parts[0][:-1] or parts[0]
    return ".".join(common)


def names_for(weights: list[str], origins: dict[str, str], kind: str) -> UserNames:
    """The user's names of a site from the parameters feeding it and the manifest's origins
    (parameter -> state-dict key / ONNX initializer); empty where the manifest has none."""
    projections: list[str] = []
    for w in weights:
        mod = _module_of(origins[w]) if origins.get(w) else ""
        if mod and mod not in projections:
            projections.append(mod)
    if kind == "gemm" and len(projections) <= 1:
        module = projections[0] if projections else ""
    else:  # an attention, or one GEMM made of several projections (combine_projections)
        module = _common_module(projections)
    layer = next(
        (n for n in map(layer_of, [module, *projections, *weights]) if n is not None), None
    )
    return UserNames(module=module, projections=projections, layer=layer, weights=list(weights))


def _named(names: UserNames) -> str:
    bits = [f"layer {names.layer}"] if names.layer is not None else []
    if names.module:
        bits.append(names.module)
    return f" ({', '.join(bits)})" if bits else ""


def _kernel_text(kernel: KernelChoice | None) -> str:
    if kernel is None:
        return "matched, but no kernel was built (the job failed)"
    how = "from the kernel cache" if kernel.cached else f"compiled in {kernel.compile_s:.1f} s"
    return f"runs as one {KERNEL_NAMES.get(kernel.family, kernel.family)}, {how}"


def match_verdict(m: Match) -> str:
    what = {"stacked": "stacked-QKV attention", "plain": "attention"}[m.kind]
    reads = ", reading Q, K and V in place from the stacked tensor" if m.kind == "stacked" else ""
    if m.layout.ragged is not None:
        reads += ", each packed sequence attending to its own keys (seqstart)"
    if m.kernel is None:
        return f"Fused {what}{_named(m.names)}: {_kernel_text(None)}."
    return f"Fused {what}{_named(m.names)}: {_kernel_text(m.kernel)}{reads}."


def gemm_verdict(g: GemmSite) -> str:
    if not g.offloaded:
        return f"Matmul{_named(g.names)} left to TVM: {g.reason or 'no GEMM pattern matched'}."
    epi = f" with {' + '.join(g.epilogue)} fused" if g.epilogue else ""
    return f"Matmul{_named(g.names)}: {_kernel_text(g.kernel)}{epi}."


def unfused_verdict(where: Where, failures: list[CheckFailure], names: UserNames) -> str:
    mine = [f for f in failures if f.where.site == where.site]
    why = mine[0].message if mine else "no attention pattern was offered or matched"
    more = f" (and {len(mine) - 1} more check(s), see check_failures)" if len(mine) > 1 else ""
    return f"Attention{_named(names)} left to TVM: {why}{more}."


def fill_verdicts(report: Report, attention_sites: list[tuple[Where, UserNames]]) -> None:
    """Set every ``verdict`` and rebuild ``sites`` (``attention_sites``: every attention site,
    fused or not, in site order, with its names)."""
    by_site = {m.where.site: m for m in report.matches}
    report.sites = []
    for where, names in attention_sites:
        m = by_site.get(where.site)
        if m is not None:
            m.names = names
            m.verdict = match_verdict(m)
            verdict, offloaded = m.verdict, True
        else:
            verdict, offloaded = unfused_verdict(where, report.check_failures, names), False
        report.sites.append(
            SiteVerdict(
                kind="attention", where=where, offloaded=offloaded, verdict=verdict, names=names
            )
        )
    for g in report.gemms:
        g.verdict = gemm_verdict(g)
        report.sites.append(
            SiteVerdict(
                kind="gemm", where=g.where, offloaded=g.offloaded, verdict=g.verdict, names=g.names
            )
        )


def with_origins(report: Report, origins: dict[str, str]) -> Report:
    """The report with the user's names filled in from an import manifest's origins."""
    out = report.model_copy(deep=True)
    for m in out.matches:
        m.names = names_for(m.names.weights, origins, "attention")
    for g in out.gemms:
        g.names = names_for(g.names.weights, origins, "gemm")
    attention = [
        (s.where, names_for(s.names.weights, origins, "attention"))
        for s in out.sites
        if s.kind == "attention"
    ]
    fill_verdicts(out, attention)
    return out


def origins_of(manifest: dict[str, Any]) -> dict[str, str]:
    """Parameter name -> origin, from a ``stackfuse import`` manifest (``model.inputs.json``)."""
    return {
        str(p["name"]): str(p["origin"])
        for p in manifest.get("params", [])
        if isinstance(p, dict) and p.get("name") and p.get("origin")
    }


def cached_view(raw: bytes, job_id: str, original_job: str) -> bytes:
    """The stored report of ``original_job`` as job ``job_id``, answered from the compile cache,
    must say: cached, nothing compiled now, what the first compile took, its own download name."""
    doc = json.loads(raw)
    if doc.get("schema_version") != SCHEMA_VERSION:  # a report from before the cached fields
        return raw
    report = Report.model_validate(doc)
    report.cached = True
    report.original_job = original_job or None
    report.original_compile_s = report.original_compile_s or report.compile_s
    report.compile_s = 0.0
    for k in [m.kernel for m in report.matches] + [g.kernel for g in report.gemms]:
        if k is not None and not k.cached:
            k.original_compile_s, k.compile_s, k.cached = k.compile_s, 0.0, True
    if report.library is not None:
        report.library.file = f"stackfuse-{job_id}.so"
    fill_verdicts(report, [(s.where, s.names) for s in report.sites if s.kind == "attention"])
    return report.model_dump_json(indent=2).encode()
