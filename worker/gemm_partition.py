"""GEMM patterns, their checks with reasons, and the report entries they produce.

Every ``R.matmul`` call in the module is a *GEMM site*. The patterns are a table
(:data:`GEMM_PATTERNS`): a matmul of an activation by a weight as stored or through a
``permute_dims`` (read transposed, never copied), then what models put after it: the ``astype``
TVM's importers insert after a float32-accumulating matmul, ``+ bias``, a ``reshape`` of the
rows back to ``[batch, seq, N]``, an activation (ReLU, GELU in its erf and tanh forms, SiLU),
``+ residual``, or the product with the SiLU of a gate tensor (SwiGLU's ``act(gate) * up``, the
SiLU possibly between casts to float32 and back, as transformers' Llama writes it). Longer
chains are tried first so the epilogue fuses as much as it can.

A paired SwiGLU (normalize's ``combine_gate_up``: gate and up projections as one matmul on
weights interleaved in blocks of 8 columns) is its own pattern: the matmul, a reshape to
``[..., I/8, 2, 8]``, the two halves of each 16-column group as strided slices, ``silu(gate) *
up`` and a reshape back to ``[..., I]``: one site whose epilogue pairs the columns in registers.

Each check names what it expected and what it found; a site no pattern takes stays in TVM with
those reasons in the report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.spec import CompileOptions
from worker.gemm import ACTIVATION_OPS, DYNAMIC, SWIGLU, GemmSpec, align_elems
from worker.partition import (
    CODEGEN,
    Failure,
    Site,
    _composite_of,
    _sites_of_calls,
    dim_label,
    dim_value,
    dtype_of,
    fuse_patterns,
    name_of,
    shape_of,
    site_of,
    tag_sites,
)
from worker.report import GemmCheckFailure, GemmSite
from worker.toolchain import import_tvm

import_tvm()

import tvm  # noqa: E402
from tvm import ir, relax  # noqa: E402
from tvm.relax.dpl.pattern import DFPattern, is_op, wildcard  # noqa: E402

GEMM_PREFIX = "stackfuse.gemm."
PATTERN_PREFIX = f"{CODEGEN}.gemm"
GEMM_DTYPES = ("float16", "bfloat16")
#: why a float32 matmul stays in TVM unless the client opts in to TF32
TF32_OFF = (
    "the matmul is float32: set options.allow_tf32 to run it on tensor cores as TF32 (10-bit "
    "mantissa, ~1e-3 relative error; sm_90), else it stays in TVM at full float32 precision"
)


def tf32_refusal(options: CompileOptions, arch: str) -> str | None:
    """Why float32 matmuls stay in TVM for this job, or None (they run as TF32)."""
    if not options.allow_tf32:
        return TF32_OFF
    if arch.rstrip("a") != "sm_90":
        return (
            f"the matmul is float32 and options.allow_tf32 is set, but TF32 GEMMs are built for "
            f"sm_90 only (target {arch}): it stays in TVM"
        )
    return None


@dataclass(frozen=True)
class GemmPatternDef:
    name: str
    transposed: bool
    cast: bool
    bias: bool
    reshape: bool
    activation: str
    residual: bool
    pattern: DFPattern
    annotations: dict[str, DFPattern]
    #: ``silu(gate) * out``: the gate's own chain (a reshape, casts around the SiLU)
    gate: bool = False
    gate_reshape: bool = False
    gate_cast: bool = False
    #: the paired SwiGLU (``swiglu``): one GEMM of gate and up projections, columns paired
    paired: bool = False


def _gate_chain(ann: dict[str, DFPattern], reshape: bool, cast: bool) -> DFPattern:
    y = ann["gate"] = wildcard()
    if reshape:
        y = ann["gate_reshape"] = is_op("relax.reshape")(y, wildcard())
    if cast:
        y = ann["gate_up"] = is_op("relax.astype")(y)
    y = ann["gate_silu"] = is_op("relax.nn.silu")(y)
    if cast:
        y = ann["gate_down"] = is_op("relax.astype")(y)
    return y


def _matmul_head(ann: dict[str, DFPattern], transposed: bool, cast: bool) -> DFPattern:
    """``A @ (W | permute_dims(W)) -> [astype]``, its parts named in ``ann``: every GEMM
    pattern's head."""
    ann["a"] = wildcard()
    b = ann["weight"] = wildcard()
    if transposed:
        b = ann["permute"] = is_op("relax.permute_dims")(b)
    x = ann["matmul"] = is_op("relax.matmul")(ann["a"], b)
    if cast:
        x = ann["cast"] = is_op("relax.astype")(x)
    return x


