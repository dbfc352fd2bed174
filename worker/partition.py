"""Patterns, checks with reasons, and the report entries they produce.

Every ``R.nn.attention`` call in the module is a *site*, and so is every
``R.nn.attention_var_len`` (a ragged batch, which the SM80-class kernel takes). Before
matching, each site's call is tagged with a span naming it (spans survive
``FuseOpsByPattern``), so a fused function can be traced back to the site it came from.
Patterns are tried in :data:`PATTERN_ORDER`: stacked first (the #14608 review asked whether
order matters; it does: TVM tries earlier entries first, and plain attention would otherwise
claim the call and leave split/reshape kernels behind).

Each check is a named predicate with an expected and an actual value and a sentence a person can
act on. A check that fails records a :class:`~worker.report.CheckFailure`; plain attention then
still offloads the attention alone where it can, and the report shows both facts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from service.spec import CompileOptions
from worker.toolchain import import_tvm

import_tvm()  # before any `import tvm`: it decides whether CUDA kernels compile ahead of time

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm import ir, relax  # noqa: E402
from tvm.relax.backend.patterns import (  # noqa: E402
    make_attention_pattern,
    make_stacked_attention_pattern,
)
from tvm.relax.dpl.pattern import DFPattern, is_op, wildcard  # noqa: E402

from worker.attention import (  # noqa: E402
    DTYPE_BITS,
    DYNAMIC,
    MASKED,
    AttentionSpec,
    BiasSpec,
    RaggedSpec,
    TensorAccess,
)
from worker.report import (  # noqa: E402
    CheckFailure,
    Layout,
    Match,
    Ragged,
    Rewrite,
    SiteReason,
    Where,
)

CODEGEN = "cutlass"
Fused = TypeVar("Fused")
SITE_PREFIX = "stackfuse.site."
VAR_LEN_OP = "relax.nn.attention_var_len"
#: the calls that are attention sites; ragged batches (``attention_var_len``) among them
ATTENTION_OPS = ("relax.nn.attention", "relax.nn.attention_bias", VAR_LEN_OP)

#: kernel limits of the SM80-class CUTLASS fMHA (kernel_forward.h) that the checks enforce
MAX_HEAD_DIM = 256
UNALIGNED_MIN_ELEMS = 4  # GemmType::kMinimumAlignment on SM80 tensor ops
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")


# --------------------------------------------------------------------------------------------
# patterns
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PatternDef:
    name: str
    kind: str  # "stacked" | "plain"
    variant: str  # "split" | "strided_slice" | "none"
    bias: bool
    pattern: DFPattern
    annotations: dict[str, DFPattern]
    #: ``attention_var_len``: a ragged batch, read by the SM80-class kernel with seqstart
    ragged: bool = False


#: the argument names of ``attention_var_len`` after q, k and v, in the node's order
_VAR_LEN_ARGS = ("seqstart_q", "seqstart_k", "max_seqlen_q", "max_seqlen_k")


def _pattern_defs() -> list[PatternDef]:
    # interleaved first: it passes silently over the blocked layout, while the blocked
    # analysis would report a rank-5 interleaved tensor as a failure of its own
    defs: list[PatternDef] = _interleaved_defs()
    for variant in ("split", "strided_slice"):
        for bias in (True, False):
            pat, ann = make_stacked_attention_pattern(start_op=variant, with_bias=bias)
            name = f"{CODEGEN}.stacked_attention.{variant}" + ("_bias" if bias else "")
            defs.append(PatternDef(name, "stacked", variant, bias, pat, dict(ann)))
        # the same views of one packed [1, T, C] tensor feeding attention_var_len
        pat, ann = make_stacked_attention_pattern(start_op=variant)
        ann = {k: v for k, v in ann.items() if k != "attention"}
        ann.update({a: wildcard() for a in _VAR_LEN_ARGS})
        pat = is_op(VAR_LEN_OP)(*pat.args, *(ann[a] for a in _VAR_LEN_ARGS))
        name = f"{CODEGEN}.stacked_attention_var_len.{variant}"
        ann["attention"] = pat
        defs.append(PatternDef(name, "stacked", variant, False, pat, ann, ragged=True))
    for bias in (True, False):
        pat, ann = make_attention_pattern(with_bias=bias)
        name = f"{CODEGEN}.attention" + ("_bias" if bias else "")
        defs.append(PatternDef(name, "plain", "none", bias, pat, {**ann, "attention": pat}))
    pat, ann = make_attention_pattern(var_len=True)
    name = f"{CODEGEN}.attention_var_len"
    ann = {**ann, "attention": pat}
    defs.append(PatternDef(name, "plain", "none", False, pat, ann, ragged=True))
    return defs


def _interleaved_defs() -> list[PatternDef]:
    """Per-head interleaved packing (GPT-NeoX, Falcon, Bloom): within each head's ``3H``
    columns lie q, k, v. ``qkv[B, S, N, 3H] -> split(axis 3) | strided_slice x3 -> attention``
    and ``qkv[B, S, N, 3, H] -> split(axis 3) -> reshape|squeeze x3 -> attention``.

    The reshape that makes ``[B, S, N, 3H]`` from ``[B, S, 3NH]`` stays outside the pattern (it
    is a view): the kernel's operand is then rank 4 or 5 with batch and sequence leading, read
    at offsets 0, H, 2H with head stride 3H.
    """
    from tvm.relax.dpl.pattern import is_tuple_get_item

    defs: list[PatternDef] = []
    for form in ("interleaved", "interleaved_slice", "interleaved_5d"):
        for bias in (True, False):
            qkv = wildcard()
            ann: dict[str, DFPattern] = {"stacked_qkv": qkv}
            if form == "interleaved_slice":
                pieces = []
                for name in ("query", "key", "value"):
                    sl = is_op("relax.strided_slice")(qkv, varg_default_wildcard=True)
                    ann[f"strided_slice_{name}"] = sl
                    pieces.append(sl)
            else:
                split = is_op("relax.split")(qkv)
                ann["split"] = split
                pieces = [is_tuple_get_item(split, i) for i in range(3)]
                if form == "interleaved_5d":
                    pieces = [
                        is_op("relax.reshape")(p, wildcard()) | is_op("relax.squeeze")(p)
                        for p in pieces
                    ]
            if bias:
                ann["bias"] = b = wildcard()
                out = is_op("relax.nn.attention_bias")(*pieces, b)
            else:
                out = is_op("relax.nn.attention")(*pieces)
            ann["attention"] = out
            name = f"{CODEGEN}.stacked_attention.{form}" + ("_bias" if bias else "")
            defs.append(PatternDef(name, "stacked", "interleaved", bias, out, ann))
    return defs


PATTERNS: dict[str, PatternDef] = {d.name: d for d in _pattern_defs()}
#: the order patterns are tried in; stacked before plain (tested in test_partition)
PATTERN_ORDER: tuple[str, ...] = tuple(PATTERNS)


# --------------------------------------------------------------------------------------------
# small IR helpers
# --------------------------------------------------------------------------------------------
def dtype_of(expr: relax.Expr) -> str:
    return str(expr.ty.dtype).removeprefix("T.")


def shape_of(expr: relax.Expr) -> list[Any] | None:
    ty = expr.ty
    shape = getattr(ty, "shape", None)
    if shape is None or not isinstance(shape, relax.ShapeExpr):
        return None
    return list(shape.values)


def _is_int_imm(d: Any) -> bool:
    return isinstance(d, int) or (type(d).__name__ == "IntImm" and isinstance(d.value, int))


def dim_value(d: Any) -> int | str:
    """A static extent as int; anything symbolic as :data:`DYNAMIC`."""
    if _is_int_imm(d):
        return int(d.value)
    return DYNAMIC


def dim_label(d: Any) -> int | str:
    """A dim for the report: int, or the client's expression text (report only)."""
    if _is_int_imm(d):
        return int(d.value)
    return str(d)[:64]


def const_ints(expr: Any) -> list[int] | None:
    """Values of a tuple/shape of integer constants, or None if any is not constant."""
    if isinstance(expr, relax.ShapeExpr):
        items = list(expr.values)
    elif hasattr(expr, "fields"):
        items = list(expr.fields)
    elif isinstance(expr, list | tuple | tvm_ffi.Array):
        items = list(expr)
    else:
        return None
    out: list[int] = []
    for it in items:
        while not isinstance(it, int) and hasattr(it, "value"):
            it = it.value
        if not isinstance(it, int) or isinstance(it, bool):
            return None
        out.append(it)
    return out


_analyzer = tvm.sym.Analyzer()


def same_dim(a: Any, b: Any) -> bool:
    if _is_int_imm(a) and _is_int_imm(b):
        return int(a.value) == int(b.value)
    return bool(_analyzer.can_prove(tvm.tirx.EQ(a, b)))


