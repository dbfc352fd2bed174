"""Checks on a module in TVM JSON that run before TVM sees a byte of it, and need no TVM.

The API calls :func:`check_module_json` to refuse bad input at once; the worker calls
:func:`checked_module_json` again and hands TVM the canonical re-serialization it returns, so TVM
parses exactly the document that was checked (no parser differential: duplicate keys, number
forms, escapes).

TVM's loader (``ffi.FromJSONGraph``) trusts its input: it indexes ``nodes`` without bounds
checks, recurses on references, builds objects without running their constructors (so invariants
such as "ndim matches the shape" are not enforced) and allocates constants at their declared
size. This module therefore checks the whole graph against TVM's own reflection schema
(:mod:`service.wire_schema`, generated from the pinned TVM): only node types from an explicit
allow-list, every field present and of the declared type, references strictly backward (no
cycles, bounded depth), and the limits in :class:`service.settings.Settings`. Every refusal is a
:class:`service.errors.StackfuseError` naming the node, the limit and the setting.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import itertools
import json
import math
import operator
import re
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

from service import wire_schema
from service.errors import (
    ForbiddenConstruct,
    InputError,
    LimitExceeded,
    MalformedJSON,
    StackfuseError,
)
from service.settings import Settings

# --- policy: what a client module may contain ----------------------------------------------

#: Relax operators a client may call: those ``relax.transform.LegalizeOps`` lowers to plain
#: tensor programs on CUDA, and the scans (:data:`SCAN_OPS`), which TVM's library dispatch
#: (``DispatchSortScan``, first in its CPU and CUDA pipelines and in ours) lowers. Left out on
#: purpose: anything that calls a named function at run
#: time (call_packed, call_pure_packed, call_dps_packed, call_tir*, call_builtin_with_ctx,
#: ExternFunc), prints or asserts, manages memory or the VM (relax.memory.*, relax.vm.*,
#: relax.builtin.*), distributed and gradient ops, introspection, vision ops, einsum (its
#: subscripts string is parsed in C++) and layout_transform (carries a TIR index map).
# fmt: off
ALLOWED_OPS: frozenset[str] = frozenset(
    "relax." + name for name in (
        # unary
        "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bitwise_not", "ceil", "clip",
        "cos", "cosh", "erf", "exp", "floor", "isfinite", "isinf", "isnan", "log", "logical_not",
        "negative", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "square", "tan",
        "tanh", "trunc",
        # binary
        "add", "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "divide", "equal",
        "floor_divide", "floor_mod", "greater", "greater_equal", "left_shift", "less", "less_equal",
        "log_add_exp", "logical_and", "logical_or", "logical_xor", "maximum", "minimum", "mod",
        "multiply", "not_equal", "power", "right_shift", "subtract",
        # creation
        "arange", "eye", "eye_like", "full", "full_like", "ones", "ones_like", "tril", "triu",
        "zeros", "zeros_like",
        # manipulation
        "astype", "broadcast_to", "collapse_sum_like", "collapse_sum_to", "concat",
        "dynamic_strided_slice", "expand_dims", "flatten", "flip", "gather_elements", "gather_nd",
        "index_put", "index_tensor", "meshgrid", "one_hot", "permute_dims", "repeat", "reshape",
        "reverse_sequence", "scatter_elements", "scatter_nd", "slice_scatter", "split", "squeeze",
        "stack", "strided_slice", "take", "tile", "where",
        # reduction, scan, linear algebra, quantization, image
        "argmax", "argmin", "max", "mean", "median", "min", "prod", "std", "sum", "variance",
        "cumprod", "cumsum",
        "matmul", "outer", "quantize", "dequantize", "image.resize2d",
        # nn
        "nn.adaptive_avg_pool1d", "nn.adaptive_avg_pool2d", "nn.adaptive_avg_pool3d",
        "nn.attention", "nn.attention_bias", "nn.attention_var_len", "nn.avg_pool1d",
        "nn.avg_pool2d", "nn.avg_pool3d", "nn.batch_flatten", "nn.batch_norm", "nn.conv1d",
        "nn.conv1d_transpose", "nn.conv2d", "nn.conv2d_transpose", "nn.conv3d",
        "nn.conv3d_transpose", "nn.cross_entropy_with_logits", "nn.dropout", "nn.gelu",
        "nn.gelu_tanh", "nn.group_norm", "nn.instance_norm", "nn.layer_norm", "nn.leakyrelu",
        "nn.log_softmax", "nn.max_pool1d", "nn.max_pool2d", "nn.max_pool3d", "nn.nll_loss",
        "nn.pad", "nn.pixel_shuffle", "nn.prelu", "nn.relu", "nn.rms_norm", "nn.selu", "nn.silu",
        "nn.softmax", "nn.softplus",
    )
)
# fmt: on

#: Attribute node types of the operators above.
# fmt: off
ATTRS_TYPES: frozenset[str] = frozenset(
    "relax.attrs." + name for name in (
        "AdaptivePool1DAttrs", "AdaptivePool2DAttrs", "AdaptivePool3DAttrs", "ArgmaxArgminAttrs",
        "AstypeAttrs", "AttentionAttrs", "BatchNormAttrs", "ConcatAttrs", "Conv1DAttrs",
        "Conv1DTransposeAttrs", "Conv2DAttrs", "Conv2DTransposeAttrs", "Conv3DAttrs",
        "Conv3DTransposeAttrs", "DropoutAttrs", "ExpandDimsAttrs", "FlipAttrs",
        "GatherElementsAttrs", "GatherNDAttrs", "GroupNormAttrs", "IndexPutAttrs", "InitAttrs",
        "InstanceNormAttrs", "LayerNormAttrs", "LeakyReluAttrs", "MatmulAttrs", "MeshgridAttrs",
        "NLLLossAttrs", "OneHotAttrs", "PReluAttrs", "PadAttrs", "PermuteDimsAttrs",
        "PixelShuffleAttrs", "Pool1DAttrs", "Pool2DAttrs", "Pool3DAttrs", "QuantizeAttrs",
        "RMSNormAttrs", "RepeatAttrs", "Resize2DAttrs", "ReverseSequenceAttrs",
        "ScanopAttrs", "ScatterElementsAttrs", "ScatterNDAttrs", "SliceScatterAttrs",
        "SoftmaxAttrs", "SoftplusAttrs", "SplitAttrs", "SqueezeAttrs", "StackAttrs",
        "StatisticalAttrs", "StridedSliceAttrs", "TakeAttrs", "TileAttrs",
    )
)
# fmt: on

#: Scans: ``relax.cumsum`` (``seqstart`` of a ragged batch is the cumsum of its lengths) and
#: ``relax.cumprod``, one attrs type (axis, result dtype, exclusive).
SCAN_OPS: frozenset[str] = frozenset({"relax.cumsum", "relax.cumprod"})
#: Result dtypes TVM builds a scan in, for LLVM and for CUDA alike (the input is cast to the
#: result dtype first, so any input dtype builds). Left out: bool (LLVM's build fails a
#: float-type check), int8 and uint8 (the CUDA build fails an internal check), float8 (nvcc
#: refuses TVM's CUDA for it) and void.
# fmt: off
SCAN_DTYPES: frozenset[str] = frozenset((
    "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "float32", "float64",
    "bfloat16",
))
# fmt: on

#: Everything else a saved Relax program is made of: containers, the module, Relax functions,
#: blocks and bindings, expressions, types, symbolic integer arithmetic, constants and spans.
# fmt: off
STRUCTURE_TYPES: frozenset[str] = frozenset((
    # containers and primitives
    "None", "bool", "int", "float", "DataType", "ffi.String", "ffi.Array", "ffi.Map", "ffi.Tensor",
    # module, spans, attributes
    "ir.IRModule", "ir.SourceMap", "ir.SourceName", "ir.Span", "ir.DictAttrs", "ir.GlobalVar",
    # types
    "ir.Type", "ir.PrimType", "ir.TupleType", "relax.TensorType", "relax.ShapeType",
    "relax.FuncType", "relax.AnyType",
    # expressions
    "ir.Var", "ir.Call", "ir.Op", "ir.Tuple", "ir.TupleGetItem", "ir.IntImm", "ir.FloatImm",
    "ir.GenericConst", "relax.expr.DataflowVar", "relax.expr.ShapeExpr", "relax.expr.If",
    # functions, blocks, bindings
    "relax.expr.Function", "relax.expr.SeqExpr", "relax.expr.DataflowBlock",
    "relax.expr.BindingBlock", "relax.expr.VarBinding", "relax.expr.MatchCast",
    # symbolic integer arithmetic
    "prim.Add", "prim.Sub", "prim.Mul", "prim.FloorDiv", "prim.FloorMod", "prim.Min", "prim.Max",
))
# fmt: on

ALLOWED_NODE_TYPES: frozenset[str] = STRUCTURE_TYPES | ATTRS_TYPES

#: Object fields that are not declared optional but are null in modules TVM itself writes.
NULLABLE_FIELDS: frozenset[tuple[str, str]] = frozenset({("*", "span"), ("ir.Call", "attrs")})

#: Relax expressions a binding, call argument or tuple field may be (no local functions,
#: operators or function references as values).
_RELAX_EXPR = (
    "ir.Var | ir.Call | ir.Tuple | ir.TupleGetItem | relax.expr.ShapeExpr | ir.GenericConst"
    " | relax.expr.If | ir.IntImm | ir.FloatImm"
)
#: Types a Relax expression may have. (``ir.Type`` itself is TVM's "type missing" marker,
#: which only a GlobalVar carries; TVM's type visitors abort on it.)
_RELAX_TYPE = (
    "relax.TensorType | relax.ShapeType | ir.TupleType | relax.FuncType | ir.PrimType"
    " | relax.AnyType"
)
#: Integer expressions over symbolic dims. ``PrimVar``: an ir.Var whose type is a PrimType.
_PRIM_EXPR = (
    "ir.IntImm | PrimVar | prim.Add | prim.Sub | prim.Mul | prim.FloorDiv | prim.FloorMod"
    " | prim.Min | prim.Max"
)
#: Fields TVM declares wider than Relax uses them. The IR is unified (a dim, a tensor variable
#: and a call are all ``ir.Expr``) and TVM's loader builds objects without their constructors'
#: checks, so a shape holding a call or a call whose operator is a dim crashes TVM's own
#: well-formedness check. These narrow each field to what a well-formed Relax program holds.
#: ``ShapeVar``: a variable whose type is a relax.ShapeType.
NARROWED_FIELDS: dict[tuple[str, str], str] = {
    ("ir.GenericConst", "value"): "ffi.Tensor",
    ("ir.Call", "op"): "ir.Op | ir.GlobalVar",
    ("ir.Call", "args"): f"Array[{_RELAX_EXPR}]",
    ("ir.Tuple", "fields"): f"Array[{_RELAX_EXPR}]",
    ("ir.TupleGetItem", "tuple_value"): _RELAX_EXPR,
    ("relax.expr.VarBinding", "value"): _RELAX_EXPR,
    ("relax.expr.MatchCast", "value"): _RELAX_EXPR,
    ("relax.expr.SeqExpr", "body"): _RELAX_EXPR,
    ("relax.expr.If", "cond"): _RELAX_EXPR,
    ("relax.expr.ShapeExpr", "values"): f"Array[{_PRIM_EXPR}]",
    ("relax.ShapeType", "values"): f"Array[{_PRIM_EXPR}] | None",
    ("relax.TensorType", "shape"): "relax.expr.ShapeExpr | ShapeVar | None",
    ("ir.IntImm", "ty"): "ir.PrimType",
    ("ir.FloatImm", "ty"): "ir.PrimType",
    ("relax.attrs.SplitAttrs", "indices_or_sections"): "ir.IntImm | Array[ir.IntImm]",
    ("relax.FuncType", "derive_func"): "None",
    ("relax.FuncType", "params"): f"Array[{_RELAX_TYPE}] | None",
    ("relax.FuncType", "ret"): _RELAX_TYPE,
    ("ir.TupleType", "fields"): f"Array[{_RELAX_TYPE}]",
    ("relax.TensorType", "dtype"): "ir.PrimType | None",
    ("relax.expr.MatchCast", "ty"): _RELAX_TYPE,
    ("relax.expr.Function", "ret_ty"): _RELAX_TYPE,
    ("ir.GlobalVar", "ty"): "ir.Type | relax.FuncType",
    **{
        (kind, "ty"): _RELAX_TYPE
        for kind in (
            "ir.Var",
            "relax.expr.DataflowVar",
            "ir.Call",
            "ir.Tuple",
            "ir.TupleGetItem",
            "relax.expr.ShapeExpr",
            "ir.GenericConst",
            "relax.expr.If",
            "relax.expr.SeqExpr",
            "relax.expr.Function",
        )
    },
    ("ir.IRModule", "functions"): "Map[ir.GlobalVar, relax.expr.Function]",
    **{
        (f"prim.{op}", side): _PRIM_EXPR
        for op in ("Add", "Sub", "Mul", "FloorDiv", "FloorMod", "Min", "Max")
        for side in ("a", "b")
    },
}

#: Why a known-dangerous node type is refused, in words a client can act on.
_FORBIDDEN_WHY: dict[str, str] = {
    "tirx.PrimFunc": "module contains a PrimFunc; Stackfuse accepts Relax functions only",
    "relax.expr.ExternFunc": "module refers to an external function (ExternFunc: call_packed, "
    "call_pure_packed, call_dps_packed...); Stackfuse accepts calls to Relax operators only",
    "ir.EnvFunc": "module refers to a global function by name (EnvFunc)",
    "relax.VDevice": "virtual devices are not accepted; the target is chosen per job",
    "ir.Source": "embedded source text is not accepted in the source map",
}

#: TVM copies variable and symbolic-dim names verbatim into the CUDA source it generates
#: (``float* __restrict__ <name>_ptr``, ``int64_t <name>``): a name holding a newline and
#: ``#include "/etc/passwd"`` becomes a preprocessor line. Names that can reach generated code
#: must be plain identifiers that are not C/C++/CUDA words; other variable names are replaced.
_CODE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}\Z")
# fmt: off
RESERVED_CODE_NAMES: frozenset[str] = frozenset((
    "auto", "bool", "break", "case", "char", "class", "const", "constexpr", "continue", "default",
    "delete", "do", "double", "else", "enum", "explicit", "export", "extern", "false", "float",
    "for", "friend", "goto", "if", "inline", "int", "long", "mutable", "namespace", "new",
    "noexcept", "nullptr", "operator", "private", "protected", "public", "register", "return",
    "short", "signed", "sizeof", "static", "struct", "switch", "template", "this", "throw", "true",
    "try", "typedef", "typeid", "typename", "union", "unsigned", "using", "virtual", "void",
    "volatile", "while", "asm", "restrict", "threadIdx", "blockIdx", "blockDim", "gridDim",
    "warpSize", "half", "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t",
    "uint32_t", "uint64_t", "size_t",
))
# fmt: on
#: Strings an operator attribute may hold (layouts, modes, causal masks): short words only.
_ATTR_STRING = re.compile(r"[A-Za-z0-9_]{0,32}\Z")
_VAR_TYPES = ("ir.Var", "relax.expr.DataflowVar")

# fmt: off
DTYPES: frozenset[str] = frozenset((
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
    "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2", "void",
))
# fmt: on

#: DLPack type codes and the dtype names they make, for constants.
_DL_CODES: dict[tuple[int, int], str] = {
    (0, 8): "int8",
    (0, 16): "int16",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 1): "bool",
    (1, 8): "uint8",
    (1, 16): "uint16",
    (1, 32): "uint32",
    (1, 64): "uint64",
    (2, 16): "float16",
    (2, 32): "float32",
    (2, 64): "float64",
    (4, 16): "bfloat16",
    (6, 8): "bool",
}
_TENSOR_MAGIC = 0xDD5E40F096B4A13F
_KDL_CPU = 1

_INT64 = (-(2**63), 2**63 - 1)
_TOP_KEYS = {"root_index", "nodes", "metadata"}
_NODE_KEYS = frozenset({"type", "data"})

# --- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WireSummary:
    """What the check learned, cheap to log and to store with the job."""

    nodes: int
    functions: int
    bindings: int
    constant_bytes: int
    depth: int
    sha256: str
    #: variables whose names were not plain identifiers and were replaced (see is_code_name)
    renamed: int = 0


def check_module_json(text: str | bytes, settings: Settings) -> WireSummary:
    """Check a TVM JSON module; raise a StackfuseError subclass on the first problem."""
    return checked_module_json(text, settings)[0]


def checked_module_json(text: str | bytes, settings: Settings) -> tuple[WireSummary, str]:
    """Like :func:`check_module_json`, also returning the canonical text to hand to TVM."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    digest = hashlib.sha256(raw).hexdigest()
    doc = _parse(raw, settings)
    graph = _Graph(doc, settings)
    counts = graph.check()
    renamed = _rename_unsafe_vars(doc, graph)
    canonical = json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    summary = WireSummary(
        nodes=counts.nodes,
        functions=counts.functions,
        bindings=counts.bindings,
        constant_bytes=counts.constant_bytes,
        depth=counts.depth,
        sha256=digest,
        renamed=renamed,
    )
    return summary, canonical