def _make(
    transposed: bool,
    cast: bool,
    bias: bool,
    reshape: bool,
    activation: str,
    residual: bool,
    gate: tuple[bool, bool] | None = None,
) -> GemmPatternDef:
    """One pattern; ``gate`` = (the gate is reshaped, the SiLU sits between casts) makes it a
    gated unit (no bias, activation or residual then)."""
    ann: dict[str, DFPattern] = {}
    x = _matmul_head(ann, transposed, cast)
    if bias:
        ann["bias"] = wildcard()
        x = ann["bias_add"] = is_op("relax.add")(x, ann["bias"])
    if reshape:
        x = ann["reshape"] = is_op("relax.reshape")(x, wildcard())
    if activation != "none":
        x = ann["activation"] = is_op(ACTIVATION_OPS[activation])(x)
    if residual:
        ann["residual"] = wildcard()
        x = ann["residual_add"] = is_op("relax.add")(x, ann["residual"])
    if gate is not None:
        x = ann["gate_mul"] = is_op("relax.multiply")(_gate_chain(ann, *gate), x)
    ann["root"] = x
    parts = [
        "t" if transposed else "n",
        *(["cast"] if cast else []),
        *(["bias"] if bias else []),
        *(["reshape"] if reshape else []),
        *([activation] if activation != "none" else []),
        *(["residual"] if residual else []),
        *(["silu_gate"] if gate is not None else []),
    ]
    name = f"{PATTERN_PREFIX}.{'_'.join(parts)}"
    if gate is not None:
        name += "." + "_".join(
            ["gate", *(["reshape"] if gate[0] else []), *(["cast"] if gate[1] else [])]
        )
    return GemmPatternDef(
        name,
        transposed,
        cast,
        bias,
        reshape,
        activation,
        residual,
        x,
        ann,
        gate=gate is not None,
        gate_reshape=bool(gate and gate[0]),
        gate_cast=bool(gate and gate[1]),
    )


def _make_paired(transposed: bool, cast: bool, gate_cast: bool) -> GemmPatternDef:
    """``reshape(silu(slice(y4, 0:1)) * slice(y4, 1:2), [..., I])``, ``y4`` the GEMM's output
    reshaped to ``[..., I/8, 2, 8]``: the form normalize's ``combine_gate_up`` writes."""
    ann: dict[str, DFPattern] = {}
    x = _matmul_head(ann, transposed, cast)
    y4 = ann["pair_reshape"] = is_op("relax.reshape")(x, wildcard())
    g = ann["pair_gate"] = is_op("relax.strided_slice")(y4, varg_default_wildcard=True)
    u = ann["pair_up"] = is_op("relax.strided_slice")(y4, varg_default_wildcard=True)
    if gate_cast:
        g = ann["gate_up"] = is_op("relax.astype")(g)
    g = ann["gate_silu"] = is_op("relax.nn.silu")(g)
    if gate_cast:
        g = ann["gate_down"] = is_op("relax.astype")(g)
    prod = ann["gate_mul"] = is_op("relax.multiply")(g, u)
    root = ann["root"] = is_op("relax.reshape")(prod, wildcard())
    parts = ["t" if transposed else "n", *(["cast"] if cast else []), SWIGLU]
    name = f"{PATTERN_PREFIX}.{'_'.join(parts)}" + (".gate_cast" if gate_cast else "")
    return GemmPatternDef(
        name, transposed, cast, False, False, "none", False, root, ann, paired=True
    )