def name_of(var: Any) -> str:
    """A variable's name as the client wrote it, cut short (report text only)."""
    name = getattr(var, "name_hint", None)
    if name is None:
        name = getattr(var, "name", "?")
    return str(name)[:128]


def attention_attrs(call: relax.Call) -> tuple[float | None, str, int | None]:
    attrs = call.attrs
    scale = attrs.scale
    scale_v = float(scale.value) if scale is not None else None
    causal = attrs.causal_mask if attrs.causal_mask is not None else "none"
    window = attrs.window_size
    window_v = int(window.value) if window is not None else None
    return scale_v, str(causal), window_v


# --------------------------------------------------------------------------------------------
# analysis: from matched expressions to an AttentionSpec, with named checks
# --------------------------------------------------------------------------------------------
@dataclass
class Failure:
    check: str
    expected: str
    actual: str
    message: str


@dataclass
class Analysis:
    """Outcome of checking one candidate against one pattern."""

    pattern: PatternDef
    failures: list[Failure] = field(default_factory=list)
    spec: AttentionSpec | None = None
    shapes: dict[str, list[int | str]] = field(default_factory=dict)
    order: str = "qkv"
    #: the report's view of a ragged batch (names of the seqstart tensors, sequence count)
    ragged: Ragged | None = None

    def fail(self, check: str, expected: object, actual: object, message: str) -> None:
        self.failures.append(Failure(check, str(expected), str(actual), message))

    @property
    def ok(self) -> bool:
        return not self.failures and self.spec is not None


def _alignment_elems(dtype: str) -> int:
    return 128 // DTYPE_BITS[dtype]