def is_code_name(name: str) -> bool:
    """True when ``name`` may appear in generated code and exported symbols as it is."""
    return bool(_CODE_NAME.match(name)) and name not in RESERVED_CODE_NAMES


def check_tensor_shape(
    dims: list[int | None], settings: Settings, *, where: str, node: int | None = None
) -> None:
    """Refuse a tensor shape past the rank/dim/element limits; ``None`` is a symbolic dim.

    Python ints: the element count cannot overflow, however large the dims.
    """
    if len(dims) > settings.max_tensor_rank:
        _limit(f"{where} has rank {len(dims)}", "max_tensor_rank", settings, len(dims), node)
    elements = 1
    for d in dims:
        if d is None:
            continue
        if d < 0:
            raise InputError(f"{where} has a negative dimension {d}", node=node, actual=d)
        if d > settings.max_dim:
            _limit(f"{where} has a dimension of {d}", "max_dim", settings, d, node)
        elements *= d
    if elements > settings.max_tensor_elements:
        _limit(f"{where} has {elements} elements", "max_tensor_elements", settings, elements, node)


def show(name: object, limit: int = 60) -> str:
    """A client-chosen string made safe to put in a message: escaped, quoted and truncated."""
    text = name if isinstance(name, str) else str(name)
    shown = text[:limit].encode("unicode_escape").decode("ascii").replace("'", "\\'")
    return f"'{shown}'" + ("..." if len(text) > limit else "")