def _pattern_defs() -> list[GemmPatternDef]:
    # epilogue tails, longest first: a residual or an activation (never both: no model
    # puts an activation between a projection and its residual add)
    tails = [("none", True)] + [(a, False) for a in ACTIVATION_OPS] + [("none", False)]
    defs = []
    # the paired SwiGLU first: its chain is the longest, and nothing else matches its tail
    for gate_cast in (True, False):
        for cast in (True, False):
            for transposed in (True, False):
                defs.append(_make_paired(transposed, cast, gate_cast))
    # gated units next: their tail is the longest, and the up projection alone would
    # otherwise match a shorter pattern and leave the SiLU and product to TVM
    for gate_cast in (True, False):
        for gate_reshape in (True, False):
            for reshape in (True, False):
                for cast in (True, False):
                    for transposed in (True, False):
                        defs.append(
                            _make(
                                transposed,
                                cast,
                                False,
                                reshape,
                                "none",
                                False,
                                gate=(gate_reshape, gate_cast),
                            )
                        )
    for activation, residual in tails:
        for bias in (True, False):
            for reshape in (True, False) if (residual or activation != "none") else (False,):
                for cast in (True, False):
                    for transposed in (True, False):
                        defs.append(_make(transposed, cast, bias, reshape, activation, residual))
    return defs


GEMM_PATTERNS: dict[str, GemmPatternDef] = {d.name: d for d in _pattern_defs()}
#: the order patterns are tried in: longest epilogue first (tested in test_gemm_partition)
GEMM_PATTERN_ORDER: tuple[str, ...] = tuple(GEMM_PATTERNS)


def _is_matmul(expr: Any) -> bool:
    return (
        isinstance(expr, relax.Call)
        and isinstance(expr.op, ir.Op)
        and expr.op.name == "relax.matmul"
    )


# --------------------------------------------------------------------------------------------
# analysis
# --------------------------------------------------------------------------------------------
@dataclass
class GemmAnalysis:
    pattern: GemmPatternDef
    failures: list[Failure] = field(default_factory=list)
    spec: GemmSpec | None = None
    shapes: dict[str, list[int | str]] = field(default_factory=dict)

    def fail(self, check: str, expected: object, actual: object, message: str) -> None:
        self.failures.append(Failure(check, str(expected), str(actual), message))

    @property
    def ok(self) -> bool:
        return not self.failures and self.spec is not None


def _static(dims: list[Any]) -> list[int | str]:
    return [dim_value(d) for d in dims]


def _labels(dims: list[Any] | None) -> list[int | str]:
    return [dim_label(d) for d in dims] if dims is not None else []


def _numel(dims: list[int | str]) -> int | None:
    ints = [d for d in dims if isinstance(d, int)]
    return math.prod(ints) if len(ints) == len(dims) else None