def _split_bounds(
    an: Analysis, split: relax.Call, want_axis: int, width: Any, what: str, axis_doc: str
) -> list[int] | None:
    """Where ``split`` cuts its axis: [0, end of q, end of k, end of v], or None (failure
    recorded). Shared by the blocked ([B,S,q|k|v]) and per-head ([B,S,N,q|k|v]) layouts."""
    axis = int(split.attrs.axis)
    if axis < 0:
        axis += split.args[0].ty.ndim
    if axis != want_axis:
        an.fail(
            "split_axis",
            want_axis,
            axis,
            f"split axis is {axis}; {what} fusion needs axis {want_axis} ({axis_doc})",
        )
        return None
    c = dim_value(width)
    ios = split.attrs.indices_or_sections
    if _is_int_imm(ios):
        n = int(ios if isinstance(ios, int) else ios.value)
        if n != 3:
            an.fail(
                "split_sections",
                3,
                n,
                f"split makes {n} equal sections; {what} fusion needs exactly 3 (q, k, v)",
            )
            return None
        if not isinstance(c, int):
            an.fail(
                "static_feature_dim",
                "static",
                dim_label(width),
                f"the split axis is symbolic ({dim_label(width)}); {what} fusion needs it static",
            )
            return None
        return [0, c // 3, 2 * (c // 3), c]
    idx = const_ints(ios)
    if idx is None or len(idx) != 2:
        an.fail(
            "split_sections",
            "2 split indices (3 sections)",
            "symbolic" if idx is None else f"{len(idx)} indices",
            "split must cut its axis into exactly 3 static sections (q, k, v)",
        )
        return None
    if not isinstance(c, int):
        an.fail(
            "static_feature_dim",
            "static",
            dim_label(width),
            f"the split axis is symbolic ({dim_label(width)}); {what} fusion needs it static",
        )
        return None
    return [0, idx[0], idx[1], c]


def _stacked_blocks(
    an: Analysis, ann: dict[str, relax.Expr], width: Any
) -> dict[str, tuple[int, int]] | None:
    """(begin, end) column of q, k, v within the stacked row, from the split or the slices."""
    c = dim_value(width)
    if "split" in ann:
        cut = _split_bounds(
            an, ann["split"], 2, width, "stacked", "the feature axis of [batch, seq, q|k|v]"
        )
        if cut is None:
            return None
        return {"q": (cut[0], cut[1]), "k": (cut[1], cut[2]), "v": (cut[2], cut[3])}

    blocks: dict[str, tuple[int, int]] = {}
    for role, name in (("q", "query"), ("k", "key"), ("v", "value")):
        sl = ann[f"strided_slice_{name}"]
        axes = const_ints(sl.args[1])
        begins = const_ints(sl.args[2])
        ends = const_ints(sl.args[3])
        strides = const_ints(sl.args[4]) if len(sl.args) > 4 else [1]
        if axes is None or begins is None or ends is None or strides is None:
            an.fail(
                "slice_static",
                "constant axes/begin/end/strides",
                "symbolic",
                f"the {role} strided_slice has non-constant bounds; stacked fusion needs "
                "constant ones",
            )
            return None
        if axes != [2]:
            an.fail(
                "slice_axis",
                [2],
                axes,
                f"the {role} strided_slice is on axes {axes}; stacked fusion needs axis 2 only",
            )
            return None
        if strides != [1]:
            an.fail(
                "slice_stride",
                [1],
                strides,
                f"the {role} strided_slice has stride {strides[0]}; stacked fusion needs "
                "stride 1 (contiguous columns)",
            )
            return None
        b, e = begins[0], ends[0]
        if not isinstance(c, int):
            an.fail(
                "static_feature_dim",
                "static",
                "symbolic",
                "the stacked feature dim is symbolic; stacked fusion needs it static",
            )
            return None
        if not (0 <= b < e <= c):
            an.fail(
                "slice_bounds",
                f"0 <= begin < end <= {c}",
                f"begin={b}, end={e}",
                f"the {role} strided_slice [{b}:{e}] is not a non-empty range inside the "
                f"stacked feature dim {c} (negative or clamped bounds are not fused)",
            )
            return None
        blocks[role] = (b, e)
    return blocks


def _check_common(
    an: Analysis,
    call: relax.Call,
    q: relax.Expr,
    k: relax.Expr,
    v: relax.Expr,
    bias: relax.Expr | None,
) -> dict[str, Any] | None:
    """Checks shared by stacked and plain attention. Returns the facts codegen needs."""
    dtypes = {dtype_of(e) for e in (q, k, v, call) + ((bias,) if bias is not None else ())}
    dtype = dtype_of(call)
    if len(dtypes) != 1 or dtype not in SUPPORTED_DTYPES:
        an.fail(
            "dtype",
            " / ".join(SUPPORTED_DTYPES) + " (all operands alike)",
            ", ".join(sorted(dtypes)),
            f"attention in {', '.join(sorted(dtypes))}; the CUTLASS kernel takes float16, "
            "bfloat16 or float32 with q, k, v, bias and output of one dtype",
        )
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    if qs is None or ks is None or vs is None or not (len(qs) == len(ks) == len(vs) == 4):
        an.fail(
            "qkv_rank",
            "[B, S, N, H] for q, k and v",
            "unknown or not rank 4",
            "q, k and v must have known rank-4 shapes [batch, seq, heads, head_dim]",
        )
        return None
    b, s, nq, h = qs
    _, skv, nkv, hk = ks
    _, skv_v, nv, hv = vs
    for label, d in (("num_heads", nq), ("num_kv_heads", nkv), ("head_dim", h), ("head_dim_v", hv)):
        if not isinstance(dim_value(d), int):
            an.fail(
                "static_head_dims",
                "static",
                f"{label} = {dim_label(d)}",
                f"{label} is symbolic ({dim_label(d)}); kernels are specialised on head counts "
                "and head dims (batch and sequence may be symbolic)",
            )
            return None
    nq_i, nkv_i, h_i, hk_i, hv_i = (int(x) for x in (nq, nkv, h, hk, hv))
    if h_i != hk_i:
        an.fail(
            "qk_head_dim",
            h_i,
            hk_i,
            f"q head dim {h_i} differs from k head dim {hk_i}; they must match",
        )
    if nkv_i != int(nv):
        an.fail("kv_heads", nkv_i, int(nv), "k and v must have the same number of heads")
    # unequal head counts (GQA/MQA) are judged once the spec exists: see _kernel_check
    for label, hd in (("head_dim", h_i), ("head_dim_v", hv_i)):
        if hd > MAX_HEAD_DIM:
            an.fail(
                "head_dim_max",
                f"<= {MAX_HEAD_DIM}",
                hd,
                f"{label} {hd} exceeds the kernel's maximum of {MAX_HEAD_DIM}",
            )
    scale, causal, window = attention_attrs(call)
    if window is not None and (causal == "none" or window < 1):
        an.fail(
            "sliding_window",
            "window_size >= 1 with a causal mask (TopLeft or BottomRight)",
            f"window_size={window}, causal {causal}",
            f"window_size={window} with causal mask {causal!r}: a window holds at least one key "
            "and needs a causal mask",
        )
    if causal not in ("none", "TopLeft", "BottomRight"):
        an.fail(
            "causal_mode",
            "none / TopLeft / BottomRight",
            causal,
            f"causal mask {causal!r} is not supported",
        )
    scale_f = scale if scale is not None else 1.0 / math.sqrt(h_i)
    if not math.isfinite(scale_f) or scale_f == 0.0:
        an.fail(
            "scale",
            "finite and non-zero",
            scale_f,
            "attention scale must be finite and non-zero (CUTLASS produces NaN for 0)",
        )
    bias_spec = None
    if bias is not None:
        bshape = shape_of(bias)
        want = [b, nq, s, skv]
        if bshape is None or len(bshape) != 4:
            an.fail(
                "bias_shape",
                "rank 4 [B|1, N|1, S|1, S_kv]",
                "unknown" if bshape is None else f"rank {len(bshape)}",
                "the additive bias must be rank 4 and broadcastable to [batch, heads, seq, seq_kv]",
            )
        else:
            bad = []
            for i, (got, exp) in enumerate(zip(bshape, want, strict=True)):
                one = isinstance(dim_value(got), int) and dim_value(got) == 1
                if not (same_dim(got, exp) or (one and i < 3)):
                    bad.append(i)
            if bad:
                an.fail(
                    "bias_shape",
                    f"broadcastable to {[dim_label(d) for d in want]}",
                    [dim_label(d) for d in bshape],
                    f"bias dims {bad} are neither 1 nor the attention's extent; the last dim "
                    "must be seq_kv (one entry per key)",
                )
            else:
                bias_spec = tuple(dim_value(d) for d in bshape)
        if "bias" in an.shapes or bshape is not None:
            an.shapes["bias"] = [dim_label(d) for d in bshape or []]
    an.shapes.update(
        q=[dim_label(d) for d in qs],
        k=[dim_label(d) for d in ks],
        v=[dim_label(d) for d in vs],
        out=[dim_label(d) for d in (b, s, nq, hv)],
    )
    if an.failures:
        return None
    return {
        "dtype": dtype,
        "b": b,
        "s": s,
        "skv": skv,
        "nq": nq_i,
        "nkv": nkv_i,
        "h": h_i,
        "hv": hv_i,
        "scale": scale_f,
        "causal": causal,
        "bias_shape": bias_spec,
        "skv_v": skv_v,
        "window": window,
    }


def _check_alignment(
    an: Analysis,
    dtype: str,
    q: TensorAccess,
    k: TensorAccess,
    v: TensorAccess,
    h: int,
    hv: int,
    bias_shape: tuple | None,
) -> bool | None:
    """True: the aligned kernel applies; False: the unaligned one; None: neither (failure)."""
    full = _alignment_elems(dtype)
    qk_vals = [q.offset, q.row_stride, q.head_stride, k.offset, k.row_stride, k.head_stride, h]
    all_vals = [*qk_vals, v.offset, v.row_stride, v.head_stride, hv]
    if bias_shape is not None and isinstance(bias_shape[3], int):
        qk_vals.append(bias_shape[3])
        all_vals.append(bias_shape[3])
    if all(x % full == 0 for x in all_vals):
        return True
    if all(x % UNALIGNED_MIN_ELEMS == 0 for x in qk_vals):
        return False
    an.fail(
        "head_dim_alignment",
        f"multiples of {UNALIGNED_MIN_ELEMS} elements",
        f"head_dim={h}, offsets={q.offset},{k.offset}, row stride={q.row_stride}",
        f"q/k head dims, offsets and row strides must be multiples of {UNALIGNED_MIN_ELEMS} "
        f"elements for the CUTLASS kernel (head_dim {h}, row stride {q.row_stride})",
    )
    return None


def analyze(
    pdef: PatternDef,
    ann: dict[str, relax.Expr],
    operand_index: Callable[[relax.Expr], int],
    leaks: list[tuple[str, str]] | None = None,
    params: list[relax.Var] | None = None,
) -> Analysis:
    """Check one candidate (``ann``: annotation name -> matched expression).

    ``operand_index`` maps an input expression (the stacked tensor, q, k, v, the bias) to its
    position among the kernel's arguments; at check time positions do not matter yet.
    ``leaks`` lists (variable, role) of intermediates used outside the candidate. ``params``,
    for a fused function, are its parameters: the kernel's arguments in order.
    """
    if pdef.variant == "interleaved":
        return analyze_interleaved(pdef, ann, operand_index, leaks, params)
    an = Analysis(pdef)
    call = ann["attention"]
    bias = ann.get("bias")
    _leak_failure(an, leaks)
    if pdef.kind == "stacked":
        qkv = ann["stacked_qkv"]
        q, k, v = call.args[0], call.args[1], call.args[2]
        qkv_shape = shape_of(qkv)
        nd = qkv.ty.ndim
        an.shapes["qkv"] = [dim_label(d) for d in qkv_shape] if qkv_shape else []
        if nd != 3 or qkv_shape is None:
            an.fail(
                "stacked_ndim",
                3,
                nd,
                f"stacked tensor has rank {nd}; stacked fusion needs a rank-3 "
                "[batch, seq, q|k|v features] tensor",
            )
            return an
        blocks = _stacked_blocks(an, ann, qkv_shape[2])
        facts = _check_common(an, call, q, k, v, bias)
        if blocks is None or facts is None:
            return an
        bq, sq = qkv_shape[0], qkv_shape[1]
        for role, t in (("q", q), ("k", k), ("v", v)):
            ts = shape_of(t)
            assert ts is not None
            if not (same_dim(ts[0], bq) and same_dim(ts[1], sq)):
                an.fail(
                    "reshape_shape",
                    f"[{dim_label(bq)}, {dim_label(sq)}, N, H]",
                    [dim_label(d) for d in ts],
                    f"the {role} reshape changes batch or sequence extents; stacked fusion "
                    "needs reshape [B, S, C] -> [B, S, N, H] per block",
                )
        width = {r: e - b for r, (b, e) in blocks.items()}
        need = {
            "q": facts["nq"] * facts["h"],
            "k": facts["nkv"] * facts["h"],
            "v": facts["nkv"] * facts["hv"],
        }
        for role in ("q", "k", "v"):
            if width[role] != need[role]:
                an.fail(
                    "reshape_shape",
                    f"{role} block of {need[role]} columns",
                    f"{width[role]} columns",
                    f"the {role} block is {width[role]} columns wide but reshapes to "
                    f"{need[role]}; slices and reshapes must agree",
                )
        if an.failures:
            return an
        row = int(dim_value(qkv_shape[2]))
        src = operand_index(qkv)
        acc = {
            r: TensorAccess(src, blocks[r][0], row, facts["h"] if r != "v" else facts["hv"])
            for r in ("q", "k", "v")
        }
        an.order = "".join(sorted("qkv", key=lambda r: blocks[r][0]))
        seq_kv = facts["s"]
    else:
        q, k, v = call.args[0], call.args[1], call.args[2]
        facts = _check_common(an, call, q, k, v, bias)
        if facts is None:
            return an
        acc = {
            "q": TensorAccess(operand_index(q), 0, facts["nq"] * facts["h"], facts["h"]),
            "k": TensorAccess(operand_index(k), 0, facts["nkv"] * facts["h"], facts["h"]),
            "v": TensorAccess(operand_index(v), 0, facts["nkv"] * facts["hv"], facts["hv"]),
        }
        seq_kv = facts["skv"]
    inputs = [ann["stacked_qkv"]] if pdef.kind == "stacked" else [q, k, v]
    packing = "blocked" if pdef.kind == "stacked" else "separate"
    ragged = _check_ragged(an, call, facts, operand_index) if pdef.ragged else None
    if pdef.ragged and ragged is None:
        return an
    _finish_spec(an, facts, acc, seq_kv, inputs, bias, params, operand_index, packing, ragged)
    return an


@dataclass
class _RaggedOperands:
    spec: RaggedSpec
    #: the seqstart tensors (one when queries and keys share it), kernel arguments after q/k/v
    seqstarts: list[relax.Expr]
    #: the max_seqlen arguments: passed to the kernel, not read
    ignored: list[relax.Expr]


def _check_ragged(
    an: Analysis,
    call: relax.Call,
    facts: dict[str, Any],
    operand_index: Callable[[relax.Expr], int],
) -> _RaggedOperands | None:
    """The checks of ``attention_var_len`` beyond attention's own: packed tokens (a batch of
    one), int32 seqstart tensors of rank 1, no sliding window, and equal head counts (the
    SM80-class kernel reads neither a window nor grouped heads; normalize repeats K and V up to
    the query heads for it)."""
    q, k, v = call.args[:3]
    start_q, start_k = call.args[3], call.args[4]
    batches = [shape_of(t)[0] for t in (q, k, v)]  # type: ignore[index]
    if any(dim_value(d) != 1 for d in batches):
        an.fail(
            "ragged_batch",
            "1 (sequences packed along the token axis)",
            [dim_label(d) for d in batches],
            "attention_var_len reads q, k and v as [1, tokens, heads, head_dim]; a batch "
            "dim other than 1 is not a packed ragged batch",
        )
    starts: dict[str, list[Any]] = {}
    for label, t in (("seqstart_q", start_q), ("seqstart_k", start_k)):
        ts = shape_of(t) if isinstance(t.ty, relax.TensorType) else None
        dtype = dtype_of(t) if ts is not None else "not a tensor"
        if ts is None or len(ts) != 1 or dtype != "int32":
            an.fail(
                "seqstart",
                "an int32 tensor [sequences + 1]",
                f"{dtype}, shape {[dim_label(d) for d in ts] if ts is not None else '?'}",
                f"{label} must be an int32 tensor of rank 1 (each sequence's first token, then "
                "the total): the kernel reads it as int32 at run time",
            )
            continue
        starts[label] = ts
        an.shapes[label] = [dim_label(d) for d in ts]
    if len(starts) == 2:
        a, b = starts["seqstart_q"][0], starts["seqstart_k"][0]
        if isinstance(dim_value(a), int) and isinstance(dim_value(b), int) and not same_dim(a, b):
            an.fail(
                "seqstart",
                "seqstart_q and seqstart_k of one extent",
                f"{dim_label(a)} and {dim_label(b)}",
                "seqstart_q and seqstart_k must count the same sequences",
            )
    if facts["window"] is not None:
        an.fail(
            "sliding_window",
            "no window_size (the ragged kernel reads none)",
            f"window_size={facts['window']}",
            f"window_size={facts['window']}: sliding-window attention is not supported by the "
            "ragged kernel (the SM80-class fMHA reads no window)",
        )
    if facts["nq"] != facts["nkv"]:
        an.fail(
            "num_heads",
            f"num_kv_heads == num_q_heads ({facts['nq']})",
            facts["nkv"],
            f"{facts['nq']} query heads but {facts['nkv']} key/value heads: the SM80-class "
            "kernel, the one that reads seqstart, takes equal head counts only",
        )
    if an.failures:
        return None
    extent = starts["seqstart_q"][0]
    sequences = (
        dim_value(extent) - 1  # type: ignore[operator]
        if isinstance(dim_value(extent), int)
        else re.sub(r"T\.int(?:32|64)\((-?\d+)\)", r"\1", str(_analyzer.simplify(extent - 1)))[:64]
    )
    an.ragged = Ragged(
        seqstart_q=name_of(start_q), seqstart_k=name_of(start_k), sequences=sequences
    )
    seqstarts = [start_q] if start_q.same_as(start_k) else [start_q, start_k]
    return _RaggedOperands(
        RaggedSpec(operand_index(start_q), operand_index(start_k)),
        seqstarts,
        [a for a in call.args[5:7] if isinstance(a, relax.Var)],
    )


def _leak_failure(an: Analysis, leaks: list[tuple[str, str]] | None) -> None:
    if leaks:
        var, role = leaks[0]
        an.fail(
            "no_leak",
            "q/k/v intermediates used only by attention",
            f"'{var[:64]}' ({role}) used elsewhere",
            f"'{var[:64]}' (the {role}) is also used outside the attention pattern; fusing "
            "would drop it, so stacked fusion needs q/k/v intermediates used only by attention",
        )


def _finish_spec(
    an: Analysis,
    facts: dict[str, Any],
    acc: dict[str, TensorAccess],
    seq_kv: Any,
    inputs: list[relax.Expr],
    bias: relax.Expr | None,
    params: list[relax.Var] | None,
    operand_index: Callable[[relax.Expr], int],
    packing: str,
    ragged: _RaggedOperands | None = None,
) -> None:
    """The alignment check, then ``an.spec``: shared by every pattern's analysis."""
    aligned = _check_alignment(
        an,
        facts["dtype"],
        acc["q"],
        acc["k"],
        acc["v"],
        facts["h"],
        facts["hv"],
        facts["bias_shape"],
    )
    if aligned is None:
        return
    if bias is not None:
        inputs = [*inputs, bias]
    if ragged is not None:
        inputs = [*inputs, *ragged.seqstarts]
    shapes: tuple[tuple[int | str, ...] | None, ...]
    if params is None:
        shapes = tuple(tuple(dim_value(d) for d in (shape_of(e) or [])) for e in inputs)
    else:
        ignored = ragged.ignored if ragged is not None else []
        shapes = tuple(
            tuple(dim_value(d) for d in (shape_of(p_) or []))
            if isinstance(p_.ty, relax.TensorType) and not any(p_.same_as(x) for x in ignored)
            else None
            for p_ in params
        )
    an.spec = AttentionSpec(
        dtype=facts["dtype"],
        batch=dim_value(facts["b"]),
        seq_q=dim_value(facts["s"]),
        seq_kv=dim_value(seq_kv),
        num_q_heads=facts["nq"],
        num_kv_heads=facts["nkv"],
        head_dim=facts["h"],
        head_dim_v=facts["hv"],
        scale=facts["scale"],
        causal=facts["causal"],
        q=acc["q"],
        k=acc["k"],
        v=acc["v"],
        num_operands=len(shapes),
        bias=BiasSpec(operand_index(bias), facts["bias_shape"]) if bias is not None else None,
        packing=packing,  # type: ignore[arg-type]
        operand_shapes=shapes,
        window=facts["window"],
        ragged=ragged.spec if ragged is not None else None,
    )


_INTERLEAVED_5D = f"{CODEGEN}.stacked_attention.interleaved_5d"


def _interleaved_columns(
    an: Analysis, ann: dict[str, relax.Expr], qkv_shape: list[Any]
) -> dict[str, int] | None:
    """Column offset of q, k, v within one head's packed block (the last axis for rank 4, the
    ``3`` axis times H for rank 5), from the split or the slices."""
    rank = len(qkv_shape)
    if "split" in ann:
        cut = _split_bounds(
            an,
            ann["split"],
            3,
            qkv_shape[3],
            "interleaved",
            "the per-head q|k|v axis of [batch, seq, heads, 3*head_dim] or "
            "[batch, seq, heads, 3, head_dim]",
        )
        if cut is None:
            return None
        cols = {"q": cut[0], "k": cut[1], "v": cut[2]}
        if rank == 5:
            h = dim_value(qkv_shape[4])
            if not isinstance(h, int):
                what = dim_label(qkv_shape[4])
                an.fail("static_feature_dim", "static", what, f"head dim is symbolic ({what})")
                return None
            cols = {r: c * h for r, c in cols.items()}
        return cols
    cols = {}
    for role, name in (("q", "query"), ("k", "key"), ("v", "value")):
        sl = ann[f"strided_slice_{name}"]
        axes = const_ints(sl.args[1])
        begins = const_ints(sl.args[2])
        strides = const_ints(sl.args[4]) if len(sl.args) > 4 else [1]
        if axes is None or begins is None or strides is None:
            an.fail(
                "slice_static",
                "constant axes/begin/end/strides",
                "symbolic",
                f"the {role} strided_slice has non-constant bounds",
            )
            return None
        if axes != [3] or strides != [1] or begins[0] < 0:
            an.fail(
                "slice_axis",
                "axes [3], stride 1, begin >= 0",
                f"axes {axes}, strides {strides}, begin {begins}",
                f"the {role} strided_slice must take a contiguous range of axis 3",
            )
            return None
        cols[role] = begins[0]
    return cols


def analyze_interleaved(
    pdef: PatternDef,
    ann: dict[str, relax.Expr],
    operand_index: Callable[[relax.Expr], int],
    leaks: list[tuple[str, str]] | None = None,
    params: list[relax.Var] | None = None,
) -> Analysis:
    """:func:`analyze` for the per-head interleaved layout: q at column 0, k at H, v at 2H of
    each head's block, head stride 3H, row stride N*3H (elements)."""
    an = Analysis(pdef)
    call = ann["attention"]
    bias = ann.get("bias")
    qkv = ann["stacked_qkv"]
    q, k, v = call.args[0], call.args[1], call.args[2]
    qkv_shape = shape_of(qkv)
    nd = qkv.ty.ndim
    # another layout altogether (the blocked [B, S, 3NH] one): not a candidate, no failure
    if qkv_shape is None or nd != (5 if pdef.name.startswith(_INTERLEAVED_5D) else 4):
        return an
    if nd == 5 and dim_value(qkv_shape[3]) != 3:
        return an
    an.shapes["qkv"] = [dim_label(d) for d in qkv_shape]
    _leak_failure(an, leaks)
    cols = _interleaved_columns(an, ann, qkv_shape)
    facts = _check_common(an, call, q, k, v, bias)
    if cols is None or facts is None:
        return an
    per_head = int(dim_value(qkv_shape[3])) if nd == 4 else 3 * int(dim_value(qkv_shape[4]))
    heads = dim_value(qkv_shape[2])
    for role, t in (("q", q), ("k", k), ("v", v)):
        ts = shape_of(t)
        assert ts is not None
        hd = facts["hv"] if role == "v" else facts["h"]
        ok = (
            same_dim(ts[0], qkv_shape[0])
            and same_dim(ts[1], qkv_shape[1])
            and heads == facts["nq"]
            and cols[role] + hd <= per_head
        )
        if not ok:
            an.fail(
                "reshape_shape",
                f"[{dim_label(qkv_shape[0])}, {dim_label(qkv_shape[1])}, {heads}, H] inside "
                f"each head's {per_head} columns",
                [dim_label(d) for d in ts],
                f"the {role} piece is not a [B, S, N, H] slice of the packed per-head block",
            )
    if facts["nkv"] != facts["nq"]:
        return an
    if an.failures:
        return an
    src = operand_index(qkv)
    row = int(heads) * per_head
    acc = {r: TensorAccess(src, cols[r], row, per_head) for r in ("q", "k", "v")}
    an.order = "".join(sorted("qkv", key=lambda r: cols[r]))
    _finish_spec(an, facts, acc, facts["s"], [qkv], bias, params, operand_index, "per_head")
    return an


# --------------------------------------------------------------------------------------------
# sites
# --------------------------------------------------------------------------------------------
@dataclass
class Site:
    id: str
    where: Where
    function_key: str = ""  # the GlobalVar name, uncut: sites are ordered within it


def site_of(call: relax.Call, prefix: str = SITE_PREFIX) -> str | None:
    span = call.span
    if span is None:
        return None
    name = span.source_name.name
    return name[len(prefix) :] if name.startswith(prefix) else None


def _is_attention(expr: Any) -> bool:
    return (
        isinstance(expr, relax.Call)
        and isinstance(expr.op, ir.Op)
        and expr.op.name in ATTENTION_OPS
    )


def tag_sites(
    mod: tvm.IRModule,
    is_site: Callable[[Any], bool] = _is_attention,
    prefix: str = SITE_PREFIX,
    label: str = "attention",
) -> tuple[tvm.IRModule, dict[str, Site]]:
    """Give every call ``is_site`` accepts (attention calls by default) a span
    ``<prefix><n>``; return the site table. Sites are named ``<function>/<label>#<k>``."""
    sites: dict[str, Site] = {}
    counter = [0]

    @relax.expr_functor.mutator
    class _Tagger(relax.PyExprMutator):
        def __init__(self, mod: tvm.IRModule, fname: str, names: dict[Any, str]) -> None:
            super().__init__(mod)
            self.fname = fname
            self.names = names
            self.local = 0

        def visit_call_(self, call: relax.Call) -> relax.Expr:
            new = super().visit_call_(call)
            if not is_site(new):
                return new
            sid = str(counter[0])
            counter[0] += 1
            binding = self.names.get(call, "?")
            sites[sid] = Site(
                sid,
                Where(
                    function=self.fname[:128],
                    site=f"{self.fname[:128]}/{label}#{self.local}",
                    binding=binding,
                ),
                function_key=self.fname,
            )
            self.local += 1
            span = ir.Span(ir.SourceName(prefix + sid), 0, 0, 0, 0)
            return relax.Call(new.op, new.args, new.attrs, new.ty_args, span)

    out = mod
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        names: dict[Any, str] = {}
        for block in func.body.blocks:
            for b in block.bindings:
                if is_site(b.value):
                    names[b.value] = name_of(b.var)
        new = _Tagger(mod, gv.name_hint, names).visit_expr(func)
        out = out if new.same_as(func) else _replace(out, gv, new)
    return out, sites


def _replace(mod: tvm.IRModule, gv: ir.GlobalVar, func: relax.Function) -> tvm.IRModule:
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else mod
    mod[gv] = func
    return mod


def _where_for(sites: dict[str, Site], sid: str | None) -> Where:
    if sid is not None and sid in sites:
        return sites[sid].where
    return Where(function="?", site="?", binding="?")


# --------------------------------------------------------------------------------------------
# partition
# --------------------------------------------------------------------------------------------
@dataclass
class FusedFunction:
    """A codegen function FuseOpsByPattern made; structurally equal sites share one."""

    gvar: ir.GlobalVar
    pattern: PatternDef
    #: checked on the fused function itself: operand indices are its parameter positions
    analysis: Analysis


@dataclass
class SiteMatch:
    """One attention site and the fused function that now computes it."""

    site: str
    function: FusedFunction
    bindings: list[str]

    @property
    def pattern(self) -> PatternDef:
        return self.function.pattern

    @property
    def analysis(self) -> Analysis:
        return self.function.analysis

    @property
    def gvar(self) -> ir.GlobalVar:
        return self.function.gvar


@dataclass
class PartitionResult:
    mod: tvm.IRModule
    sites: dict[str, Site]
    functions: list[FusedFunction]
    #: fused sites, in site order
    fused: list[SiteMatch]
    failures: list[CheckFailure]
    #: why each site that is not fused stacked is not, and chains not seen as attention
    reasons: list[SiteReason] = field(default_factory=list)
    #: sites left to TVM in a form TVM cannot build (also in ``failures``): the job fails on
    #: them before codegen, not at build time
    unbuildable: list[CheckFailure] = field(default_factory=list)
    #: normalize's rewrites of sites no kernel took as they were (sliding windows that normalize
    #: left for the Hopper kernel on sm_90, written as masks), each with the reason
    rewrites: list[Rewrite] = field(default_factory=list)
    #: the module before fusion, its sites tagged; and the ids of its sites with a window
    tagged: tvm.IRModule | None = None
    windowed: list[str] = field(default_factory=list)

    def match_entries(self) -> list[Match]:
        out = []
        for sm in self.fused:
            spec = sm.analysis.spec
            assert spec is not None
            out.append(
                Match(
                    where=_where_for(self.sites, sm.site),
                    pattern=sm.pattern.name,
                    kind=sm.pattern.kind,  # type: ignore[arg-type]
                    variant=sm.pattern.variant,  # type: ignore[arg-type]
                    bias=sm.pattern.bias,
                    causal=spec.causal,
                    dtype=spec.dtype,
                    shapes=sm.analysis.shapes,
                    bindings=sm.bindings,
                    scale=spec.scale,
                    layout=layout_of(spec, sm.analysis.order, sm.analysis.ragged),
                )
            )
        return out


def layout_of(spec: AttentionSpec, order: str = "qkv", ragged: Ragged | None = None) -> Layout:
    def batch(a: TensorAccess, seq: int | str) -> int | str:
        return a.row_stride * seq if isinstance(seq, int) else f"{a.row_stride}*seq_len"

    return Layout(
        source="stacked" if spec.packing != "separate" else "separate",
        q_offset=spec.q.offset,
        k_offset=spec.k.offset,
        v_offset=spec.v.offset,
        row_stride={"q": spec.q.row_stride, "k": spec.k.row_stride, "v": spec.v.row_stride},
        head_stride={"q": spec.q.head_stride, "k": spec.k.head_stride, "v": spec.v.head_stride},
        batch_stride={
            "q": batch(spec.q, spec.seq_q),
            "k": batch(spec.k, spec.seq_kv),
            "v": batch(spec.v, spec.seq_kv),
        },
        order=order,
        packing=spec.packing,
        ragged=ragged,
    )


_ROLE_OF = {
    "split": "split tuple",
    "strided_slice_query": "q slice",
    "strided_slice_key": "k slice",
    "strided_slice_value": "v slice",
}


def _leaks(ctx: relax.transform.PatternCheckContext) -> list[tuple[str, str]]:
    """Intermediates of the match that something outside the match also uses."""
    inside = set(ctx.matched_bindings.keys())
    out_var = ctx.value_to_bound_var[ctx.matched_expr]
    roles: dict[Any, str] = {}
    attention = ctx.annotated_expr["attention"]
    for arg, role in zip(attention.args, ("q reshape", "k reshape", "v reshape"), strict=False):
        roles[arg] = role
    for name, expr in ((str(k), v) for k, v in ctx.annotated_expr.items()):
        var = ctx.value_to_bound_var.get(expr) if expr in ctx.value_to_bound_var else None
        if var is not None:
            roles[var] = _ROLE_OF.get(name, name)
    found = []
    for var in inside:
        if var.same_as(out_var):
            continue
        users = ctx.var_usages.get(var, [])
        if not isinstance(var, relax.DataflowVar) or any(u not in inside for u in users):
            role = roles.get(var, "intermediate")
            found.append((name_of(var), role))
    return sorted(found)


def _kernel_check(an: Analysis, arch: str, preference: str) -> None:
    """GQA/MQA and sliding windows run only where a kernel for them exists (the Hopper kernel
    on sm_90)."""
    from worker.selection import kernel_gap

    spec = an.spec
    if spec is None:
        return
    gap = kernel_gap(spec, arch, preference)
    if gap is not None and spec.window is not None:
        an.fail(
            "sliding_window",
            "a kernel that reads the window (the Hopper kernel)",
            f"window_size={spec.window}, causal {spec.causal}",
            f"sliding-window attention (window_size={spec.window}) needs the Hopper kernel, "
            f"and {gap}",
        )
        an.spec = None
    elif gap is not None:
        an.fail(
            "num_heads",
            f"num_kv_heads == num_q_heads ({spec.num_q_heads}), or a kernel for GQA/MQA",
            spec.num_kv_heads,
            f"{spec.num_q_heads} query heads but {spec.num_kv_heads} key/value heads "
            f"(GQA/MQA) need the Hopper kernel, and {gap}",
        )
        an.spec = None


#: the pattern that takes every ``attention_var_len`` its analysis accepts, whatever the layout
RAGGED_PLAIN = f"{CODEGEN}.attention_var_len"


def ragged_refusal(call: relax.Call, options: CompileOptions) -> str | None:
    """Why ``call`` (``attention_var_len`` with its types known) cannot run as a ragged site on
    the SM80-class kernel, or None. TVM cannot build a var-len call that no kernel takes, so
    normalize keeps one only where this says None (else it writes a masked attention): the plain
    ragged pattern takes every call its analysis accepts (the stacked one first, where q, k and
    v are views of one packed tensor), and that analysis is the one run here."""
    if not options.offload_plain:
        return (
            "options.offload_plain is off, and the plain ragged pattern is the one that takes "
            "q, k and v in any layout"
        )
    an = analyze(PATTERNS[RAGGED_PLAIN], {"attention": call}, lambda e: 0)
    if an.ok:
        return None
    return "; ".join(dict.fromkeys(f.message for f in an.failures))


def refused_windows(result: PartitionResult) -> dict[str | None, str]:
    """site id -> why no kernel took it, for each windowed site that no pattern fused (the
    window's own check first)."""
    fused = {sm.site for sm in result.fused}
    out: dict[str | None, str] = {}
    for sid in result.windowed:
        if sid in fused:
            continue
        site = result.sites[sid].where.site
        found = [f for f in result.failures if f.where.site == site and f.pattern != TVM_FALLBACK]
        found.sort(key=lambda f: f.check != "sliding_window")
        why = found[0].message if found else "no pattern matched it"
        out[sid] = f"no kernel took the window: {why}"
    return out


def partition(mod: tvm.IRModule, options: CompileOptions, arch: str = "sm_90") -> PartitionResult:
    """Run the patterns over ``mod``: fused functions for sites that pass, failures for the rest.
    (:func:`worker.normalize.partition_sites` runs this and writes the sliding windows no kernel
    took as masks.)"""
    mod, sites = tag_sites(mod)
    failures: dict[tuple[str, str, str], CheckFailure] = {}
    covered: dict[tuple[str, str], list[str]] = {}
    order = [
        n
        for n in PATTERN_ORDER
        if (PATTERNS[n].kind == "stacked" and options.fuse_stacked)
        or (PATTERNS[n].kind == "plain" and options.offload_plain)
    ]

    def make_check(pdef: PatternDef) -> Callable[[Any], bool]:
        def check(ctx: relax.transform.PatternCheckContext) -> bool:
            ann = {str(k): v for k, v in ctx.annotated_expr.items()}
            an = analyze(pdef, ann, lambda e: 0, _leaks(ctx) if pdef.kind == "stacked" else None)
            _kernel_check(an, arch, options.kernel)
            sid = site_of(ann["attention"])
            for f in an.failures:
                failures.setdefault(
                    (sid or "?", pdef.name, f.check),
                    CheckFailure(
                        where=_where_for(sites, sid),
                        pattern=pdef.name,
                        check=f.check,
                        expected=f.expected,
                        actual=f.actual,
                        message=f.message,
                    ),
                )
            if an.ok:
                covered[(sid or "?", pdef.name)] = sorted(name_of(v) for v in ctx.matched_bindings)
            return an.ok

        return check

    fused_mod, functions = fuse_patterns(
        mod, [PATTERNS[n] for n in order], make_check, _fused_function
    )
    matches = [
        SiteMatch(sid, ff, covered.get((sid, ff.pattern.name), []))
        for sid, ff in _sites_of_calls(fused_mod, sites, functions)
    ]
    matches.sort(key=lambda sm: int(sm.site))
    fused_ids = {sm.site for sm in matches}
    unbuildable = [
        f for sid, f in _unbuildable(mod, sites, options) if sid is None or sid not in fused_ids
    ]
    result = PartitionResult(
        fused_mod,
        sites,
        list(functions.values()),
        matches,
        [*failures.values(), *unbuildable],
        unbuildable=unbuildable,
        tagged=mod,
        windowed=_windowed_sites(mod),
    )
    result.reasons = site_reasons(mod, result)
    return result


def _windowed_sites(mod: tvm.IRModule) -> list[str]:
    """Ids of the tagged sites with a sliding window."""
    out: list[str] = []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for block in func.body.blocks:
                for b in block.bindings:
                    call = b.value
                    if _is_attention(call) and call.attrs.window_size is not None:
                        sid = site_of(call)
                        if sid is not None:
                            out.append(sid)
    return out


#: the pattern name of the refusals below: they concern TVM's fallback, not one of our patterns
TVM_FALLBACK = "tvm.legalize"


def _unbuildable(
    mod: tvm.IRModule, sites: dict[str, Site], options: CompileOptions
) -> list[tuple[str | None, CheckFailure]]:
    """Attention TVM's legalization refuses: sliding windows ("Legalization for sliding-window
    attention is not supported yet") and ``attention_var_len`` ("Legalization of
    attention_var_len op is not supported yet"), each with its site id; the caller keeps those
    no kernel took."""
    out: list[tuple[str | None, CheckFailure]] = []
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for b in block.bindings:
                call = b.value
                if not isinstance(call, relax.Call) or not isinstance(call.op, ir.Op):
                    continue
                windowed = call.op.name in ATTENTION_OPS and call.op.name != VAR_LEN_OP
                if windowed and call.attrs.window_size is not None:
                    _, causal, window = attention_attrs(call)
                    if not options.normalize:
                        why = "options.normalize is off, which would write it as a masked attention"
                    elif causal not in ("TopLeft", "BottomRight"):
                        why = (
                            f"a window needs a causal mask (TopLeft or BottomRight), not {causal!r}"
                        )
                    else:
                        why = "normalize writes a window as a mask only for window_size >= 1 and "
                        why += "q and k of known rank-4 shapes"
                    sid = site_of(call)
                    out.append(
                        (
                            sid,
                            CheckFailure(
                                where=_where_for(sites, sid),
                                pattern=TVM_FALLBACK,
                                check="sliding_window",
                                expected="a window no kernel takes is rewritten as a mask",
                                actual=f"window_size={window}, causal {causal}",
                                message=f"sliding-window attention (window_size={window}) is "
                                "taken by no kernel here and TVM cannot build it; " + why,
                            ),
                        )
                    )
                elif call.op.name == VAR_LEN_OP:
                    sid = site_of(call)
                    out.append(
                        (
                            sid,
                            CheckFailure(
                                where=_where_for(sites, sid),
                                pattern=TVM_FALLBACK,
                                check="var_len",
                                expected="a ragged kernel, or a form normalize writes as a "
                                "masked attention",
                                actual="R.nn.attention_var_len",
                                message="variable-length attention (R.nn.attention_var_len) is "
                                "taken by no kernel here and TVM cannot build it; "
                                + (
                                    "options.normalize is off, which would repeat grouped K/V "
                                    "heads for the ragged kernel or write it as one masked "
                                    "attention"
                                    if not options.normalize
                                    else "the ragged kernel refused it (see this site's check "
                                    "failures), and normalize writes it as one masked "
                                    "attention only for tokens packed as [1, T, N, H] with one "
                                    "seqstart for queries and keys"
                                ),
                            ),
                        )
                    )
    return out


def fuse_patterns(
    mod: tvm.IRModule,
    defs: list[Any],
    make_check: Callable[[Any], Callable[[Any], bool]],
    fused_of: Callable[[ir.GlobalVar, Any], Fused | None],
) -> tuple[tvm.IRModule, dict[ir.GlobalVar, Fused]]:
    """Run FuseOpsByPattern with ``defs`` (each with ``name``, ``pattern`` and
    ``annotations``), in order, each guarded by ``make_check(def)``; then read every fused
    function back with ``fused_of`` (None: not one of ours). Attention and GEMMs share it."""
    pats = [
        relax.transform.FusionPattern(d.name, d.pattern, d.annotations, make_check(d)) for d in defs
    ]
    fused_mod = relax.transform.FuseOpsByPattern(pats, bind_constants=False, annotate_codegen=True)(
        mod
    )
    functions = {}
    for gv, f in fused_mod.functions.items():
        ff = fused_of(gv, f)
        if ff is not None:
            functions[gv] = ff
    return fused_mod, functions


def _sites_of_calls(
    mod: tvm.IRModule,
    sites: dict[str, Site],
    functions: dict[ir.GlobalVar, Fused],
    is_site: Callable[[Any], bool] = _is_attention,
    prefix: str = SITE_PREFIX,
) -> list[tuple[str, Fused]]:
    """Which site each call to a fused function stands for.

    FuseOpsByPattern merges structurally equal fused functions, so a function's own attention
    span names only one of the sites it computes. Calls keep the order of the sites they
    replace, so within each caller the sites that vanished pair up with its calls in order.
    """
    ordered: dict[str, list[str]] = {}
    for sid in sorted(sites, key=int):
        ordered.setdefault(sites[sid].function_key, []).append(sid)
    out: list[tuple[str, Fused]] = []
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or gv in functions:
            continue
        remaining: set[str] = set()
        calls: list[Fused] = []

        def visit(e: Any, remaining: set[str] = remaining, calls: list[Fused] = calls) -> None:
            if not isinstance(e, relax.Call):
                return
            if is_site(e) and site_of(e, prefix) is not None:
                remaining.add(site_of(e, prefix))  # type: ignore[arg-type]
            elif isinstance(e.op, ir.GlobalVar) and e.op in functions:
                calls.append(functions[e.op])

        for block in func.body.blocks:
            for b in block.bindings:
                relax.analysis.post_order_visit(b.value, visit)
        gone = [sid for sid in ordered.get(gv.name_hint, []) if sid not in remaining]
        if len(gone) != len(calls):
            raise AssertionError(
                f"{len(calls)} fused calls for {len(gone)} fused sites in {gv.name_hint[:64]}"
            )
        out.extend(zip(gone, calls, strict=True))
    return out


def _composite_of(outer: relax.Function) -> relax.Function | None:
    found: list[relax.Function] = []

    def visit(e: Any) -> None:
        if isinstance(e, relax.Function) and e.attrs is not None and "Composite" in e.attrs:
            found.append(e)

    relax.analysis.post_order_visit(outer.body, visit)
    return found[0] if found else None


def _fused_function(gv: ir.GlobalVar, func: Any) -> FusedFunction | None:
    if not isinstance(func, relax.Function) or func.attrs is None:
        return None
    if func.attrs.get("Codegen") != CODEGEN:
        return None
    inner = _composite_of(func)
    if inner is None:
        return None
    pdef = PATTERNS[str(inner.attrs["Composite"])]
    var2val = relax.analysis.get_var2val(inner)
    root = inner.body.body
    if isinstance(root, relax.Var) and root in var2val:
        root = var2val[root]
    matched = pdef.pattern.extract_matched_expr(root, var2val)
    if matched is None:
        raise AssertionError(f"fused function {gv.name_hint} no longer matches {pdef.name}")
    ann = {name: matched[p] for name, p in pdef.annotations.items() if p in matched}
    params = list(inner.params)

    def operand_index(e: relax.Expr) -> int:
        for i, p in enumerate(params):
            if p.same_as(e):
                return i
        raise AssertionError("kernel operand is not a parameter of the fused function")

    an = analyze(pdef, ann, operand_index, params=params)
    if not an.ok:
        msgs = "; ".join(f.message for f in an.failures)
        raise AssertionError(f"fused function {gv.name_hint} fails its checks: {msgs}")
    return FusedFunction(gv, pdef, an)


# --------------------------------------------------------------------------------------------
# why a site is not fused stacked (report.site_reasons)
# --------------------------------------------------------------------------------------------
#: operators that only view their input: q, k and v reached through these alone are slices of
#: the tensor they come from
VIEW_OPS = frozenset(
    {"relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze", "relax.astype"}
)
#: operators that repeat K/V heads up to the query heads (GQA/MQA as exported)
REPEAT_OPS = frozenset({"broadcast_to", "repeat", "tile"})
#: where a stacked tensor is cut into q, k and v
CUT_OPS = frozenset({"relax.split", "relax.strided_slice"})
#: at most this many bindings are walked back from an operand
TRACE_DEPTH = 24


def _bindings(func: relax.Function) -> dict[Any, Any]:
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}