# --- parsing ---------------------------------------------------------------------------------

#: A JSON string (escapes included): what the shape scan blanks before it counts anything.
#: Possessive (``*+``): a plain ``*`` around the escape group makes the regex engine keep a
#: backtracking frame per escape, ~100 bytes each (1.5 GB for a 60 MiB body of ``\n``s).
_STRINGS = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)
#: Brackets kept (objects and arrays alike as ``[``/``]``), everything else deleted.
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
#: Digits become ``0``, everything else a space: a long number is then a run of ``0``.
_DIGITS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
#: Longest run of digits a number may have: int64 needs 19 (larger ones TVM cannot hold, and
#: ``int()`` of a long literal is quadratic, refused past 4300 digits with a ValueError).
MAX_NUMBER_DIGITS = 19
#: Bracket-pair deletion passes the depth scan tries before it sums the rest (see below).
_PAIR_PASSES = 8


@dataclass(frozen=True)
class JsonShape:
    """What :func:`check_json_shape` measured: values (objects, arrays, strings, numbers,
    literals; an upper bound, exact for valid JSON) and bracket nesting."""

    values: int
    depth: int


def check_json_shape(
    raw: bytes | bytearray,
    *,
    max_depth: int,
    max_values: int,
    what: str = "JSON",
    depth_setting: str | None = None,
    values_setting: str | None = None,
    number_error: type[StackfuseError] = InputError,
) -> JsonShape:
    """Bound a JSON document before anything parses it, in time linear in its size.

    Python's parser recurses per bracket (RecursionError past ~1000), builds ~40-60 bytes of
    objects per value and converts long integers in quadratic time, so the document is measured
    first: strings are blanked (one regex substitution), then values are counted from commas
    and openers, digit runs bounded and bracket depth measured, each a C-level pass over the
    bytes. Depth: up to ``_PAIR_PASSES`` deletions of every innermost pair settle shallow
    documents (real TVM JSON nests 5 deep); what is left is summed as +1/-1 with ``accumulate``
    (C iterators; its length is bounded by ``max_values``, checked first). For invalid JSON the
    depth may be overstated; the parser then names the real error. Refusals are
    :class:`LimitExceeded` (naming ``*_setting`` when given), ``number_error``, or
    :class:`MalformedJSON` for far more closing than opening brackets.
    """
    skeleton = _STRINGS.sub(b"0", raw)  # a string is one value; ``0`` keeps the count
    values = skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{") + 1
    if values > max_values:
        _shape_limit(
            f"{what} has more than {max_values} values", values_setting, max_values, values
        )
    if b"0" * (MAX_NUMBER_DIGITS + 1) in skeleton.translate(_DIGITS):
        raise number_error(
            f"{what} holds a number of more than {MAX_NUMBER_DIGITS} digits "
            "(out of the int64 range)"
        )
    brackets = skeleton.translate(_BRACKETS, _NOT_BRACKETS)
    del skeleton
    if len(brackets) > 2 * max_values:  # more closers than the openers counted as values
        raise MalformedJSON(f"{what} is not valid JSON: its brackets do not balance")
    depth = 0
    while brackets and depth < _PAIR_PASSES:
        reduced = brackets.replace(b"[]", b"")
        if len(reduced) == len(brackets):
            break
        brackets = reduced
        depth += 1
    if brackets:  # the deepest prefix of what the passes left (exact for valid JSON)
        rest = brackets.translate(bytes.maketrans(b"[]", b"\x02\x00"))
        depth += max(map(operator.sub, itertools.accumulate(rest), itertools.count(1)))
    if depth > max_depth:
        _shape_limit(f"{what} nests {depth} deep", depth_setting, max_depth, depth)
    return JsonShape(values=values, depth=depth)


def _shape_limit(what: str, setting: str | None, limit: int, actual: int) -> NoReturn:
    detail: dict[str, Any] = {"limit": limit, "actual": actual}
    if setting is None:
        raise LimitExceeded(f"{what}; the limit is {limit}", **detail)
    raise LimitExceeded(
        f"{what}; the limit is {limit} (setting {setting})", setting=setting, **detail
    )


def _parse(raw: bytes, settings: Settings) -> Any:
    check_json_shape(
        raw,
        max_depth=settings.max_json_depth,
        max_values=settings.max_json_values,
        what="the module",
        depth_setting="max_json_depth",
        values_setting="max_json_values",
    )
    try:  # UTF-8 only: json.loads of bytes would also take UTF-16 and UTF-32
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedJSON(f"body is not UTF-8 (byte {exc.start})", position=exc.start) from None
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as exc:
        raise MalformedJSON(
            f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            line=exc.lineno,
            column=exc.colno,
        ) from None
    except RecursionError:  # unreachable after the depth check; kept as a backstop
        raise LimitExceeded("JSON nesting too deep", setting="max_json_depth") from None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise MalformedJSON(f"duplicate key {show(key)} in a JSON object", key=key[:60])
            seen.add(key)
    return out


def _no_constant(name: str) -> NoReturn:
    raise MalformedJSON(f"{name} is not a JSON number; NaN and infinities are refused")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InputError(f"number {text[:40]} overflows a 64-bit float")
    return value


# --- the graph -------------------------------------------------------------------------------


@dataclass
class _Counts:
    nodes: int = 0
    functions: int = 0
    bindings: int = 0
    constant_bytes: int = 0
    depth: int = 0


_PRIMITIVE_TYPE_OF_NAME = {
    "int": "int",
    "float": "float",
    "bool": "bool",
    "str": "ffi.String",
    "dtype": "DataType",
    "None": "None",
}
_NON_OBJECT = frozenset({"None", "bool", "int", "float", "DataType"})


class _Graph:
    """One forward pass over ``nodes``: every reference points back, so children are known."""

    def __init__(self, doc: Any, settings: Settings) -> None:
        self.doc = doc
        self.settings = settings
        self.types: list[str] = []
        self.data: list[Any] = []
        self.depth: list[int] = []
        self.counts = _Counts()
        self._checked: set[tuple[int, int]] = set()
        #: (node, shape, dtype, bytes) of every constant seen
        self.constants: list[tuple[int, list[int], str, int]] = []

    # -- entry --------------------------------------------------------------------------------
    def check(self) -> _Counts:
        doc = self.doc
        if not isinstance(doc, dict):
            raise InputError("a TVM JSON module is a JSON object with 'root_index' and 'nodes'")
        if "attrs" in doc and "metadata" not in doc:
            raise InputError("legacy TVM JSON (before 0.20) is not accepted; save with this TVM")
        extra = set(doc) - _TOP_KEYS
        if extra:
            raise InputError(f"unexpected top-level key {show(sorted(extra)[0])}")
        nodes, root = doc.get("nodes"), doc.get("root_index")
        if not isinstance(nodes, list) or not nodes:
            raise InputError("'nodes' must be a non-empty array")
        if len(nodes) > self.settings.max_json_nodes:
            _limit(f"module has {len(nodes)} nodes", "max_json_nodes", self.settings, len(nodes))
        if type(root) is not int or not 0 <= root < len(nodes):
            raise InputError("'root_index' must be the index of a node", root_index=str(root)[:40])
        kinds = {
            n.get("type") for n in nodes if isinstance(n, dict) and isinstance(n.get("type"), str)
        }
        for kind in _FORBIDDEN_WHY:  # name the construct itself, not a part of it found first
            if kind in kinds:
                index = next(
                    i for i, n in enumerate(nodes) if isinstance(n, dict) and n.get("type") == kind
                )
                self._forbidden_type(index, kind)
        meta = doc.get("metadata", {})
        if not isinstance(meta, dict) or set(meta) - {"tvm_version"}:
            raise InputError("'metadata' may only hold 'tvm_version'")
        if not isinstance(meta.get("tvm_version", ""), str):
            raise InputError("'metadata.tvm_version' must be a string")
        for i, node in enumerate(nodes):
            try:
                self._node(i, node)
            except _ConstantsOverLimit:
                raise self._constants_too_large(nodes, i) from None
        if self.types[root] != "ir.IRModule":
            raise InputError(
                f"the root node is a {show(self.types[root])}, expected an ir.IRModule",
                node=root,
            )
        self.counts.nodes = len(nodes)
        self.counts.depth = max(self.depth)
        return self.counts

    # -- one node -----------------------------------------------------------------------------
    def _node(self, i: int, node: Any) -> None:
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise InputError(f"node {i} is not an object with a string 'type'", node=i)
        if not node.keys() <= _NODE_KEYS:
            raise InputError(f"node {i} has keys other than 'type' and 'data'", node=i)
        kind: str = node["type"]
        if kind not in ALLOWED_NODE_TYPES:
            self._forbidden_type(i, kind)
        data = node.get("data")
        refs = self._decode(i, kind, data)
        depth = 1
        for r in refs:
            depth = max(depth, self.depth[r] + 1)
        if depth > self.settings.max_ir_depth:
            _limit(
                f"node {i} ({kind}) is nested {depth} deep", "max_ir_depth", self.settings, depth, i
            )
        self.types.append(kind)
        self.data.append(data)
        self.depth.append(depth)
        self._semantics(i, kind, data)

    def _forbidden_type(self, i: int, kind: str) -> NoReturn:
        if kind == "tirx.PrimFunc":
            name = self._raw_function_name(i)
            raise ForbiddenConstruct(
                f"module contains a PrimFunc {show(name)}; Stackfuse accepts Relax functions only",
                node=i,
                node_type=kind,
                function=name[:80],
            )
        why = _FORBIDDEN_WHY.get(kind)
        if why is None and kind.startswith(("tirx.", "tir.", "s_tir.")):
            why = f"module contains TIR ({show(kind)}); Stackfuse accepts Relax functions only"
        if why is None:
            why = f"node type {show(kind)} is not accepted in a Stackfuse module"
        raise ForbiddenConstruct(why, node=i, node_type=kind[:80])

    def _raw_function_name(self, func: int) -> str:
        """Best effort, on unchecked nodes: the GlobalVar name a module map gives node ``func``."""
        nodes = self.doc["nodes"]

        def at(k: Any) -> Any:
            ok = type(k) is int and 0 <= k < len(nodes) and isinstance(nodes[k], dict)
            return nodes[k] if ok else {}

        for node in nodes:
            data = node.get("data") if isinstance(node, dict) else None
            if not (
                isinstance(node, dict) and node.get("type") == "ffi.Map" and isinstance(data, list)
            ):
                continue
            for key, value in zip(data[0::2], data[1::2], strict=False):
                gv = at(key)
                if value == func and gv.get("type") == "ir.GlobalVar":
                    name = at((gv.get("data") or {}).get("name_hint")).get("data")
                    if isinstance(name, str):
                        return name
        return "?"

    def _decode(self, i: int, kind: str, data: Any) -> list[int]:
        """Validate ``data`` for ``kind``; return the node indices it refers to."""
        if kind == "None":
            if data is not None:
                raise InputError(f"node {i} (None) carries data", node=i)
            return []
        if kind == "int":
            self._literal(i, kind, "int", data)
            return []
        if kind in ("float", "bool"):
            self._literal(i, kind, kind, data)
            return []
        if kind in ("ffi.String", "ir.SourceName", "ir.Op", "DataType"):
            self._string(i, kind, data)
            if kind == "DataType":
                self._dtype(i, kind, data)
            if kind == "ir.Op" and data not in ALLOWED_OPS:
                raise ForbiddenConstruct(
                    f"operator {show(data)} is not accepted: it is not one of the Relax "
                    "operators Stackfuse compiles",
                    node=i,
                    operator=data[:80],
                )
            return []
        if kind == "ffi.Tensor":
            self._tensor(i, data)
            return []
        if kind in ("ffi.Array", "ffi.Map"):
            if not isinstance(data, list):
                raise InputError(f"node {i} ({kind}) needs a list of node indices", node=i)
            for r in data:
                self._ref(i, r)
            if kind == "ffi.Map":
                self._map(i, data)
            return data
        return self._object(i, kind, data)

    def _object(self, i: int, kind: str, data: Any) -> list[int]:
        if not isinstance(data, dict):
            raise InputError(f"node {i} ({kind}) needs an object of fields", node=i)
        specs, known = _field_specs(kind)
        for name in data:
            if name not in known:
                raise InputError(f"node {i} ({kind}) has no field {show(name)}", node=i)
        refs: list[int] = []
        for spec in specs:
            name = spec.name
            if name not in data:
                if spec.has_default:
                    continue
                raise InputError(f"node {i} ({kind}) lacks field '{name}'", node=i, field=name)
            value = data[name]
            if spec.encoding != "ref":
                self._literal(i, f"{kind}.{name}", spec.encoding, value)
                continue
            self._ref(i, value)
            self._expect(i, kind, spec, value)
            refs.append(value)
            if self.types[value] == "ffi.String":
                self._string_field(i, kind, name, self.data[value])
        return refs

    def _string_field(self, i: int, kind: str, name: str, value: str) -> None:
        if kind in ATTRS_TYPES and not _ATTR_STRING.match(value):
            raise InputError(
                f"node {i} ({kind}): attribute '{name}' holds {show(value)}; operator "
                "attributes may only hold short words (letters, digits, underscores)",
                node=i,
                field=name,
            )
        if kind == "ir.GlobalVar" and not is_code_name(value):
            raise InputError(
                f"function name {show(value)} is not accepted: use a letter followed by up to "
                "63 letters, digits or underscores (not a C/CUDA keyword)",
                node=i,
            )

    # -- values -------------------------------------------------------------------------------
    def _literal(self, i: int, what: str, encoding: str, value: Any) -> None:
        ok = {
            "int": type(value) is int,
            "bool": type(value) is bool,
            "float": type(value) in (int, float),
            "none": value is None,
            "dtype": isinstance(value, str),
        }.get(encoding, False)
        if not ok:
            raise InputError(f"node {i}: {what} must be a JSON {encoding}", node=i)
        if type(value) is int and not _INT64[0] <= value <= _INT64[1]:
            raise InputError(f"node {i}: {what} is out of the int64 range", node=i)
        if encoding == "dtype":
            self._dtype(i, what, value)

    def _dtype(self, i: int, what: str, value: str) -> None:
        if value not in DTYPES:
            raise InputError(f"node {i}: {what} has unsupported dtype {show(value)}", node=i)

    def _string(self, i: int, kind: str, value: Any) -> None:
        if not isinstance(value, str):
            raise InputError(f"node {i} ({kind}) needs a string", node=i)
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > self.settings.max_string_bytes:
            _limit(
                f"string in node {i} is {size} bytes", "max_string_bytes", self.settings, size, i
            )
        if "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            raise InputError(f"string in node {i} holds a NUL or an unpaired surrogate", node=i)

    def _ref(self, i: int, r: Any) -> None:
        if type(r) is not int or not 0 <= r < i:
            raise InputError(
                f"node {i} refers to {str(r)[:20]}: a reference must be the index of an "
                "earlier node",
                node=i,
            )

    def _map(self, i: int, data: list[int]) -> None:
        if len(data) % 2:
            raise InputError(f"node {i} (ffi.Map) has an odd number of entries", node=i)
        seen: set[object] = set()
        for k in data[0::2]:
            key: object = self.data[k] if self.types[k] == "ffi.String" else ("node", k)
            if key in seen:
                raise InputError(f"node {i} (ffi.Map) repeats the key {show(key)}", node=i)
            seen.add(key)

    # -- field types --------------------------------------------------------------------------
    def _expect(self, i: int, kind: str, spec: _FieldSpec, r: int) -> None:
        have = self.types[r]
        if spec.accepts is not None:
            ok = have in spec.accepts
        else:
            ok = (have == "None" and spec.nullable) or self._matches_any(r, spec.union)
        if not ok:
            raise InputError(
                f"node {i} ({kind}): field '{spec.name}' must be {spec.declared}, "
                f"but node {r} is a {have}",
                node=i,
                field=spec.name,
            )

    def _matches_any(self, r: int, union: tuple[tuple[Any, ...], ...]) -> bool:
        return any(self._matches(r, t) for t in union)

    def _matches(self, r: int, t: tuple[Any, ...]) -> bool:
        kind = self.types[r]
        head = t[0]
        if head in ("PrimVar", "ShapeVar"):
            want = "ir.PrimType" if head == "PrimVar" else "relax.ShapeType"
            vars_ok = ("ir.Var",) if head == "PrimVar" else _VAR_TYPES
            return kind in vars_ok and self.types[self.data[r]["ty"]] == want
        if head in ("Array", "Map"):
            if kind != f"ffi.{head}":
                return False
            key = (r, id(t))  # unions are interned by _parse_type's cache
            if key not in self._checked:
                items: list[int] = self.data[r]
                if head == "Array":
                    ok = all(self._matches_any(x, t[1]) for x in items)
                else:
                    ok = all(self._matches_any(x, t[1]) for x in items[0::2]) and all(
                        self._matches_any(x, t[2]) for x in items[1::2]
                    )
                if not ok:
                    return False
                self._checked.add(key)
            return True
        return _simple_match(kind, head)

    # -- meaning ------------------------------------------------------------------------------
    def _semantics(self, i: int, kind: str, data: Any) -> None:
        s = self.settings
        if kind == "relax.expr.Function":
            self.counts.functions += 1
            if self.counts.functions > s.max_functions:
                _limit(
                    "module has too many functions", "max_functions", s, self.counts.functions, i
                )
        elif kind in ("relax.expr.VarBinding", "relax.expr.MatchCast"):
            self.counts.bindings += 1
            if self.counts.bindings > s.max_bindings:
                _limit("module has too many bindings", "max_bindings", s, self.counts.bindings, i)
        elif kind == "relax.expr.ShapeExpr":
            dims = [self._static_int(v) for v in self.data[data["values"]]]
            check_tensor_shape(dims, s, where=f"shape in node {i}", node=i)
        elif kind in ("relax.TensorType", "relax.ShapeType"):
            ndim = data["ndim"]
            if not -1 <= ndim <= s.max_tensor_rank:
                if ndim < -1:
                    raise InputError(f"node {i} ({kind}) has ndim {ndim}", node=i)
                _limit(f"{kind} in node {i} has rank {ndim}", "max_tensor_rank", s, ndim, i)
            shape = data.get("shape") if kind == "relax.TensorType" else data.get("values")
            n = None
            if shape is not None and self.types[shape] == "relax.expr.ShapeExpr":
                n = len(self.data[self.data[shape]["values"]])
            elif shape is not None and self.types[shape] == "ffi.Array":
                n = len(self.data[shape])
            if n is not None and n != ndim:
                raise InputError(
                    f"node {i} ({kind}) declares ndim {ndim} but its shape has {n} dims",
                    node=i,
                )
        elif kind == "ir.Call":
            self._call_attrs(i, data)
        elif kind == "ir.IRModule":
            self._function_table(i, data)
        elif kind == "ir.TupleGetItem" and data["index"] < 0:
            raise InputError(f"node {i} (ir.TupleGetItem) has a negative index", node=i)
        elif kind == "relax.attrs.ScanopAttrs":
            self._scan_attrs(i, data)

    def _scan_attrs(self, i: int, data: dict[str, Any]) -> None:
        """A scan's axis within any tensor's rank and its result dtype one TVM builds. The
        axis against the input's own rank and the input's dtype: worker.ingest.check_ir."""
        axis = data["axis"]
        rank = self.settings.max_tensor_rank
        if self.types[axis] == "int" and not -rank <= self.data[axis] < rank:
            raise InputError(
                f"node {i} (relax.attrs.ScanopAttrs): axis {self.data[axis]} is out of range "
                f"for a tensor of at most {rank} dims (setting max_tensor_rank)",
                node=i,
                field="axis",
            )
        dtype = data["dtype"]
        if self.types[dtype] == "DataType" and self.data[dtype] not in SCAN_DTYPES:
            raise ForbiddenConstruct(
                f"node {i} (relax.attrs.ScanopAttrs): a scan (cumsum, cumprod) with result dtype "
                f"{show(self.data[dtype])} is not accepted: TVM does not build it for every "
                f"target; use one of {', '.join(sorted(SCAN_DTYPES))}",
                node=i,
                field="dtype",
            )

    def _call_attrs(self, i: int, data: dict[str, Any]) -> None:
        """TVM's type inference casts a call's attrs to the operator's attrs type unchecked."""
        op = data["op"]
        want = wire_schema.OP_ATTRS[self.data[op]] if self.types[op] == "ir.Op" else None
        have = self.types[data["attrs"]]
        if (want or "None") != have:
            raise InputError(
                f"node {i} (ir.Call): a call of {show(self.data[op] if want else 'a function')} "
                f"needs attrs {want or 'None'}, not {have}",
                node=i,
            )

    def _function_table(self, i: int, data: dict[str, Any]) -> None:
        """``functions`` and ``global_var_map_`` must name the same functions the same way."""
        functions = self.data[data["functions"]][0::2]
        by_name = self.data[data["global_var_map_"]]
        names = {self.data[k]: v for k, v in zip(by_name[0::2], by_name[1::2], strict=True)}
        gv_name = {gv: self.data[self.data[gv]["name_hint"]] for gv in functions}
        if sorted(names.values()) != sorted(gv_name) or any(
            gv_name[gv] != name for name, gv in names.items()
        ):
            raise InputError(f"node {i} (ir.IRModule): its function tables disagree", node=i)

    def _constants_too_large(self, nodes: list[Any], at: int) -> LimitExceeded:
        """The max_constant_bytes 413, naming the module's largest constants: each one's
        shape, dtype, bytes and the variable bound to the expression that uses it.

        Node ``at`` took the total over the limit; the nodes after it are read loosely (the
        headers of their tensors, the references of the rest), without decoding a payload,
        so the answer covers the whole module and costs one more pass over its JSON."""
        for i in range(at + 1, len(nodes)):
            node = nodes[i]
            if isinstance(node, dict) and node.get("type") == "ffi.Tensor":
                info = _tensor_header(node.get("data"), self.settings.max_tensor_rank)
                if info is not None:
                    self.constants.append((i, *info))
        total = sum(c[3] for c in self.constants)
        largest = _describe_constants(nodes, self.constants, LARGEST_CONSTANTS)
        named = "; ".join(constant_text(c) for c in largest)
        limit = self.settings.max_constant_bytes
        return LimitExceeded(
            f"constants exceed the size limit: {total} bytes in {len(self.constants)} "
            f"constant(s); the limit is {limit} (setting max_constant_bytes); largest: {named}. "
            "Make weights function parameters (stackfuse import keeps them out of the JSON) or "
            "shrink these",
            setting="max_constant_bytes",
            limit=limit,
            actual=total,
            node=at,
            largest_constants=largest,
        )

    def _static_int(self, r: int) -> int | None:
        if self.types[r] != "ir.IntImm":
            return None
        value: int = self.data[self.data[r]["value"]]
        return value

    def _tensor(self, i: int, data: Any) -> None:
        """A constant: base64 of TVM's tensor blob. Check the header against the payload size
        without decoding the payload, so a lying header cannot make TVM allocate."""
        if not isinstance(data, str) or not _B64.fullmatch(data) or len(data) % 4:
            raise InputError(f"node {i} (ffi.Tensor) is not base64", node=i)
        size = len(data) // 4 * 3 - (len(data) - len(data.rstrip("=")))
        head = data[: 4 * ((_TENSOR_HEADER + 8 * self.settings.max_tensor_rank + 2) // 3 + 1)]
        try:
            blob = base64.b64decode(head[: len(head) - len(head) % 4], validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"node {i} (ffi.Tensor) is not base64", node=i) from None
        if len(blob) < _TENSOR_HEADER:
            raise InputError(f"node {i} (ffi.Tensor) is truncated", node=i)
        magic, _reserved, dev_type, _dev_id, ndim, code, bits, lanes = struct.unpack_from(
            "<QQiiiBBH", blob
        )
        if magic != _TENSOR_MAGIC or dev_type != _KDL_CPU or lanes != 1:
            raise InputError(f"node {i} (ffi.Tensor) has a bad header", node=i)
        dtype = _DL_CODES.get((code, bits))
        if dtype is None:
            raise InputError(
                f"node {i} (ffi.Tensor) has unsupported dtype code {code}/{bits}", node=i
            )
        if not 0 <= ndim <= self.settings.max_tensor_rank:
            if ndim < 0:
                raise InputError(f"node {i} (ffi.Tensor) has ndim {ndim}", node=i)
            _limit(
                f"constant in node {i} has rank {ndim}", "max_tensor_rank", self.settings, ndim, i
            )
        end = _TENSOR_HEADER + 8 * ndim + 8
        if len(blob) < end and size >= end:
            raise InputError(f"node {i} (ffi.Tensor) header could not be read", node=i)
        if size < end:
            raise InputError(f"node {i} (ffi.Tensor) is truncated", node=i)
        dims = list(struct.unpack_from(f"<{ndim}q", blob, _TENSOR_HEADER))
        (nbytes,) = struct.unpack_from("<q", blob, _TENSOR_HEADER + 8 * ndim)
        check_tensor_shape(list(dims), self.settings, where=f"constant in node {i}", node=i)
        expected = math.prod(dims) * ((bits + 7) // 8)
        if nbytes != expected or size != end + nbytes:
            raise InputError(
                f"node {i} (ffi.Tensor) declares {nbytes} data bytes; its shape and dtype need "
                f"{expected} and the payload holds {size - end}",
                node=i,
            )
        self.counts.constant_bytes += nbytes
        self.constants.append((i, dims, dtype, nbytes))
        if self.counts.constant_bytes > self.settings.max_constant_bytes:
            raise _ConstantsOverLimit


#: how many constants the max_constant_bytes 413 names
LARGEST_CONSTANTS = 5
#: the highest rank :func:`largest_constants` reads a tensor header at (it has no settings)
_READ_RANK = 64


def _size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


class _ConstantsOverLimit(Exception):
    """Raised inside the node pass when the constants' total passes max_constant_bytes."""


def _tensor_header(data: Any, max_rank: int) -> tuple[list[int], str, int] | None:
    """(shape, dtype, data bytes) from a tensor blob's header, or None if it cannot be read."""
    if not isinstance(data, str):
        return None
    head = data[: 4 * ((_TENSOR_HEADER + 8 * max_rank + 2) // 3 + 1)]
    try:
        blob = base64.b64decode(head[: len(head) - len(head) % 4], validate=True)
        ndim, code, bits = struct.unpack_from("<iBB", blob, 24)
        if not 0 <= ndim <= max_rank:
            return None
        dims = list(struct.unpack_from(f"<{ndim}q", blob, _TENSOR_HEADER))
        (nbytes,) = struct.unpack_from("<q", blob, _TENSOR_HEADER + 8 * ndim)
    except (binascii.Error, ValueError, struct.error):
        return None
    return dims, _DL_CODES.get((code, bits), f"code{code}/{bits}"), int(nbytes)


def _loose_refs(node: Any, n: int) -> list[int]:
    """The node indices ``node`` refers to, read without trusting it (for naming only)."""
    if not isinstance(node, dict):
        return []
    kind, data = node.get("type"), node.get("data")
    if isinstance(data, list) and kind in ("ffi.Array", "ffi.Map"):
        refs = data
    elif isinstance(data, dict) and isinstance(kind, str):
        refs = [data.get(f) for f in _ref_fields(kind)]
    else:
        return []
    return [r for r in refs if type(r) is int and 0 <= r < n]


def largest_constants(text: str | bytes, n: int = LARGEST_CONSTANTS) -> list[dict[str, Any]]:
    """The ``n`` largest constants of a TVM JSON module, largest first, each as ``{"name",
    "op", "shape", "dtype", "bytes"}`` (``name``: the variable bound to the expression using
    it; ``op``: the operator it is an argument of). Read from the JSON alone (tensor headers,
    no payload decoded, no TVM), for a module too large to send: ``[]`` if it is not TVM JSON.
    """
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, list):
        return []
    found = []
    for i, node in enumerate(nodes):
        if isinstance(node, dict) and node.get("type") == "ffi.Tensor":
            info = _tensor_header(node.get("data"), _READ_RANK)
            if info is not None:
                found.append((i, *info))
    return _describe_constants(nodes, found, n)


def constant_text(c: dict[str, Any]) -> str:
    """One entry of :func:`largest_constants` for a message."""
    used = f" used by {c['op']}" if c.get("op") else ""
    name = f" in {show(c['name'])}" if c.get("name") else ""
    return f"{c['shape']} {c['dtype']} ({_size_text(c['bytes'])}){used}{name}"


def _describe_constants(
    nodes: list[Any], found: list[tuple[int, list[int], str, int]], n: int
) -> list[dict[str, Any]]:
    parents: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for r in _loose_refs(node, len(nodes)):
            parents.setdefault(r, i)
    out: list[dict[str, Any]] = []
    for i, dims, dtype, nbytes in sorted(found, key=lambda c: -c[3])[:n]:
        name, op = _user_of(nodes, parents, i)
        out.append({"name": name, "op": op, "shape": dims, "dtype": dtype, "bytes": nbytes})
    return out


def _user_of(nodes: list[Any], parents: dict[int, int], i: int) -> tuple[str, str]:
    """(the variable bound to the expression holding node ``i``, the operator of the first
    call above it); "" where there is none."""

    def field(node: Any, key: str) -> Any:
        data = node.get("data") if isinstance(node, dict) else None
        ref = data.get(key) if isinstance(data, dict) else None
        return nodes[ref] if type(ref) is int and 0 <= ref < len(nodes) else None

    def text(node: Any) -> str:
        value = node.get("data") if isinstance(node, dict) else None
        return value[:64] if isinstance(value, str) else ""

    op = ""
    seen: set[int] = set()
    while i in parents and i not in seen:
        seen.add(i)
        i = parents[i]
        kind = nodes[i].get("type")
        if kind == "ir.Call" and not op:
            op = text(field(nodes[i], "op"))
        if kind in ("relax.expr.VarBinding", "relax.expr.MatchCast"):
            return text(field(field(nodes[i], "var"), "name")), op
    return "", op


def _rename_unsafe_vars(doc: dict[str, Any], graph: _Graph) -> int:
    """Give every variable whose name is not a code name a fresh one (``v<node>``).

    Works on the checked graph: a new string node is put before each such variable and every
    reference is renumbered, so references still point backward; the old names, now referenced
    by nothing, are blanked. Returns how many variables were renamed.
    """
    nodes: list[Any] = doc["nodes"]
    unsafe = {
        i
        for i, kind in enumerate(graph.types)
        if kind in _VAR_TYPES and not is_code_name(graph.data[graph.data[i]["name"]])
    }
    if not unsafe:
        return 0
    old_names = {graph.data[i]["name"] for i in unsafe}
    new_index: list[int] = []
    out: list[Any] = []
    for i, node in enumerate(nodes):
        kind = graph.types[i]
        if i in unsafe:
            out.append({"type": "ffi.String", "data": f"v{i}"})
        if kind in ("ffi.Array", "ffi.Map"):
            node = {"type": kind, "data": [new_index[r] for r in node["data"]]}
        elif _ref_fields(kind) and isinstance(node.get("data"), dict):
            data = dict(node["data"])
            for field in _ref_fields(kind):
                if field in data:
                    data[field] = new_index[data[field]]
            if i in unsafe:
                data["name"] = len(out) - 1
            node = {"type": kind, "data": data}
        out.append(node)
        new_index.append(len(out) - 1)
    still_used = {r for node in out for r in _node_refs(node)}
    for old in old_names:
        if new_index[old] not in still_used:
            out[new_index[old]] = {"type": "ffi.String", "data": ""}
    doc["nodes"] = out
    doc["root_index"] = new_index[doc["root_index"]]
    return len(unsafe)


@functools.cache
def _ref_fields(kind: str) -> tuple[str, ...]:
    fields = wire_schema.NODE_TYPES.get(kind, ((), ()))[1]
    return tuple(f[0] for f in fields if f[1] == "ref")


def _node_refs(node: dict[str, Any]) -> list[int]:
    """The node indices a checked node refers to."""
    kind, data = node["type"], node.get("data")
    if isinstance(data, list):
        return list(data) if kind in ("ffi.Array", "ffi.Map") else []
    if isinstance(data, dict):
        return [data[f] for f in _ref_fields(kind) if f in data]
    return []


_B64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
#: magic u64, reserved u64, device (i32 type, i32 id), ndim i32, dtype (u8 code, u8 bits, u16 lanes)
_TENSOR_HEADER = 32


def _limit(
    what: str, setting: str, settings: Settings, actual: int, node: int | None = None
) -> NoReturn:
    limit = getattr(settings, setting)
    detail: dict[str, Any] = {"setting": setting, "limit": limit, "actual": actual}
    if node is not None:
        detail["node"] = node
    raise LimitExceeded(f"{what}; the limit is {limit} (setting {setting})", **detail)


class _FieldSpec(NamedTuple):
    name: str
    encoding: str  # "ref", or the JSON literal kind TVM writes inline
    declared: str  # the field's type, narrowed where NARROWED_FIELDS says
    union: tuple[tuple[Any, ...], ...]
    nullable: bool
    has_default: bool
    #: the node types a reference may point to, when the type needs no look inside the node
    accepts: frozenset[str] | None


@functools.cache
def _field_specs(kind: str) -> tuple[tuple[_FieldSpec, ...], frozenset[str]]:
    specs = []
    for name, encoding, declared, has_default in wire_schema.NODE_TYPES[kind][1]:
        declared = NARROWED_FIELDS.get((kind, name), declared)
        union = _parse_type(declared)
        nullable = (kind, name) in NULLABLE_FIELDS or ("*", name) in NULLABLE_FIELDS
        accepts = None
        if all(t[0] not in ("Array", "Map", "PrimVar", "ShapeVar") for t in union):
            accepts = frozenset(
                k
                for k in ALLOWED_NODE_TYPES
                if any(_simple_match(k, t[0]) for t in union) or (k == "None" and nullable)
            )
        specs.append(_FieldSpec(name, encoding, declared, union, nullable, has_default, accepts))
    return tuple(specs), frozenset(spec.name for spec in specs)


def _simple_match(kind: str, head: str) -> bool:
    if head == "Any":
        return True
    if head == "Object":
        return kind not in _NON_OBJECT
    if head in _PRIMITIVE_TYPE_OF_NAME:
        return kind == _PRIMITIVE_TYPE_OF_NAME[head]
    return kind == head or head in _ancestors(kind)


@functools.cache
def _ancestors(kind: str) -> frozenset[str]:
    return (
        frozenset(wire_schema.NODE_TYPES[kind][0])
        if kind in wire_schema.NODE_TYPES
        else (frozenset())
    )


@functools.cache
def _parse_type(text: str) -> tuple[tuple[Any, ...], ...]:
    """``"Array[ir.Expr] | None"`` -> ``(("Array", (("ir.Expr",),)), ("None",))``.

    The strings come from :mod:`service.wire_schema` (TVM's reflection), never from a client.
    """
    union, rest = _parse_union(text.replace(" ", ""))
    if rest:
        raise ValueError(f"bad type string {text!r}")
    return union


def _parse_union(s: str) -> tuple[tuple[tuple[Any, ...], ...], str]:
    alternatives: list[tuple[Any, ...]] = []
    while True:
        m = re.match(r"[A-Za-z_][\w.]*", s)
        if m is None:
            raise ValueError(f"bad type string at {s!r}")
        head, s = m.group(), s[m.end() :]
        if s.startswith("["):
            args: list[tuple[tuple[Any, ...], ...]] = []
            s = s[1:]
            while True:
                arg, s = _parse_union(s)
                args.append(arg)
                if s.startswith(","):
                    s = s[1:]
                    continue
                if not s.startswith("]"):
                    raise ValueError(f"bad type string at {s!r}")
                s = s[1:]
                break
            alternatives.append((head, *args))
        else:
            alternatives.append((head,))
        if s.startswith("|"):
            s = s[1:]
            continue
        return tuple(alternatives), s