def analyze(
    pdef: GemmPatternDef,
    ann: dict[str, Any],
    operand_index: Callable[[Any], int],
    params: list[Any] | None = None,
    float32: str | None = TF32_OFF,
) -> GemmAnalysis:
    """Check one candidate; on success ``spec`` is set (operand indices from
    ``operand_index``, which maps a kernel input to its argument position). ``float32`` is why
    a float32 matmul stays in TVM, or None to run it as TF32."""
    an = GemmAnalysis(pdef)
    a, w, mm, root = ann["a"], ann["weight"], ann["matmul"], ann["root"]
    a_shape, w_shape, out_shape = shape_of(a), shape_of(w), shape_of(root)
    an.shapes = {"a": _labels(a_shape), "b": _labels(w_shape), "out": _labels(out_shape)}
    dtype = dtype_of(a)
    if dtype == "float32" and dtype_of(w) == dtype and float32 is not None:
        an.fail("dtype", "float16 or bfloat16 on both operands", "float32 x float32", float32)
        return an
    if dtype == "float32" and not pdef.transposed:
        an.fail(
            "tf32_layout",
            "a float32 weight read transposed ([N, K], as torch.nn.Linear stores it)",
            "[K, N] as stored",
            "the float32 weight is stored [K, N]: CUTLASS's TF32 kernel for that layout (A from "
            "registers) gave wrong results on the H200 (benchmarks/results/gemm_bench_tf32.md), "
            "so this matmul stays in TVM; TF32 runs weights stored [N, K]",
        )
        return an
    if dtype not in (*GEMM_DTYPES, "float32") or dtype_of(w) != dtype:
        an.fail(
            "dtype",
            "float16 or bfloat16 on both operands",
            f"{dtype} x {dtype_of(w)}",
            f"the matmul multiplies {dtype} by {dtype_of(w)}; the CUTLASS GEMMs take float16 "
            "or bfloat16 (and float32 as TF32 with options.allow_tf32)",
        )
        return an
    out_dtype = dtype_of(root)
    if out_dtype != dtype:
        an.fail(
            "out_dtype",
            dtype,
            out_dtype,
            f"the result is {out_dtype} where the inputs are {dtype}: the GEMM writes "
            f"{dtype} (a float32 result with no cast back is left to TVM)",
        )
    if a_shape is None or w_shape is None or out_shape is None:
        an.fail("static_rank", "known ranks", "unknown", "an operand's rank is not known")
        return an
    if len(w_shape) not in (2, 3):
        an.fail(
            "weight_rank",
            "2 (a weight) or 3 (a batched matmul)",
            len(w_shape),
            f"B has rank {len(w_shape)}",
        )
        return an
    batched = len(w_shape) == 3
    if batched and len(a_shape) != 3:
        an.fail(
            "batch_rank",
            "A of rank 3 with a batched B",
            len(a_shape),
            "a batched matmul needs A [L, M, K] and B [L, K, N] (no broadcast of A)",
        )
        return an
    if len(a_shape) < 2:
        an.fail("a_rank", ">= 2", len(a_shape), "A must be at least a matrix")
        return an
    if pdef.transposed:
        axes = ann["permute"].attrs.axes
        want = [0, 2, 1] if batched else [1, 0]
        got = [int(x) for x in axes] if axes is not None else list(range(len(w_shape)))[::-1]
        if got != want:
            an.fail(
                "permute_axes",
                want,
                got,
                f"the weight is permuted by {got}; only a transpose of its last two axes "
                "folds into the GEMM's layout",
            )
            return an
    sw = _static(w_shape)
    k_dim, n_dim = (sw[-1], sw[-2]) if pdef.transposed else (sw[-2], sw[-1])
    sa = _static(a_shape)
    if not isinstance(k_dim, int) or not isinstance(n_dim, int):
        an.fail(
            "static_weight",
            "static N and K",
            f"N={n_dim}, K={k_dim}",
            f"the weight's extents must be static, and its shape is {_labels(w_shape)} (a "
            "batch or sequence dim of the activation may be symbolic)",
        )
        return an
    align = align_elems(dtype)
    for name, val in (("K", k_dim), ("N", n_dim)):
        if val % align:
            an.fail(
                "alignment",
                f"{name} a multiple of {align}",
                f"{name} = {val}",
                f"{name} = {val} is not a multiple of {align}: the kernel moves "
                "16-byte rows with TMA",
            )
    batch: int | str = 1
    if batched:
        batch = sa[0]
        if isinstance(sw[0], int) and isinstance(sa[0], int) and sw[0] != sa[0]:
            an.fail("batch", sa[0], sw[0], "A and B have different batch extents")
        m: int | str = sa[1]
    else:
        rows = _numel(sa[:-1])
        m = rows if rows is not None else DYNAMIC
    so = _static(out_shape)
    if pdef.paired:
        if dtype == "float32" or n_dim % 16:
            an.fail(
                "paired_glu",
                "float16 or bfloat16, N = 2I a multiple of 16",
                f"{dtype}, N = {n_dim}",
                "a paired SwiGLU pairs 8-column blocks of gate and up in 16-byte rows of "
                "float16 or bfloat16",
            )
            return an
        _check_paired(an, ann, dtype, sa, n_dim, so)
    elif so[-1] != n_dim:
        an.fail("out_shape", f"[..., {n_dim}]", so, "the result's last dim is not N")
    if pdef.cast and dtype_of(mm) not in ("float32", dtype):
        an.fail(
            "accumulator",
            "float32",
            dtype_of(mm),
            f"the matmul accumulates in {dtype_of(mm)}",
        )
    if pdef.reshape:
        before, after = _static(shape_of(ann["reshape"].args[0]) or []), so
        if (
            not before
            or before[-1] != after[-1]
            or (_numel(before) is not None and _numel(before) != _numel(after))
        ):
            an.fail(
                "reshape_rows",
                "a reshape of the rows that keeps N last",
                f"{before} -> {after}",
                "only a reshape that regroups the rows (keeping N as the last dim) folds "
                "into the GEMM's output",
            )
    bias_idx = res_idx = gate_idx = -1
    inner = [ann[k] for k in ("matmul", "cast", "bias_add", "reshape", "activation") if k in ann]
    for role in ("bias", "residual", "gate"):
        if role in ann and any(ann[role].same_as(e) for e in inner):
            an.fail(
                f"{role}_source",
                "a tensor computed outside the chain",
                "the chain's own value",
                f"the {role} term is a value of this matmul's own chain, not a separate tensor",
            )
            return an
    if pdef.bias:
        bias = ann["bias"]
        bs = _static(shape_of(bias) or [])
        if not bs or bs[-1] != n_dim or _numel(bs) != n_dim or dtype_of(bias) != dtype:
            an.fail(
                "bias_shape",
                f"[{n_dim}] ({dtype})",
                f"{bs} ({dtype_of(bias)})",
                "the added term is not a per-column bias of N elements: it is left to TVM",
            )
        else:
            bias_idx = operand_index(bias)
    if pdef.residual:
        res = ann["residual"]
        rs = _static(shape_of(res) or [])
        if rs != so or dtype_of(res) != dtype or (DYNAMIC in rs and rs != so):
            an.fail(
                "residual_shape",
                f"{so} ({dtype})",
                f"{rs} ({dtype_of(res)})",
                "the residual must have the output's shape and dtype (no broadcast)",
            )
        elif any(not isinstance(d, int) for d in rs) and not _same_symbolic(res, root):
            an.fail(
                "residual_shape",
                "the output's shape",
                _labels(shape_of(res)),
                "the residual's symbolic dims are not provably the output's",
            )
        else:
            res_idx = operand_index(res)
    if pdef.gate:
        gate_idx = _check_gate(an, ann, dtype, so, operand_index)
    if an.failures:
        return an
    a_idx, b_idx = operand_index(a), operand_index(w)
    operand_shapes: tuple[tuple[int | str, ...] | None, ...] = ()
    if params is not None:
        operand_shapes = tuple(
            tuple(_static(shape_of(p))) if shape_of(p) is not None else None  # type: ignore[arg-type]
            for p in params
        )
    an.spec = GemmSpec(
        dtype=dtype,  # type: ignore[arg-type]
        m=m,
        n=n_dim,
        k=k_dim,
        b_kmajor=pdef.transposed,
        activation=pdef.activation,  # type: ignore[arg-type]
        a=a_idx,
        b=b_idx,
        bias=bias_idx,
        residual=res_idx,
        gate=gate_idx,
        batch=batch,
        batched=batched,
        num_operands=len(params) if params is not None else 0,
        operand_shapes=operand_shapes,
        out_shape=tuple(so),
        paired_glu=pdef.paired,
    )
    return an