def _op_name(expr: Any) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, ir.Op):
        return str(expr.op.name)
    return None


def _trace_to_cut(expr: Any, values: dict[Any, Any]) -> tuple[bool, list[str]]:
    """Walk back from ``expr`` over every path up to a split/slice (or a parameter); return
    whether a split/slice was reached and the non-view operators passed on the way (rotary:
    ``multiply``, ``add``, ``concat``)."""
    passed: list[str] = []
    cut = False
    todo, visited = [expr], 0
    seen: set[Any] = set()
    while todo and visited < TRACE_DEPTH:
        e = todo.pop(0)
        if e in seen:
            continue
        seen.add(e)
        visited += 1
        e = values.get(e, e)
        if isinstance(e, relax.TupleGetItem):
            e = values.get(e.tuple_value, e.tuple_value)
        op = _op_name(e)
        if op is None:
            continue
        if op in CUT_OPS:
            cut = True
            continue
        if op not in VIEW_OPS:
            passed.append(op.removeprefix("relax."))
        for a in e.args:
            todo.extend(a.fields if isinstance(a, relax.Tuple) else [a])
    return cut, passed


def _constant_of(expr: Any, values: dict[Any, Any], depth: int = 0) -> Any:
    """The value (numpy) of ``expr`` when it is a constant, through views and casts
    (``reshape(astype(c))``) and ``where`` of constants (a boolean mask made additive), or
    None."""
    import numpy as np

    for _ in range(TRACE_DEPTH):
        e = values.get(expr, expr)
        if isinstance(e, ir.expr.GenericConst):
            return e.value.numpy()
        op = _op_name(e)
        if op == "relax.where" and depth < 2:
            parts = [_constant_of(a, values, depth + 1) for a in e.args]
            if any(x is None for x in parts):
                return None
            return np.where(*parts)
        if op not in VIEW_OPS:
            return None
        expr = e.args[0]
    return None


def band_width(keep: Any, offset: int) -> int | None:
    """``w`` when ``keep`` (``[..., S, S_kv]`` booleans, the same for every leading index)
    lets query i see exactly the keys j with ``i + offset - w < j <= i + offset``: a causal
    band of ``w`` keys (``offset`` 0 top-left, ``S_kv - S`` bottom-right); else None. A band
    at least as wide as every row's causal keys is the causal mask itself."""
    import numpy as np

    s, skv = keep.shape[-2:]
    i = np.arange(s)[:, None] + offset
    j = np.arange(skv)[None, :]
    # the widest row holds the band's width: the one width to check (one pass over the mask)
    w = int(keep.reshape(-1, s, skv).sum(axis=-1).max())
    if w and np.array_equal(keep, np.broadcast_to((j <= i) & (j > i - w), keep.shape)):
        return w
    return None


def _bias_kind(expr: Any, values: dict[Any, Any]) -> str:
    """What an additive bias on the scores is, in words: a constant mask (causal, a sliding
    window), a constant position bias (ALiBi's), or a bias computed from the inputs."""
    import numpy as np

    const = _constant_of(expr, values)
    shape = shape_of(expr)
    dims = f"[{', '.join(str(dim_label(d)) for d in shape)}] " if shape else ""
    if const is None:
        return f"a {dims}bias computed from the inputs (a padding mask, a position bias)"
    arr = np.asarray(const, dtype="float32")
    keep = arr > MASKED
    if arr.ndim < 2 or np.any(arr[keep] != 0.0):
        return (
            f"a constant {dims}position bias (values other than 0 and masked: ALiBi's "
            "per-head slopes)"
        )
    if keep.all():
        return f"a constant {dims}mask that keeps every key"
    w = band_width(keep, keep.shape[-1] - keep.shape[-2])  # bottom-right, as exporters align
    if w == keep.shape[-1]:
        return f"a constant {dims}causal mask"
    if w is not None:
        return f"a constant {dims}sliding-window mask (each query sees its last {w} keys)"
    return f"a constant {dims}mask that is neither causal nor all-true"