def _tuple_ints(t: Any) -> list[int] | None:
    """The integers of a relax.Tuple of PrimValues (strided_slice's axes, begin, end)."""
    try:
        return [int(getattr(f, "value", f)) for f in t.fields]
    except (AttributeError, TypeError, ValueError):
        return None


def _check_paired(
    an: GemmAnalysis,
    ann: dict[str, Any],
    dtype: str,
    a_shape: list[int | str],
    n: int,
    out: list[int | str],
) -> None:
    """Checks of a paired SwiGLU's chain: the GEMM's [..., N] output regrouped as
    [..., N/16, 2, 8], gate = [..., 0:1, :] and up = [..., 1:2, :] of it, silu(gate) * up (the
    SiLU in the GEMM's dtype or between casts to float32 and back), regrouped to [..., N/2]."""
    y = ann.get("cast", ann["matmul"])
    ys = _static(shape_of(y) or [])
    y4 = _static(shape_of(ann["pair_reshape"]) or [])
    if not ys or y4 != [*ys[:-1], n // 16, 2, 8]:
        an.fail(
            "paired_reshape",
            f"{[*ys[:-1], n // 16, 2, 8]}",
            y4,
            "the GEMM's columns are not regrouped as (I/8, gate or up, 8)",
        )
        return
    axis = len(y4) - 2
    for key, begin in (("pair_gate", 0), ("pair_up", 1)):
        args = [_tuple_ints(t) for t in ann[key].args[1:]]
        axes = [a + len(y4) if a < 0 else a for a in args[0] or []] if args else []
        rng = args[1:3]
        strides = args[3] if len(args) > 3 else [1]
        if axes != [axis] or rng != [[begin], [begin + 1]] or strides != [1]:
            an.fail(
                "paired_slices",
                f"axis {axis}, {begin}:{begin + 1}",
                f"axes {axes}, {rng}, strides {strides}",
                "the gate and up halves are not the two blocks of each 16-column group",
            )
            return
    if not _gate_casts_ok(an, ann, dtype):
        return
    rows = _numel(ys[:-1])
    if not out or out[-1] != n // 2 or (rows is not None and _numel(out) != rows * (n // 2)):
        an.fail(
            "out_shape",
            f"[..., {n // 2}] holding the GEMM's rows",
            out,
            "the paired result is not regrouped to I = N / 2 columns, row for row",
        )
        return
    if any(not isinstance(d, int) for d in out) and _numel(a_shape[:-1]) is None:
        # symbolic rows: the output's leading dims must be the activation's
        from worker.partition import same_dim

        sa, so = shape_of(ann["a"]), shape_of(ann["root"])
        if (
            sa is None
            or so is None
            or len(sa) != len(so)
            or not all(same_dim(p, q) for p, q in zip(sa[:-1], so[:-1], strict=True))
        ):
            an.fail(
                "out_shape",
                "the activation's leading dims",
                _labels(so),
                "the paired result's symbolic rows are not provably the activation's",
            )


def _check_gate(
    an: GemmAnalysis,
    ann: dict[str, Any],
    dtype: str,
    out: list[int | str],
    operand_index: Callable[[Any], int],
) -> int:
    """Checks of a gated unit's gate chain; its operand index, or -1 after a failure."""
    gate = ann["gate"]
    gs = _static(shape_of(gate) or [])
    if dtype_of(gate) != dtype or not gs or gs[-1] != out[-1] or _numel(gs) != _numel(out):
        an.fail(
            "gate_shape",
            f"{out} ({dtype}), or its rows regrouped",
            f"{gs} ({dtype_of(gate)})",
            "the gate must hold the output's elements, row for row, in the GEMM's dtype",
        )
        return -1
    symbolic = DYNAMIC in gs or any(not isinstance(d, int) for d in out)
    if symbolic and not _same_symbolic(gate, ann["root"]):
        an.fail(
            "gate_shape",
            "the output's shape",
            _labels(shape_of(gate)),
            "the gate's symbolic dims are not provably the output's",
        )
        return -1
    if not _gate_casts_ok(an, ann, dtype):
        return -1
    return operand_index(gate)


def _gate_casts_ok(an: GemmAnalysis, ann: dict[str, Any], dtype: str) -> bool:
    """The gate's SiLU runs in the GEMM's dtype, or between casts that only change precision
    (float32 and back, as transformers' Llama writes it); a ``gate_cast`` failure otherwise."""
    if "gate_down" in ann:
        inner = dtype_of(ann["gate_up"])
        if inner not in ("float32", dtype) or dtype_of(ann["gate_down"]) != dtype:
            an.fail(
                "gate_cast",
                f"SiLU in float32 or {dtype}, cast back to {dtype}",
                f"{inner} -> {dtype_of(ann['gate_down'])}",
                "the casts around the gate's SiLU change more than its precision",
            )
            return False
    elif dtype_of(ann["gate_silu"]) != dtype:
        an.fail(
            "gate_cast",
            dtype,
            dtype_of(ann["gate_silu"]),
            "the gate's SiLU is not in the GEMM's dtype",
        )
        return False
    return True


def _same_symbolic(x: Any, y: Any) -> bool:
    from worker.partition import same_dim

    sx, sy = shape_of(x), shape_of(y)
    return (
        sx is not None
        and sy is not None
        and len(sx) == len(sy)
        and all(same_dim(p, q) for p, q in zip(sx, sy, strict=True))
    )


def _leaks(ctx: Any) -> list[str]:
    """Intermediates of the match that something outside it also uses (fusing them would
    drop a value another binding reads)."""
    inside = set(ctx.matched_bindings.keys())
    out_var = ctx.value_to_bound_var[ctx.matched_expr]
    found = []
    for var in inside:
        if var.same_as(out_var):
            continue
        users = ctx.var_usages.get(var, [])
        if not isinstance(var, relax.DataflowVar) or any(u not in inside for u in users):
            found.append(name_of(var))
    return sorted(found)


# --------------------------------------------------------------------------------------------
# partition
# --------------------------------------------------------------------------------------------
@dataclass
class FusedGemm:
    gvar: ir.GlobalVar
    pattern: GemmPatternDef
    analysis: GemmAnalysis

    @property
    def spec(self) -> GemmSpec:
        assert self.analysis.spec is not None
        return self.analysis.spec


@dataclass
class GemmPartition:
    mod: tvm.IRModule
    sites: dict[str, Site]
    functions: list[FusedGemm]
    #: one entry per matmul site, in site order; kernel choices are filled in by the pipeline
    entries: list[GemmSite]
    #: site id -> the fused function computing it
    fused: dict[str, FusedGemm]


def _not_offered(arch: str, options: CompileOptions) -> str | None:
    if not options.offload_gemm:
        return "options.offload_gemm is false"
    from worker.gemm_families import family_for

    if family_for(arch) is None:
        return (
            f"target arch {arch}: the CUTLASS GEMMs are built for sm_90 (Hopper) and sm_80/86/89 "
            "(Ampere, Ada); on other archs every matmul stays in TVM"
        )
    return None


def partition_gemms(mod: tvm.IRModule, options: CompileOptions, arch: str) -> GemmPartition:
    """Offload the matmul sites that pass their checks; every site gets a report entry."""
    mod, sites = tag_sites(mod, _is_matmul, GEMM_PREFIX, "matmul")
    why_not = _not_offered(arch, options)
    float32 = tf32_refusal(options, arch)
    if why_not is not None or not sites:
        entries = [
            GemmSite(where=s.where, offloaded=False, reason=why_not or "")
            for s in sorted(sites.values(), key=lambda s: int(s.id))
        ]
        return GemmPartition(mod, sites, [], entries, {})

    failures: dict[str, dict[tuple[str, str], GemmCheckFailure]] = {}
    #: site -> (bindings it replaced, operand shapes) of the pattern that took it
    accepted: dict[str, tuple[list[str], dict[str, list[int | str]]]] = {}
    shapes_seen: dict[str, dict[str, list[int | str]]] = {}

    def make_check(pdef: GemmPatternDef) -> Callable[[Any], bool]:
        def check(ctx: Any) -> bool:
            ann = {str(k): v for k, v in ctx.annotated_expr.items()}
            an = analyze(pdef, ann, lambda e: 0, float32=float32)
            if pdef.paired and arch.rstrip("a") != "sm_90":
                an.fail(
                    "paired_glu",
                    "sm_90",
                    arch,
                    f"the paired SwiGLU GEMM is built for sm_90 only (target {arch})",
                )
            leaks = _leaks(ctx)
            if leaks:
                an.fail(
                    "no_leak",
                    "no intermediate used outside the GEMM",
                    ", ".join(leaks),
                    f"{', '.join(leaks)} is also read outside this chain, so the epilogue "
                    "cannot absorb it",
                )
            sid = site_of(ann["matmul"], GEMM_PREFIX) or "?"
            shapes_seen.setdefault(sid, an.shapes)
            for f in an.failures:
                failures.setdefault(sid, {}).setdefault(
                    (f.check, f.actual),
                    GemmCheckFailure(
                        pattern=pdef.name,
                        check=f.check,
                        expected=f.expected,
                        actual=f.actual,
                        message=f.message,
                    ),
                )
            if not an.failures:
                accepted[sid] = (sorted(name_of(v) for v in ctx.matched_bindings), an.shapes)
            return not an.failures

        return check

    fused_mod, functions = fuse_patterns(
        mod, [GEMM_PATTERNS[n] for n in GEMM_PATTERN_ORDER], make_check, _fused_gemm
    )
    by_site = dict(_sites_of_calls(fused_mod, sites, functions, _is_matmul, GEMM_PREFIX))
    entries = []
    for sid in sorted(sites, key=int):
        site = sites[sid]
        ff = by_site.get(sid)
        if ff is not None:
            spec = ff.spec
            bindings, shapes = accepted.get(sid, ([], ff.analysis.shapes))
            entries.append(
                GemmSite(
                    where=site.where,
                    offloaded=True,
                    pattern=ff.pattern.name,
                    epilogue=spec.epilogue(),
                    dtype=spec.dtype,
                    shapes=shapes,
                    b_layout="k_major" if spec.b_kmajor else "n_major",
                    bindings=bindings,
                )
            )
        else:
            fails = list(failures.get(sid, {}).values())
            reason = "; ".join(dict.fromkeys(f.message for f in fails)) or (
                "no GEMM pattern matched this matmul"
            )
            entries.append(
                GemmSite(
                    where=site.where,
                    offloaded=False,
                    shapes=shapes_seen.get(sid, {}),
                    reason=reason,
                    check_failures=fails,
                )
            )
    return GemmPartition(fused_mod, sites, list(functions.values()), entries, by_site)


def _fused_gemm(gv: ir.GlobalVar, func: Any) -> FusedGemm | None:
    if not isinstance(func, relax.Function) or func.attrs is None:
        return None
    if func.attrs.get("Codegen") != CODEGEN:
        return None
    inner = _composite_of(func)
    if inner is None or str(inner.attrs["Composite"]) not in GEMM_PATTERNS:
        return None
    pdef = GEMM_PATTERNS[str(inner.attrs["Composite"])]
    var2val = relax.analysis.get_var2val(inner)
    root = inner.body.body
    if isinstance(root, relax.Var) and root in var2val:
        root = var2val[root]
    matched = pdef.pattern.extract_matched_expr(root, var2val)
    if matched is None:
        raise AssertionError(f"fused function {gv.name_hint} no longer matches {pdef.name}")
    ann = {name: matched[p] for name, p in pdef.annotations.items() if p in matched}
    params = list(inner.params)

    def operand_index(e: Any) -> int:
        for i, p in enumerate(params):
            if p.same_as(e):
                return i
        raise AssertionError("GEMM operand is not a parameter of the fused function")

    # it passed its checks when it was partitioned, float32 (TF32) included
    an = analyze(pdef, ann, operand_index, params=params, float32=None)
    if not an.ok:
        msgs = "; ".join(f.message for f in an.failures)
        raise AssertionError(f"fused function {gv.name_hint} fails its checks: {msgs}")
    return FusedGemm(gv, pdef, an)