def _plain_reason(call: relax.Call, values: dict[Any, Any], failures: list[str]) -> str:
    computed = []
    viewed = []
    repeated: dict[str, None] = {}
    repeats: dict[str, None] = {}
    for name, arg in zip("qkv", call.args[:3], strict=True):
        cut, passed = _trace_to_cut(arg, values)
        rest = [o for o in passed if o not in REPEAT_OPS]
        if rest:
            ops = ", ".join(f"`{o}`" for o in dict.fromkeys(rest))
            computed.append(f"{name} passes through {ops}" + (" after the split" if cut else ""))
        if len(rest) < len(passed):
            repeated[name] = None
            repeats.update((f"`{o}`", None) for o in passed if o in REPEAT_OPS)
        viewed.append(_view_ops(arg, values))
    bias = ""
    if len(call.args) > 3 and isinstance(call.args[3], relax.Expr):
        bias = f"; the attention reads a bias tensor, {_bias_kind(call.args[3], values)}"
    if computed or repeated:
        said = []
        if computed:
            said.append(
                "; ".join(computed) + ": not a view of one stacked tensor (rotary embeddings, "
                "a projection of its own)"
            )
        if repeated:
            said.append(
                f"{' and '.join(repeated)} repeated up to the query heads ({', '.join(repeats)})"
                ": grouped_kv reads K/V heads grouped only on sm_90, in float16/bfloat16, "
                "without a bias (the Hopper kernel reads grouped heads; the SM80-class kernel "
                "reads equal head counts only, so K and V stay repeated)"
            )
        return "; ".join(said) + bias + ", so fused as plain attention with q, k, v in memory"
    heads = [shape_of(a) for a in call.args[:3]]
    parts = []
    nq = heads[0][2] if heads[0] and len(heads[0]) == 4 else None
    nkv = heads[1][2] if heads[1] and len(heads[1]) == 4 else None
    if nq is not None and nkv is not None and not same_dim(nq, nkv):
        kind = "multi-query" if _is_int_imm(nkv) and int(nkv) == 1 else "grouped-query"
        parts.append(
            f"{dim_label(nq)} query heads share {dim_label(nkv)} key/value head(s) ({kind})"
        )
    for n, views in zip("qkv", viewed, strict=True):
        if views:
            names = ", ".join(f"`{o}`" for o in views)
            parts.append(f"{n} reaches the attention through {names}")
    why = "; ".join([*parts, *dict.fromkeys(failures)]) or "see check_failures for this site"
    return (
        "q, k and v are views of one tensor, but no stacked pattern (split -> reshape -> "
        f"attention) accepted them: {why}" + bias + "; fused as plain attention"
    )


def _ragged_reason(call: relax.Call, values: dict[Any, Any], failures: list[str]) -> str:
    """:func:`_plain_reason` for a ragged batch (``attention_var_len``), which has no bias."""
    traced = [_trace_to_cut(a, values) for a in call.args[:3]]
    repeated = [n for n, (_, ops) in zip("qkv", traced, strict=True) if set(ops) & REPEAT_OPS]
    computed = [n for n, (_, ops) in zip("qkv", traced, strict=True) if set(ops) - REPEAT_OPS]
    if repeated:
        why = (
            f"{' and '.join(repeated)} repeated up to the query heads: the SM80-class kernel, "
            "the one that reads seqstart, takes equal head counts only"
        )
    elif computed:
        why = f"{', '.join(computed)} computed, not views of one packed tensor"
    elif all(cut for cut, _ in traced):
        why = (
            "q, k and v are views of one packed tensor, but no stacked pattern (split -> "
            "reshape -> attention_var_len) accepted them: "
            + ("; ".join(dict.fromkeys(failures)) or "see check_failures for this site")
        )
    else:
        why = "q, k and v are separate tensors"
    return (
        f"a ragged batch (attention_var_len): {why}; fused as plain attention over the packed "
        "tokens, each sequence on its own keys (seqstart)"
    )


def _view_ops(expr: Any, values: dict[Any, Any]) -> list[str]:
    """The view operators other than ``reshape`` between a split/slice and ``expr``: the
    stacked patterns take q, k and v as reshapes of the split's parts."""
    ops: list[str] = []
    for _ in range(TRACE_DEPTH):
        e = values.get(expr, expr)
        op = _op_name(e)
        if op is None or op not in VIEW_OPS:
            break
        if op != "relax.reshape":
            ops.append(op.removeprefix("relax."))
        expr = e.args[0]
    return list(dict.fromkeys(ops))


#: operators that keep a value what it is between the softmax and the matmul that reads it
PASS_OPS = frozenset({"relax.astype", "relax.reshape"})


def _unfused_chains(func: relax.Function, values: dict[Any, Any]) -> list[str]:
    """``matmul -> ... -> softmax -> matmul`` chains left as they are: attention that the
    matcher never reached (a bias computed by a matmul of its own, an operator other than a
    scale, a cast or an add on the scores)."""
    users: dict[Any, list[Any]] = {}
    bound = {id(v): k for k, v in values.items()}
    for value in values.values():
        for a in getattr(value, "args", []):
            if isinstance(a, relax.Var):
                users.setdefault(a, []).append(value)
    out = []
    for var, value in values.items():
        if _op_name(value) != "relax.nn.softmax":
            continue
        between: list[str] = []
        biases: list[str] = []
        e, steps = value.args[0], 0
        while steps < 8 and _op_name(values.get(e)) not in (None, "relax.matmul"):
            nxt = values[e]
            between.append(str(_op_name(nxt)).removeprefix("relax."))
            e = next((a for a in nxt.args if isinstance(a, relax.Var) and a in values), None)
            if _op_name(nxt) == "relax.add":
                biases += [_bias_kind(a, values) for a in nxt.args if not a.same_as(e)]
            steps += 1
        if _op_name(values.get(e)) != "relax.matmul":
            continue
        # the probabilities may be cast or reshaped before the matmul that reads them
        ends, frontier = False, [var]
        for _ in range(4):
            nxt_users = [u for v in frontier for u in users.get(v, [])]
            if any(_op_name(u) == "relax.matmul" for u in nxt_users):
                ends = True
                break
            frontier = [bound[id(u)] for u in nxt_users if _op_name(u) in PASS_OPS]
        if not ends:
            continue
        ops = ", ".join(f"`{o}`" for o in dict.fromkeys(between)) or "nothing"
        what = (
            f"; it adds {len(biases)} bias(es) to the scores: {'; '.join(biases)}" if biases else ""
        )
        out.append(
            f"`{name_of(var)}`: matmul -> softmax -> matmul with {ops} between the scores and "
            "the softmax was not recognised as attention (decomposed_attention takes "
            "scales, additive biases, casts and views between 3-D and 4-D scores between one "
            "matmul of q and k and the softmax)" + what + "; it runs unfused in TVM"
        )
    return out


def site_reasons(tagged: tvm.IRModule, result: PartitionResult) -> list[SiteReason]:
    """One :class:`SiteReason` per site not fused stacked, and one per chain that computes
    attention but was never a site. ``tagged`` is the module before fusion, sites tagged."""
    kinds = {sm.site: sm.pattern.kind for sm in result.fused}
    failed: dict[str, list[str]] = {}
    for f in result.failures:
        failed.setdefault(f.where.site, []).append(f.message)
    out: list[SiteReason] = []
    for func in tagged.functions.values():
        if not isinstance(func, relax.Function):
            continue
        values = _bindings(func)
        for value in values.values():
            sid = site_of(value) if _is_attention(value) else None
            if sid is None or kinds.get(sid) == "stacked":
                continue
            where = _where_for(result.sites, sid)
            if kinds.get(sid) == "plain":
                reason = (_ragged_reason if _op_name(value) == VAR_LEN_OP else _plain_reason)(
                    value, values, failed.get(where.site, [])
                )
                out.append(SiteReason(where=where, outcome="fused_plain", reason=reason))
                continue
            why = "; ".join(dict.fromkeys(failed.get(where.site, []))) or "no pattern matched"
            out.append(
                SiteReason(where=where, outcome="not_offloaded", reason=f"left to TVM: {why}")
            )
        out.extend(
            SiteReason(outcome="not_attention", reason=r) for r in _unfused_chains(func, values)
        )
    return out
