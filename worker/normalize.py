"""Graph normalization before partitioning, so that exported forms reach the patterns.

Importers (PyTorch's ``torch.export``, ONNX) do not emit ``qkv -> split -> reshape ->
attention``; they emit transposes around scaled-dot-product attention, keep attention
decomposed, pass causal masks as constant tensors and project q, k and v with three matmuls.
Each rewrite here undoes one such habit, is local, keeps the function's meaning, and is reported
as a :class:`~worker.report.Rewrite`:

- ``decomposed_attention``: ``softmax(scale * q @ kT + mask) @ v`` -> ``R.nn.attention`` (scale
  constants found on the scores, on q or on k, cast or not; additive masks become the bias),
  on 4-D ``[B, N, S, H]`` matmuls or on batch-merged 3-D ones (``[B*N, S, H]``, upstream TVM's
  rewrite form: the heads are recovered from the reshapes that merged them, else each batch
  entry is one head), also with 3-D scores and a softmax on their 4-D view (Bloom: ALiBi
  ``[B*N, 1, S]`` becomes a ``[B, N, 1, S]`` bias, its causal mask ``causal_mask``);
- ``sliding_window``: ``window_size`` (with a causal mask) becomes an additive mask computed in
  the graph: TVM cannot legalize a window, and only the Hopper kernel reads one. On sm_90 the
  window is left for partition, which gives it to the Hopper kernel where that takes the site and
  hands the rest back to :func:`windows_as_masks` (this rewrite, with the reason);
- ``var_len``: ``attention_var_len`` on packed tokens ``[1, T, N, H]`` that the ragged kernel
  (the SM80-class one, reading ``seqstart``) refuses becomes one attention with a
  block-diagonal mask computed from ``seqstart``: TVM cannot legalize it. The report gives the
  kernel's reason. Calls the kernel takes stay; ``ragged_operands`` repeats their grouped K/V
  heads up to the query heads and casts integer seqstart tensors to int32 for it (it reads
  equal head counts and int32 offsets only);
- ``constant_mask``: a constant additive bias that is causal (or attends everywhere) becomes
  ``causal_mask`` (or no bias): the kernel masks without reading a tensor;
- ``transpose_pairs``: ``permute_dims`` chains compose; identities vanish; a transpose is moved
  below a split or slice, and a batch-merged transpose (reshape -> 3-D transpose -> reshape) is
  seen as the 4-D transpose it is, so that pairs meet and cancel;
- ``unit_axes``: a split of an unsqueezed tensor becomes a split of the tensor, each piece
  reshaped; a transpose that moves only the extent-1 axes such a reshape added becomes a
  reshape. GPTBigCode's multi-query ``[q | k | v]`` (``[B, 1, S, C]`` split, one K/V head
  transposed ``[B, 1, S, H] -> [B, S, 1, H]``) then reads ``split -> reshape -> attention``;
- ``empty_concat``: zero-width concat operands (partial rotary with no rotary dims) are dropped;
- ``rms_norm``: ``w * cast?(x * rsqrt(mean(x * x, -1) + eps))`` (Llama's RMSNorm, in float32
  between casts) becomes one ``R.nn.rms_norm``: TVM fused the chain into three kernels that
  wrote the float32 input and its square to memory;
- ``integer_power``: ``x ** 3`` (GPT-2's GELU) becomes multiplies: fast-math CUDA ``powf`` is
  NaN for negative x, which made whole GPT-2 libraries return NaN;
- ``grouped_kv``: K and V repeated up to the query heads (transformers' ``repeat_kv``:
  ``expand_dims -> broadcast_to -> reshape``, ``R.repeat``, or one head ``broadcast_to`` all
  of them) are read with their own head
  count: grouped-query attention, query head i on key/value head i // (Nq / Nkv), with no
  repeated copy. Only for sm_90 in float16/bfloat16, where the Hopper kernel reads GQA
  (elsewhere the repeated heads keep the site on the other kernels; TVM's fallback repeats them
  again at build time);
- ``combine_qkv``: three matmuls of one input feeding one attention (BERT's query/key/value)
  become one matmul on concatenated weights and a split: the stacked layout the fused kernel
  reads. (TVM's ``CombineParallelMatmul`` does not fire on exported graphs: their weights reach
  the matmul through a transpose, not as parameters.)
- ``combine_projections``: the same for q/k/v projections that reach the attention through
  other operators (rotary embeddings, repeated heads), when ``combine_qkv`` cannot take them:
  one GEMM on concatenated weights, each projection a column slice of it. Narrow K/V
  projections (GQA: 512 columns at 2048 tokens) fill under half of an H200's SMs alone.
- ``combine_gate_up``: SwiGLU's ``silu(x @ Wg^T) * (x @ Wu^T)`` (the SiLU possibly between casts
  to float32 and back) becomes one matmul on the weights interleaved in blocks of 8 rows
  (``Wgu[16j + i] = Wg[8j + i]``, ``Wgu[16j + 8 + i] = Wu[8j + i]``, computed from the weights
  alone, so lifted into ``main_transform_params``) and the exact Relax expression of the paired
  result: ``reshape(silu(y4[..., 0:1, :]) * y4[..., 1:2, :], [..., I])``, ``y4`` the product
  regrouped as ``[..., I/8, 2, 8]``. The GEMM partition takes that tail as one site whose
  epilogue pairs the columns in registers. Only for sm_90 in float16/bfloat16 (elsewhere the up
  projection's epilogue reads the gate projection's output: ``silu_gate``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.spec import CompileOptions
from worker.attention import MASKED
from worker.partition import ATTENTION_OPS as SITE_OPS
from worker.partition import (
    PartitionResult,
    band_width,
    partition,
    ragged_refusal,
    refused_windows,
    site_of,
)
from worker.report import Rewrite, Where
from worker.toolchain import import_tvm

import_tvm()

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm import ir, relax, tirx  # noqa: E402

#: the additive bias of a key outside a sliding window: finite in float16 (an all-masked row
#: stays a number) and far below any score, so exp() of it is 0 in float32
WINDOW_MASKED = -3.0e4
#: at most this many fixpoint rounds of the local rewrites
MAX_ROUNDS = 6
ATTENTION_OPS = ("relax.nn.attention", "relax.nn.attention_bias")


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def _op(expr: Any) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, ir.Op):
        return str(expr.op.name)
    return None


def _ints(values: Any) -> list[int] | None:
    out = []
    for v in values:
        while not isinstance(v, int) and hasattr(v, "value"):
            v = v.value
        if not isinstance(v, int):
            return None
        out.append(int(v))
    return out


def _shape(expr: Any) -> list[int] | None:
    ty = getattr(expr, "ty", None)
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return None
    return _ints(shape.values)


def _ndim(expr: Any) -> int:
    return int(getattr(expr.ty, "ndim", -1))


def _axes(call: relax.Call) -> list[int]:
    axes = call.attrs.axes
    n = _ndim(call.args[0])
    if axes is None:
        return list(range(n))[::-1]
    got = _ints(axes)
    assert got is not None
    return [a + n if a < 0 else a for a in got]


def _scalar(expr: Any) -> float | None:
    """A constant with one element, as a float."""
    if isinstance(expr, ir.expr.GenericConst):
        arr = expr.value.numpy()
        if arr.size == 1 and np.issubdtype(arr.dtype, np.floating):
            return float(arr.reshape(()))
    return None


def _dtype(expr: Any) -> str:
    return str(expr.ty.dtype).removeprefix("T.")


def _is_float(expr: Any) -> bool:
    return _dtype(expr) in ("float16", "bfloat16", "float32", "float64")


def _causal_patterns(sq: int, skv: int) -> dict[str, np.ndarray]:
    """Which keys each of ``sq`` queries sees among ``skv`` under each causal mode, in the
    order masks are matched: ``none``, ``TopLeft``, ``BottomRight``."""
    i, j = np.arange(sq)[:, None], np.arange(skv)[None, :]
    return {"none": np.ones((sq, skv), bool), "TopLeft": j <= i, "BottomRight": j <= i + (skv - sq)}


def _mask_pattern(arr: np.ndarray, sq: int, skv: int) -> np.ndarray | None:
    """The ``[sq, skv]`` keys an additive mask keeps (its values are 0, or at or below MASKED),
    the same for every batch entry and head; None for a real bias (other values) or a mask that
    differs between them."""
    keep = arr > MASKED
    if np.any(arr[keep] != 0.0):
        return None
    pattern = np.broadcast_to(keep, (*arr.shape[:-2], sq, skv)).reshape(-1, sq, skv)
    if not np.all(pattern == pattern[0]):
        return None
    return pattern[0]


TAG_PREFIX = "stackfuse.normalized."


def _tag_of(call: Any) -> str | None:
    span = getattr(call, "span", None)
    if span is None:
        return None
    name = str(span.source_name.name)
    return name[len(TAG_PREFIX) :] if name.startswith(TAG_PREFIX) else None


@dataclass
class _Log:
    """What fired, by rewrite name; per-site rewrites keep the attention binding they made."""

    counts: Counter[str] = field(default_factory=Counter)
    sites: list[tuple[str, str, str]] = field(default_factory=list)  # (rewrite, tag, message)
    widths: list[str] = field(default_factory=list)  # of each combine_projections group
    gate_up: list[str] = field(default_factory=list)  # "gate + up" weights, combine_gate_up

    def site(self, rewrite: str, tag: str, message: str) -> None:
        """A per-site rewrite fired: ``message`` for the attention binding ``tag`` names."""
        self.sites.append((rewrite, tag, message))
        self.counts[rewrite] += 1

    def tagged(self, call: relax.Call, source: Any = None) -> tuple[relax.Call, str]:
        """``call`` carrying a span that names it (the tag of ``source`` when it has one), so
        that the report can say which attention site a rewrite made, whatever passes follow."""
        tag = _tag_of(source) if source is not None else None
        if tag is None:
            tag = str(sum(1 for _ in self.sites))
        span = ir.Span(ir.SourceName(TAG_PREFIX + tag), 0, 0, 0, 0)
        return relax.Call(call.op, call.args, call.attrs, call.ty_args, span), tag


@dataclass
class _Scores:
    """The softmax's input as ``alpha * matmul + sum(coefficient * bias)``: each bias with the
    rank (3 or 4) of the scores it is added to; ``merges``: the (B, N) of each reshape between
    batch-merged 3-D and 4-D scores on the way to the matmul."""

    matmul: Any = None
    alpha: float = 1.0
    biases: list[tuple[Any, float, int]] = field(default_factory=list)
    merges: set[tuple[int, int]] = field(default_factory=set)


# --------------------------------------------------------------------------------------------
# local rewrites (one mutator, applied to a fixpoint)
# --------------------------------------------------------------------------------------------
#: of a window call: None to leave its window (a kernel may read it), else why it is written as
#: a mask (the end of the rewrite's message)
WindowPolicy = Callable[[relax.Call], str | None]


@dataclass(frozen=True)
class _Policy:
    """What the local rewrites may do: ``gqa`` (sm_90: read repeated K/V heads grouped),
    ``windows`` (which windows stay for a kernel), ``only_windows`` (rewrite nothing else)."""

    options: CompileOptions
    gqa: bool
    windows: WindowPolicy
    only_windows: bool = False


@relax.expr_functor.mutator
class _Local(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, log: _Log, policy: _Policy) -> None:
        super().__init__(mod)
        self.log = log
        self.options = policy.options
        self.combine = policy.options.fuse_stacked
        self.gqa = policy.gqa
        self.windows = policy.windows
        self.only_windows = policy.only_windows
        self.split_cache: dict[Any, Any] = {}
        self.select_splits: dict[tuple[Any, int], Any] = {}

    # value of a variable bound earlier in this function (None for parameters)
    def value(self, expr: Any) -> Any:
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            return bound if bound is not None else expr
        return expr

    def emit(self, expr: Any, name: str = "nf") -> Any:
        return self.builder_.emit(expr, name)

    def visit_call_(self, call: relax.Call) -> Any:
        call = super().visit_call_(call)
        op = _op(call)
        if self.only_windows:
            if op in ATTENTION_OPS and call.attrs.window_size is not None:
                return self.sliding_window(call)
            return call
        if op == "relax.permute_dims":
            return self.permute(call)
        if op == "relax.reshape":
            return self.merged_transpose(call)
        if op == "relax.concat":
            return self.concat(call)
        if op == "relax.strided_slice":
            return self.slice_below_permute(call)
        if op == "relax.matmul":
            return self.decomposed(call)
        if op == "relax.power":
            return self.integer_power(call)
        if op == "relax.multiply":
            out = self.rms_norm(call)
            if out is call:
                out = self.tanh_gelu(call)
            return self.silu(call) if out is call else out
        if op == "relax.nn.attention_var_len":
            return self.var_len(call)
        if _op(call) in ATTENTION_OPS and call.attrs.window_size is not None:
            call = self.sliding_window(call)
        if _op(call) == "relax.nn.attention_bias":
            call = self.constant_mask(call)
        if _op(call) in ATTENTION_OPS and self.gqa:
            call = self.grouped_kv(call)
        if _op(call) in ATTENTION_OPS and self.combine:
            return self.combine_qkv(call)
        return call

    def visit_tuple_getitem_(self, node: relax.TupleGetItem) -> Any:
        node = super().visit_tuple_getitem_(node)
        out = self.split_below_permute(node)
        return self.split_below_unsqueeze(node) if out is node else out

    # ---- transposes ---------------------------------------------------------------------
    def permute(self, call: relax.Call) -> Any:
        inner = self.value(call.args[0])
        if _op(inner) != "relax.permute_dims":
            if _axes(call) == list(range(_ndim(call))):
                self.log.counts["transpose_pairs"] += 1
                return call.args[0]
            return self.unit_permute(call, inner)
        p1, p2 = _axes(inner), _axes(call)
        composed = [p1[i] for i in p2]
        self.log.counts["transpose_pairs"] += 1
        if composed == list(range(len(composed))):
            return inner.args[0]
        return relax.op.permute_dims(inner.args[0], composed)

    def split_below_permute(self, node: relax.TupleGetItem) -> Any:
        """``split(permute(x, p), axis=a)[i]`` -> ``permute(split(x, axis=p[a])[i], p)``."""
        split = self.value(node.tuple_value)
        if _op(split) != "relax.split":
            return node
        src = self.value(split.args[0])
        if _op(src) != "relax.permute_dims":
            return node
        p = _axes(src)
        axis = int(split.attrs.axis)
        axis = axis + len(p) if axis < 0 else axis
        key = split
        if key not in self.split_cache:
            ios = split.attrs.indices_or_sections
            ios_v: Any = int(ios.value) if hasattr(ios, "value") else _ints(ios)
            if ios_v is None:
                return node
            self.split_cache[key] = self.emit(relax.op.split(src.args[0], ios_v, p[axis]))
        piece = self.emit(relax.TupleGetItem(self.split_cache[key], node.index))
        self.log.counts["transpose_pairs"] += 1
        return relax.op.permute_dims(piece, p)

    def split_below_unsqueeze(self, node: relax.TupleGetItem) -> Any:
        """``split(expand_dims(x, u), axis=a)[i]`` -> ``reshape(split(x, axis=a')[i], ...)``
        for ``a`` not an inserted axis: the piece is the same view of ``x``'s split, and the
        stacked patterns read ``split -> reshape``. GPTBigCode's multi-query ``c_attn`` output
        is unsqueezed to ``[B, 1, S, C]`` before q, k and v are split off."""
        split = self.value(node.tuple_value)
        if _op(split) != "relax.split":
            return node
        src = self.value(split.args[0])
        if _op(src) != "relax.expand_dims":
            return node
        n = _ndim(src)
        inserted = _ints(src.attrs.axis)
        shape = getattr(node.ty, "shape", None)
        if inserted is None or n < 0 or not isinstance(shape, relax.ShapeExpr):
            return node
        inserted = [a + n if a < 0 else a for a in inserted]
        axis = int(split.attrs.axis)
        axis = axis + n if axis < 0 else axis
        if axis in inserted:
            return node
        key = ("unsqueeze", split)
        if key not in self.split_cache:
            ios = split.attrs.indices_or_sections
            ios_v: Any = int(ios.value) if hasattr(ios, "value") else _ints(ios)
            if ios_v is None:
                return node
            new_axis = axis - sum(1 for a in inserted if a < axis)
            self.split_cache[key] = self.emit(relax.op.split(src.args[0], ios_v, new_axis))
        piece = self.emit(relax.TupleGetItem(self.split_cache[key], node.index))
        self.log.counts["unit_axes"] += 1
        return relax.op.reshape(piece, shape)

    def unit_permute(self, call: relax.Call, inner: Any) -> Any:
        """``permute_dims`` that moves only extent-1 axes of a piece of a split that a reshape
        gave extent-1 axes and nothing else -> ``reshape``: the same view, in the ``split ->
        reshape`` form the stacked patterns read (GPTBigCode's one K/V head, ``[B, 1, S, H]
        -> [B, S, 1, H]``, once :meth:`split_below_unsqueeze` has moved the unsqueeze)."""
        if _op(inner) != "relax.reshape":
            return call
        base = self.value(inner.args[0])
        if not isinstance(base, relax.TupleGetItem):
            return call
        if _op(self.value(base.tuple_value)) != "relax.split":
            return call
        shapes = [getattr(e.ty, "shape", None) for e in (inner.args[0], call.args[0], call)]
        if not all(isinstance(sh, relax.ShapeExpr) for sh in shapes):
            return call
        piece, src, _ = (list(sh.values) for sh in shapes)  # type: ignore[union-attr]

        def not_one(dims: list[Any]) -> list[Any]:
            return [d for d in dims if _ints([d]) != [1]]

        if not tvm_ffi.structural_equal(not_one(piece), not_one(src)):
            return call  # the reshape splits or merges axes: not a unit-axis view
        kept = [i for i in _axes(call) if _ints([src[i]]) != [1]]
        if kept != sorted(kept):
            return call
        self.log.counts["unit_axes"] += 1
        return relax.op.reshape(call.args[0], shapes[2])

    def slice_below_permute(self, call: relax.Call) -> Any:
        """``strided_slice(permute(x, p), axes)`` -> ``permute(strided_slice(x, p[axes]), p)``."""
        src = self.value(call.args[0])
        if _op(src) != "relax.permute_dims":
            return call
        p = _axes(src)
        axes = _ints(call.args[1].fields if hasattr(call.args[1], "fields") else call.args[1])
        if axes is None:
            return call
        n = len(p)
        new_axes = [p[a + n if a < 0 else a] for a in axes]
        strides = call.args[4] if len(call.args) > 4 else None
        sliced = self.emit(
            relax.op.strided_slice(
                src.args[0],
                new_axes,
                call.args[2],
                call.args[3],
                strides,
                assume_inbound=bool(call.attrs.assume_inbound),
            )
        )
        self.log.counts["transpose_pairs"] += 1
        return relax.op.permute_dims(sliced, p)

    def merged_transpose(self, call: relax.Call) -> Any:
        """``reshape(permute(reshape(x, [a*b, ...]), [0, ...]), [a, b, ...])`` is a 4-D permute."""
        out_shape = _shape(call)
        perm = self.value(call.args[0])
        if out_shape is None or _op(perm) != "relax.permute_dims":
            return call
        merged = self.value(perm.args[0])
        if _op(merged) != "relax.reshape":
            return call
        x = merged.args[0]
        xs, ms = _shape(x), _shape(merged)
        p = _axes(perm)
        if xs is None or ms is None or len(xs) != len(ms) + 1 or p[0] != 0:
            return call
        if ms != [xs[0] * xs[1], *xs[2:]]:
            return call
        full = [0, 1, *[q + 1 for q in p[1:]]]
        if [xs[i] for i in full] != out_shape:
            return call
        self.log.counts["transpose_pairs"] += 1
        return relax.op.permute_dims(x, full)

    # ---- empty concat operands -----------------------------------------------------------
    def concat(self, call: relax.Call) -> Any:
        parts = call.args[0]
        if not isinstance(parts, relax.Tuple):
            parts = self.value(parts)
            if not isinstance(parts, relax.Tuple):
                return call
        axis = int(call.attrs.axis) if call.attrs.axis is not None else 0
        keep = []
        for f in parts.fields:
            s = _shape(f)
            a = axis + len(s) if s is not None and axis < 0 else axis
            if s is not None and s[a] == 0:
                continue
            keep.append(f)
        if len(keep) == len(parts.fields) or not keep:
            return call
        self.log.counts["empty_concat"] += 1
        if len(keep) == 1:
            return keep[0]
        return relax.op.concat(keep, axis)

    # ---- x ** 3 (GPT-2's tanh GELU) -----------------------------------------------------
    def integer_power(self, call: relax.Call) -> Any:
        """``power(x, n)`` for a constant n in 2..4 -> multiplies.

        CUDA compiled with fast math computes ``powf(x, 3)`` as ``exp2(3 * log2(x))``: NaN for
        every negative x. GPT-2's GELU cubes its input, so the whole model returned NaN on an
        H200 until this rewrite (benchmarks/results/models_gpu.md).
        """
        n = _scalar(self.value(call.args[1]))
        if n is None or n not in (2.0, 3.0, 4.0):
            return call
        x = call.args[0]
        sq = self.emit(relax.op.multiply(x, x), "sq")
        self.log.counts["integer_power"] += 1
        if n == 2.0:
            return sq
        if n == 3.0:
            return relax.op.multiply(sq, x)
        return relax.op.multiply(sq, sq)

    # ---- GELU in its tanh form (GPT-2's gelu_new) ------------------------------------------
    def _times(self, expr: Any, const: float) -> Any:
        """``x`` when ``expr`` is ``x * c`` or ``c * x`` with c within 0.1% of ``const``."""
        val = self.value(expr)
        if _op(val) != "relax.multiply":
            return None
        for x, c in ((val.args[0], val.args[1]), (val.args[1], val.args[0])):
            got = _scalar(self.value(c))
            if got is not None and math.isclose(got, const, rel_tol=1e-3):
                return x
        return None

    def _plus_one(self, expr: Any) -> Any:
        val = self.value(expr)
        if _op(val) != "relax.add":
            return None
        for x, c in ((val.args[0], val.args[1]), (val.args[1], val.args[0])):
            if _scalar(self.value(c)) == 1.0:
                return self.value(x)
        return None

    def _is_cube(self, expr: Any, x: Any) -> bool:
        val = self.value(expr)
        if _op(val) != "relax.multiply":
            return False
        for sq, lin in ((val.args[0], val.args[1]), (val.args[1], val.args[0])):
            sq_val = self.value(sq)
            if (
                lin.same_as(x)
                and _op(sq_val) == "relax.multiply"
                and sq_val.args[0].same_as(x)
                and sq_val.args[1].same_as(x)
            ):
                return True
        return False

    def tanh_gelu(self, call: relax.Call) -> Any:
        """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` -> ``gelu_tanh(x)``: one
        operator a GEMM epilogue can fuse (CUTLASS's GELU_taylor is this formula)."""
        for half, rest in ((call.args[0], call.args[1]), (call.args[1], call.args[0])):
            x = self._times(half, 0.5)
            t = self._plus_one(rest)
            if x is None or t is None or _op(t) != "relax.tanh":
                continue
            u = self.value(self._times(t.args[0], math.sqrt(2.0 / math.pi)))
            if _op(u) != "relax.add":
                continue
            for lin, cubic in ((u.args[0], u.args[1]), (u.args[1], u.args[0])):
                c = self._times(cubic, 0.044715)
                if lin.same_as(x) and c is not None and self._is_cube(c, x):
                    self.log.counts["gelu_tanh"] += 1
                    return relax.op.nn.gelu_tanh(x)
        return call

    def silu(self, call: relax.Call) -> Any:
        """``x * sigmoid(x)`` (how torch.export writes SiLU) -> ``silu(x)``: the gate of SwiGLU
        then fuses into its GEMM's epilogue."""
        for x, s in ((call.args[0], call.args[1]), (call.args[1], call.args[0])):
            sig = self.value(s)
            if _op(sig) == "relax.sigmoid" and sig.args[0].same_as(x):
                self.log.counts["silu"] += 1
                return relax.op.nn.silu(x)
        return call

    # ---- decomposed attention ------------------------------------------------------------
    def const_scalar(self, expr: Any) -> float | None:
        """A one-element constant, also through ``astype`` (the float16 export casts a float32
        scale): the value as the cast leaves it."""
        val = self.value(expr)
        if _op(val) == "relax.astype":
            c = _scalar(self.value(val.args[0]))
            if c is None:
                return None
            return float(np.asarray(c, dtype="float32").astype(_dtype(val)))
        return _scalar(val)

    def strip_scale(self, expr: Any) -> tuple[Any, float]:
        """Peel ``x * c`` / ``x / c`` (c a scalar constant) off ``expr``: (x, product of c)."""
        scale = 1.0
        while True:
            val = self.value(expr)
            op = _op(val)
            if op in ("relax.multiply", "relax.divide"):
                a, b = val.args
                c = self.const_scalar(b)
                if c is None and op == "relax.multiply":
                    c = self.const_scalar(a)
                    a = b
                if c is None or c == 0.0:
                    return expr, scale
                scale *= c if op == "relax.multiply" else 1.0 / c
                expr = a
                continue
            return expr, scale

    def _uncast(self, expr: Any) -> Any:
        """``x`` for ``astype(x)``: the float16 exports run the softmax in float32 between
        casts, which is how the kernels compute it too."""
        val = self.value(expr)
        return val.args[0] if _op(val) == "relax.astype" else expr

    def _float_uncast(self, expr: Any) -> Any:
        """``x`` for ``astype(x)`` from one float dtype to another (Bloom's float16 export
        casts q and k to float32 for the scores): the kernels accumulate in float32."""
        val = self.value(expr)
        if _op(val) == "relax.astype" and _is_float(val) and _is_float(val.args[0]):
            return val.args[0]
        return expr

    def select_as_split(self, expr: Any) -> Any:
        """``take(x, i, axis)`` with a constant scalar ``i`` (Bloom picks q, k and v out of its
        ``[B, S, N, 3, H]`` view so) -> ``squeeze(split(x, n, axis)[i], axis)``, one split per
        ``x``: the per-head interleaved stacked layout the patterns read. ``expr`` otherwise."""
        val = self.value(expr)
        if _op(val) != "relax.take" or val.attrs.axis is None:
            return expr
        idx = self.value(val.args[1])
        xs = _shape(val.args[0])
        if not isinstance(idx, ir.expr.GenericConst) or idx.value.numpy().ndim != 0 or not xs:
            return expr
        axis = int(val.attrs.axis) % len(xs)
        i, n = int(idx.value.numpy()), xs[axis]
        if not 0 <= i < n:
            return expr
        key = (val.args[0], axis)
        if key not in self.select_splits:
            self.select_splits[key] = self.emit(relax.op.split(val.args[0], n, axis), "qkv_split")
        piece = self.emit(relax.TupleGetItem(self.select_splits[key], i), "qkv_part")
        return self.emit(relax.op.squeeze(piece, [axis]), "qkv_part")

    def unmerge(self, x3: Any, transposed: bool) -> tuple[Any, tuple[int, int], float] | None:
        """``x3`` ``[B*N, S, H]`` (``[B*N, H, S]`` when ``transposed``: k after its 3-D
        transpose) made by merging the heads of a 4-D tensor: (that tensor as ``[B, S, N, H]``,
        (B, N), the scale peeled on the way). None for any other form."""
        x, scale = self.strip_scale(x3)
        x, s_cast = self.strip_scale(self._float_uncast(x))  # float16 q, k cast to float32
        scale *= s_cast
        val = self.value(x)
        xs = _shape(x)
        if xs is None or len(xs) != 3:
            return None
        if transposed and _op(val) == "relax.permute_dims" and _axes(val) == [0, 2, 1]:
            got = self.unmerge(val.args[0], False)
            return None if got is None else (got[0], got[1], got[2] * scale)
        if _op(val) != "relax.reshape":
            return None
        src, s_src = self.strip_scale(val.args[0])
        sv = self.value(src)
        if _op(sv) == "relax.permute_dims":  # a scale folded into q or k before the transpose
            inner, s_in = self.strip_scale(sv.args[0])
            picked = self.select_as_split(inner)
            if s_in != 1.0 or picked is not inner:
                src = self.emit(relax.op.permute_dims(picked, _axes(sv)), "bnsh")
                s_src *= s_in
        ss = _shape(src)
        if ss is None or len(ss) != 4 or ss[0] * ss[1] != xs[0] or ss[2:] != xs[1:]:
            return None
        # src is [B, N, S, H] (or [B, N, H, S] for transposed k)
        perm = [0, 3, 1, 2] if transposed else [0, 2, 1, 3]
        bsnh = self.emit(relax.op.permute_dims(src, perm), "bsnh")
        return bsnh, (ss[0], ss[1]), scale * s_src

    def merged_operands(
        self, q3: Any, kt3: Any, v3: Any
    ) -> tuple[list[Any], tuple[int, int] | None, float] | None:
        """q, k, v as ``[B, S, N, H]`` for a batch-merged 3-D decomposition (upstream's rewrite
        form): with the heads recovered when all three merged the same (B, N), else each batch
        entry as one head (``[B*N, S, 1, H]``, which means the same). Returns (q, k, v), the
        (B, N) recovered (None: one head each) and the scale peeled."""
        qs, ks, vs = _shape(q3), _shape(kt3), _shape(v3)
        if qs is None or ks is None or vs is None:
            return None
        if not (qs[0] == ks[0] == vs[0] and qs[2] == ks[1] and ks[2] == vs[1]):
            return None
        got = [self.unmerge(q3, False), self.unmerge(kt3, True), self.unmerge(v3, False)]
        parts = [p for p in got if p is not None]
        if len(parts) == 3 and len({p[1] for p in parts}) == 1:
            scale = parts[0][2] * parts[1][2] * parts[2][2]
            if len({_dtype(p[0]) for p in parts}) != 1:
                return None  # a cast on some of q, k, v only
            return [p[0] for p in parts], parts[0][1], scale
        q, s_q = self.strip_scale(q3)
        kt, s_k = self.strip_scale(kt3)
        k = self.emit(relax.op.permute_dims(kt, [0, 2, 1]), "k")
        out = [
            self.emit(relax.op.reshape(x, [s[0], s[1], 1, s[2]]), "bsnh")
            for x, s in ((q, qs), (k, [ks[0], ks[2], ks[1]]), (v3, vs))
        ]
        if len({_dtype(x) for x in out}) != 1:
            return None
        return out, None, s_q * s_k

    def merged_scores_operands(
        self, q3: Any, kt3: Any, v4: Any
    ) -> tuple[list[Any], tuple[int, int], float] | None:
        """q, k, v as ``[B, S, N, H]`` when q and k are batch-merged 3-D (their heads recovered,
        the same (B, N)) and v is 4-D ``[B, N, S_kv, H]``: the scores are computed 3-D and the
        probabilities meet v 4-D. Returns (q, k, v), (B, N) and the scale peeled."""
        q, k = self.unmerge(q3, False), self.unmerge(kt3, True)
        vs = _shape(v4)
        if q is None or k is None or vs is None or q[1] != k[1] or tuple(vs[:2]) != q[1]:
            return None
        vv = self.value(v4)
        if _op(vv) == "relax.permute_dims":  # v picked out of the interleaved view: a split
            picked = self.select_as_split(vv.args[0])
            if picked is not vv.args[0]:
                v4 = self.emit(relax.op.permute_dims(picked, _axes(vv)), "bnsh")
        vb = self.emit(relax.op.permute_dims(v4, [0, 2, 1, 3]), "bsnh")
        if len({_dtype(q[0]), _dtype(k[0]), _dtype(vb)}) != 1:
            return None
        return [q[0], k[0], vb], q[1], q[2] * k[2]

    def merged_mask(self, mask: Any, bn: int, heads: tuple[int, int] | None) -> Any:
        """A 3-D (or lower) mask on the merged scores as the 4-D bias of the attention, or
        None when its batch dim is neither 1 nor B*N."""
        ms = _shape(mask)
        if ms is None or len(ms) > 3:
            return None
        ms = [1] * (3 - len(ms)) + ms
        src = self.value(mask)
        if heads is not None and _op(src) == "relax.reshape":
            ss = _shape(src.args[0])
            if ss is not None and len(ss) == 4 and ss[:2] == list(heads) and ss[2:] == ms[1:]:
                return src.args[0]  # upstream reshapes a [B, N, S, S_kv] bias to [B*N, ...]
        if ms[0] == 1:
            return self.emit(relax.op.reshape(mask, [1, 1, ms[1], ms[2]]), "bias")
        if ms[0] != bn:
            return None
        lead = list(heads) if heads is not None else [bn, 1]
        return self.emit(relax.op.reshape(mask, [*lead, ms[1], ms[2]]), "bias")

    @staticmethod
    def _merged_pair(a: list[int] | None, b: list[int] | None) -> tuple[int, int] | None:
        """(B, N) when ``a`` and ``b`` are the batch-merged ``[B*N, S, S_kv]`` and the 4-D
        ``[B, N, S, S_kv]`` forms of one scores tensor, either way round; else None."""
        if a is None or b is None:
            return None
        if len(a) == 4 and len(b) == 3:
            a, b = b, a
        if len(a) == 3 and len(b) == 4 and b[0] * b[1] == a[0] and b[2:] == a[1:]:
            return b[0], b[1]
        return None

    def score_terms(self, expr: Any) -> _Scores | None:
        """The softmax's input as ``alpha * (q @ kT) + sum(c_i * bias_i)``, through float
        casts, scalar scales (``softmax(c * (s + m))`` is ``softmax(c s + c m)``), adds, and the
        reshapes that merge or split batch and heads on the way to the matmul (Bloom adds ALiBi
        to 3-D scores and the causal mask to their 4-D view). None unless exactly one matmul
        is found."""
        out = _Scores()
        # (expression, coefficient, rank of the scores it is added to (None at the softmax),
        # the batch/head reshapes passed from the softmax to here)
        todo: list[tuple[Any, float, int | None, frozenset[tuple[int, int]]]] = [
            (expr, 1.0, None, frozenset())
        ]
        while todo:
            e, coef, rank, path = todo.pop()
            before: tuple[Any, float] | None = None  # a bias is taken above its reshapes
            while True:
                e = self._float_uncast(e)
                e, c = self.strip_scale(e)
                coef *= c
                val = self.value(e)
                if _op(val) == "relax.astype" and _is_float(val) and _is_float(val.args[0]):
                    continue
                pair = (
                    self._merged_pair(_shape(val.args[0]), _shape(val))
                    if _op(val) == "relax.reshape"
                    else None
                )
                if pair is None:
                    break
                before = before or (e, coef)
                path = path | {pair}
                e = val.args[0]
            op = _op(val)
            if op == "relax.add":
                todo += [(a, coef, _ndim(val), path) for a in val.args]
            elif op == "relax.matmul":
                if out.matmul is not None:
                    return None
                out.matmul, out.alpha, out.merges = val, coef, set(path)
            elif rank is not None:
                e, coef = before or (e, coef)
                out.biases.append((e, coef, rank))
            else:
                return None
        return out if out.matmul is not None else None

    def const_value(self, expr: Any, depth: int = 0) -> np.ndarray | None:
        """The value of ``expr`` when it is computed from constants alone by ``where``, casts
        and views (the folded causal mask of a float16 export: ``where(c, 0, -65504)``)."""
        val = self.value(expr)
        if isinstance(val, ir.expr.GenericConst):
            return np.asarray(val.value.numpy())
        op = _op(val)
        if op is None or depth > 8:
            return None
        if op == "relax.where":
            c, a, b = (self.const_value(x, depth + 1) for x in val.args)
            if c is None or a is None or b is None:
                return None
            return np.asarray(np.where(c, a, b))
        if op not in ("relax.astype", "relax.reshape", "relax.expand_dims", "relax.broadcast_to"):
            return None
        x = self.const_value(val.args[0], depth + 1)
        shape = _shape(val)
        if x is None or shape is None:
            return None
        if op == "relax.astype":
            return x.astype(_dtype(val))
        return np.broadcast_to(x, shape) if op == "relax.broadcast_to" else x.reshape(shape)

    def mask_mode(self, expr: Any, coef: float, sq: int, skv: int) -> str | None:
        """``none`` (keeps every key), ``TopLeft`` or ``BottomRight`` when ``coef * expr`` is a
        constant mask of that kind, the same for every batch entry and head; else None."""
        arr = self.const_value(expr)
        if (
            arr is None
            or arr.ndim < 2
            or coef <= 0.0
            or arr.shape[-2:] not in ((sq, skv), (1, skv))
        ):
            return None
        arr = arr.astype(np.float32) * np.float32(coef)  # masked as the scores get it
        keep = _mask_pattern(arr, sq, skv)
        if keep is None:
            return None
        for mode, want in _causal_patterns(sq, skv).items():
            if np.array_equal(keep, want):
                return mode
        return None

    def scores_bias(
        self,
        terms: _Scores,
        bn: int,
        heads: tuple[int, int] | None,
        want: list[int] | None,
        dtype: str,
    ) -> tuple[Any, str, list[str]] | None:
        """The attention's bias (None: no bias), its causal mode and the words for each term:
        each bias as the 4-D ``[B|1, N|1, S|1, S_kv]`` the attention takes, times its
        coefficient, summed. Beside another bias, a constant causal (or all-true) mask becomes
        the causal mode (or nothing): Bloom's ALiBi ``[B*N, 1, S]`` plus its causal mask is a
        ``[B, N, 1, S]`` bias read with ``causal_mask``. One mask alone is left to
        ``constant_mask``. None when a bias does not broadcast to the scores."""
        causal = "none"
        parts: list[tuple[Any, float]] = []
        words: list[str] = []
        for e, coef, rank in terms.biases:
            if len(terms.biases) > 1 and want is not None:
                mode = self.mask_mode(e, coef, want[2], want[3])
                if mode is not None and (mode == "none" or causal in ("none", mode)):
                    if mode != "none":
                        causal = mode
                    words.append(f"constant {mode} mask" if mode != "none" else "zero mask")
                    continue
            if rank == 3:
                e = self.merged_mask(e, bn, heads)
                if e is None:
                    return None
            elif _ndim(e) > 4:
                return None
            while _ndim(e) < 4:
                e = self.emit(relax.op.expand_dims(e, 0))
            shape = _shape(e)
            if want is not None and shape is not None:
                if any(d not in (1, w) for d, w in zip(shape, want, strict=True)):
                    return None
                if shape[3] != want[3]:
                    return None
            parts.append((e, coef))
        bias = None
        for e, coef in parts:
            if _dtype(e) != dtype:
                e = self.emit(relax.op.astype(e, dtype))
            if coef != 1.0:
                e = self.emit(relax.op.multiply(e, relax.const(coef, dtype)), "bias")
            shape = _shape(e)
            per_head = (
                shape is not None and want is not None and shape[1] == want[1] > 1 and shape[2] == 1
            )
            what = f"{shape if shape is not None else '?'} bias" + (
                " (one row per head: ALiBi's form)" if per_head else ""
            )
            words.append(what + (f" x {coef:.6g}" if coef != 1.0 else ""))
            bias = e if bias is None else self.emit(relax.op.add(bias, e), "bias")
        return bias, causal, words

    def decomposed(self, call: relax.Call) -> Any:
        """``matmul(softmax(scale * q @ kT [+ biases]), v)`` -> attention: 4-D ``[B, N, S,
        H]``, or 3-D with batch and heads merged (``[B*N, S, H]``, upstream TVM's rewrite form,
        heads recovered from the reshapes that merged them). The softmax may run on a 4-D view
        of 3-D scores (Bloom: ``baddbmm`` of ALiBi and the scaled scores, viewed 4-D for the
        causal mask, softmax, viewed 3-D again for the matmul)."""
        probs = self.value(call.args[0])
        v = call.args[1]
        safe = False
        rank = _ndim(call)
        merged_back = rank == 3 and _op(probs) == "relax.reshape"  # 4-D probabilities, 3-D
        if merged_back and self._merged_pair(_shape(probs.args[0]), _shape(probs)) is not None:
            probs = self.value(probs.args[0])
        if _op(probs) == "relax.astype":
            probs = self.value(probs.args[0])
        if _op(probs) == "relax.where":  # where(isnan(p), 0, p): PyTorch's safe softmax
            cond, zero, p = (self.value(a) for a in probs.args)
            if _op(cond) == "relax.isnan" and _scalar(zero) == 0.0:
                inner = self.value(cond.args[0])
                if _op(inner) == "relax.nn.softmax" and self.value(probs.args[2]).same_as(inner):
                    probs, safe = inner, True
            _ = p
        if _op(probs) == "relax.astype":
            probs = self.value(probs.args[0])
        if _op(probs) != "relax.nn.softmax" or rank not in (3, 4):
            return call
        srank = _ndim(probs)
        if int(probs.attrs.axis) % srank != srank - 1:
            return call
        terms = self.score_terms(probs.args[0])
        if terms is None:
            return call
        mm = terms.matmul
        mm_rank = _ndim(mm.args[0])
        if _ndim(mm.args[1]) != mm_rank or _ndim(v) != rank or mm_rank not in (3, 4):
            return call
        heads: tuple[int, int] | None = None
        merged_heads: tuple[int, int] | None
        if rank == 4 and mm_rank == 3:  # 3-D scores, 4-D probabilities (Bloom's ONNX export)
            split = self.merged_scores_operands(mm.args[0], mm.args[1], v)
            if split is None or terms.merges != {split[1]}:
                return call
            (qb, kb, vb), merged_heads, s_in = split
            bn = merged_heads[0] * merged_heads[1]
        elif rank == 4:
            q, s_q = self.strip_scale(mm.args[0])
            kt, s_k = self.strip_scale(mm.args[1])
            qs, kts, vs = _shape(q), _shape(kt), _shape(v)
            if qs is None or kts is None or vs is None:
                return call
            if not (qs[3] == kts[2] and kts[3] == vs[2] and qs[0] == vs[0] == kts[0]):
                return call
            # one K/V head broadcast by the matmuls themselves is multi-query attention
            if not (kts[1] == vs[1] and kts[1] in (qs[1], 1)):
                return call
            if not terms.merges <= {(qs[0], qs[1])}:
                return call
            to_bsnh = [0, 2, 1, 3]
            qb = self.emit(relax.op.permute_dims(q, to_bsnh))
            kb = self.emit(relax.op.permute_dims(kt, [0, 3, 1, 2]))
            vb = self.emit(relax.op.permute_dims(v, to_bsnh))
            if kts[1] != qs[1]:  # repeated explicitly: grouped_kv reads it back where it pays
                kb = self.emit(relax.op.repeat(kb, qs[1], axis=2), "k")
                vb = self.emit(relax.op.repeat(vb, qs[1], axis=2), "v")
            s_in = s_q * s_k
            bn, merged_heads = qs[0] * qs[1], (qs[0], qs[1])
        elif mm_rank == 3:
            merged = self.merged_operands(mm.args[0], mm.args[1], v)
            if merged is None:
                return call
            (qb, kb, vb), heads, s_in = merged
            if terms.merges and (heads is None or terms.merges != {heads}):
                return call
            bn, merged_heads = (_shape(mm.args[0]) or [0])[0], heads
        else:
            return call
        dtype = _dtype(qb)
        qbs, kbs = _shape(qb), _shape(kb)
        want = None if qbs is None or kbs is None else [qbs[0], qbs[2], qbs[1], kbs[1]]
        got = self.scores_bias(terms, bn, merged_heads, want, dtype)
        if got is None:
            return call
        mask, causal, words = got
        scale = terms.alpha * s_in
        call_att, tag = self.log.tagged(
            relax.op.nn.attention(
                qb,
                kb,
                vb,
                mask,
                tirx.FloatImm("float32", scale),
                causal_mask=None if causal == "none" else causal,
            )
        )
        att = self.emit(call_att, "attn")
        form = "4-D" if rank == 4 else "batch-merged 3-D"
        if rank == 3:
            form += f" (batch {heads[0]}, {heads[1]} heads)" if heads else " (one head per entry)"
        elif mm_rank == 3 and merged_heads is not None:
            form += f", batch-merged 3-D scores (batch {merged_heads[0]}, {merged_heads[1]} heads),"
        if srank != rank:
            form += f", softmax on its {srank}-D view,"
        if len(terms.biases) == 1 and mask is not None:
            biased = "mask -> "
        elif terms.biases:
            biased = f"{len(terms.biases)} biases ({'; '.join(words)}) -> "
        else:
            biased = ""
        self.log.site(
            "decomposed_attention",
            tag,
            f"{form} matmul -> scale {scale:.6g} -> "
            + biased
            + ("softmax (NaN-safe) -> " if safe else "softmax -> ")
            + "matmul recovered as one attention"
            + (f" with causal_mask={causal}" if causal != "none" else ""),
        )
        if rank == 4:
            out4 = relax.op.permute_dims(att, [0, 2, 1, 3])
            return out4 if _dtype(call) == dtype else relax.op.astype(self.emit(out4), _dtype(call))
        out = _shape(call)
        assert out is not None
        if heads is not None:
            att = self.emit(relax.op.permute_dims(att, [0, 2, 1, 3]), "bnsh")
        res = relax.op.reshape(att, out)
        return res if _dtype(call) == dtype else relax.op.astype(self.emit(res), _dtype(call))

    # ---- RMSNorm ------------------------------------------------------------------------
    def _rms_parts(self, y: Any) -> tuple[Any, float] | None:
        """``x * rsqrt(mean(x * x, axis=-1, keepdims) + eps)`` -> (x, eps)."""
        y = self.value(y)
        if _op(y) != "relax.multiply":
            return None
        for x, r in (y.args, y.args[::-1]):
            rv = self.value(r)
            if _op(rv) != "relax.rsqrt":
                continue
            s = self.value(rv.args[0])
            if _op(s) != "relax.add":
                continue
            for mean, eps_expr in (s.args, s.args[::-1]):
                eps = _scalar(eps_expr)
                mv = self.value(mean)
                if eps is None or _op(mv) != "relax.mean" or not mv.attrs.keepdims:
                    continue
                axes = _ints(mv.attrs.axis) if mv.attrs.axis is not None else None
                if axes is None or [a % _ndim(x) for a in axes] != [_ndim(x) - 1]:
                    continue
                sq = self.value(mv.args[0])
                if _op(sq) == "relax.multiply" and all(a.same_as(x) for a in sq.args):
                    return x, eps
        return None

    def rms_norm(self, call: relax.Call) -> Any:
        for w, y in (call.args, call.args[::-1]):
            ws, out = _shape(w), _shape(call)
            if ws is None or len(ws) != 1 or out is None or ws[0] != out[-1]:
                continue
            yv = self.value(y)
            if _op(yv) == "relax.astype":
                yv = yv.args[0]
            parts = self._rms_parts(yv)
            if parts is None:
                continue
            x, eps = parts
            src = self.value(x)
            if (
                _op(src) == "relax.astype"
                and _dtype(src.args[0]) == _dtype(call) == _dtype(w)
                and _dtype(x) == "float32"
            ):
                # TVM's rms_norm computes in float32 whatever its input: the cast fuses away
                x = src.args[0]
            dtype = _dtype(x)
            if _dtype(w) != dtype:
                w = self.emit(relax.op.astype(w, dtype), "rms_w")
            norm = self.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=eps), "rms_norm")
            self.log.counts["rms_norm"] += 1
            if _dtype(call) != dtype:
                return relax.op.astype(norm, _dtype(call))
            return norm
        return call

    # ---- repeated K/V -> grouped-query attention ---------------------------------------
    def unrepeat(self, expr: Any) -> tuple[Any, int] | None:
        """``expr`` ``[B, S, N, H]`` built by repeating each of Nkv heads N / Nkv times ->
        (the un-repeated ``[B, S, Nkv, H]``, Nkv); None for any other form. Heads repeat in
        blocks (head i is i // r), as ``repeat_kv`` and ``R.repeat`` do."""
        out = _shape(expr)
        if out is None or len(out) != 4:
            return None
        x = self.value(expr)
        heads_axis = 2  # of [B, S, N, H]; 1 below a permute to [B, N, S, H]
        permuted = False
        if _op(x) == "relax.permute_dims" and _axes(x) == [0, 2, 1, 3]:
            x, heads_axis, permuted = self.value(x.args[0]), 1, True
        base = None
        if _op(x) == "relax.repeat":
            axis = int(x.attrs.axis) if x.attrs.axis is not None else None
            if axis is not None and axis % 4 == heads_axis:
                base = x.args[0]
        elif _op(x) == "relax.broadcast_to":  # one K/V head broadcast to all (MQA)
            src, xs = _shape(x.args[0]), _shape(x)
            if (
                src is not None
                and xs is not None
                and len(src) == 4
                and src[heads_axis] == 1
                and [d for i, d in enumerate(src) if i != heads_axis]
                == [d for i, d in enumerate(xs) if i != heads_axis]
            ):
                base = x.args[0]
        elif _op(x) == "relax.reshape":
            b = self.value(x.args[0])
            e = self.value(b.args[0]) if _op(b) == "relax.broadcast_to" else None
            merged_axes = ([heads_axis + 1], [heads_axis + 1 - 5])
            if (
                e is not None
                and _op(e) == "relax.expand_dims"
                and _ints(e.attrs.axis) in merged_axes
            ):
                src, bs = _shape(e.args[0]), _shape(b)
                # [.., Nkv, 1, ..] broadcast to [.., Nkv, r, ..] and merged back to N heads
                if (
                    src is not None
                    and bs is not None
                    and len(bs) == 5
                    and bs[: heads_axis + 1] == src[: heads_axis + 1]
                    and bs[heads_axis + 2 :] == src[heads_axis + 1 :]
                ):
                    base = e.args[0]
        if base is None:
            return None
        src = _shape(base)
        if src is None or len(src) != 4:
            return None
        nkv = src[heads_axis]
        n = out[2]
        if nkv >= n or n % nkv:
            return None
        if permuted:
            base = self.emit(relax.op.permute_dims(base, [0, 2, 1, 3]), "kv")
        return base, nkv

    def grouped_kv(self, call: relax.Call) -> Any:
        if _dtype(call.args[0]) not in ("float16", "bfloat16"):
            return call
        if _op(call) == "relax.nn.attention_bias":
            return call  # the Hopper kernel takes no bias: repeated heads keep the SM80 kernel
        k, v = self.unrepeat(call.args[1]), self.unrepeat(call.args[2])
        if k is None or v is None or k[1] != v[1]:
            return call
        nq = (_shape(call.args[0]) or [0, 0, 0])[2]
        out = relax.Call(
            call.op, [call.args[0], k[0], v[0], *call.args[3:]], call.attrs, call.ty_args, call.span
        )
        att, tag = self.log.tagged(out, call)
        self.log.site(
            "grouped_kv",
            tag,
            f"K and V repeated from {k[1]} to {nq} heads are read as {k[1]} heads "
            "(grouped-query attention): no repeated copy",
        )
        return att

    # ---- separate q/k/v projections -> one stacked projection ---------------------------
    def projection(self, expr: Any) -> tuple[Any, Any, Any, list[int], Any] | None:
        """``reshape(cast?(matmul(x, w)) [+ b], [B, S, N, H])`` -> (x, w, b, [B, S, N, H],
        the matmul call). ``cast`` is the float32-accumulate-then-cast a float16 export emits."""
        r = self.value(expr)
        if _op(r) != "relax.reshape":
            return None
        out = _shape(r)
        y = self.value(r.args[0])
        bias = None
        if _op(y) == "relax.add":
            a, b = y.args
            if _ndim(b) == 1 and _ndim(a) > 1:
                y, bias = self.value(a), b
            elif _ndim(a) == 1 and _ndim(b) > 1:
                y, bias = self.value(b), a
            else:
                return None
        if _op(y) == "relax.astype":
            y = self.value(y.args[0])
        if _op(y) != "relax.matmul" or out is None or len(out) != 4:
            return None
        x, w = y.args
        if _ndim(w) != 2 or _ndim(x) not in (2, 3):
            return None
        return x, w, bias, out, y

    def combine_qkv(self, call: relax.Call) -> Any:
        """q, k, v each ``reshape(x @ w_i + b_i)`` of one ``x``: concat the weights, one matmul,
        one split on the feature axis of ``[B, S, 3C]``: the stacked layout the kernel reads."""
        projs = [self.projection(a) for a in call.args[:3]]
        if any(p is None for p in projs):
            return call
        xs = [p[0] for p in projs]  # type: ignore[index]
        if not (xs[0].same_as(xs[1]) and xs[0].same_as(xs[2])):
            return call
        if len({id(p[1]) for p in projs}) != 3:  # type: ignore[index]
            return call
        has_bias = [p[2] is not None for p in projs]  # type: ignore[index]
        if any(has_bias) and not all(has_bias):
            return call
        b, s = projs[0][3][0], projs[0][3][1]  # type: ignore[index]
        widths = [_shape(p[1])[1] for p in projs]  # type: ignore[index]
        xshape = _shape(xs[0])
        dtypes = {_dtype(p[1]) for p in projs} | {_dtype(xs[0])}  # type: ignore[index]
        if xshape is None or len(dtypes) != 1:
            return call
        if int(np.prod(xshape[:-1])) != b * s:
            return call
        for p, w in zip(projs, widths, strict=True):
            if p[3][:2] != [b, s] or p[3][2] * p[3][3] != w:  # type: ignore[index]
                return call
        x = xs[0]
        mm = projs[0][4]  # type: ignore[index]
        weight = self.emit(relax.op.concat([p[1] for p in projs], axis=1), "qkv_w")  # type: ignore[index]
        y = self.emit(relax.op.matmul(x, weight, out_dtype=mm.attrs.out_dtype), "qkv_mm")
        if _dtype(y) != _dtype(xs[0]):
            y = self.emit(relax.op.astype(y, _dtype(xs[0])), "qkv_mm")
        if all(has_bias):
            bias = self.emit(relax.op.concat([p[2] for p in projs], axis=0), "qkv_b")  # type: ignore[index]
            y = self.emit(relax.op.add(y, bias), "qkv_mm")
        qkv = self.emit(relax.op.reshape(y, [b, s, sum(widths)]), "qkv")
        parts = self.emit(
            relax.op.split(qkv, [widths[0], widths[0] + widths[1]], axis=2), "qkv_split"
        )
        new = [
            self.emit(relax.op.reshape(relax.TupleGetItem(parts, i), p[3]), "qkv_" + "qkv"[i])  # type: ignore[index]
            for i, p in enumerate(projs)
        ]
        out = relax.Call(call.op, [*new, *call.args[3:]], call.attrs, call.ty_args, call.span)
        att, tag = self.log.tagged(out, call)
        self.log.site(
            "combine_qkv",
            tag,
            "separate q/k/v projections of one input combined into one matmul + split "
            f"({'+'.join(map(str, widths))} columns): the stacked layout",
        )
        return att

    def all_heads(self, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        """k and v repeated up to q's heads when they have fewer (GQA/MQA): a masked attention
        runs on the SM80-class kernel, which reads equal head counts only (the Hopper kernel,
        which reads grouped heads, takes no bias)."""
        nq, nkv = (_ints(x.ty.shape.values[2:3]) for x in (q, k))
        if nq is None or nkv is None or nq == nkv or nkv[0] == 0 or nq[0] % nkv[0]:
            return k, v
        r = nq[0] // nkv[0]
        return (
            self.emit(relax.op.repeat(k, r, axis=2), "k"),
            self.emit(relax.op.repeat(v, r, axis=2), "v"),
        )

    # ---- sliding windows -> an explicit mask ---------------------------------------------
    def sliding_window(self, call: relax.Call) -> Any:
        """``attention(..., causal_mask=C, window_size=W)`` -> ``attention_bias`` with the window
        as an additive mask computed in the graph (``arange``, compare, ``where``: no constant,
        symbolic lengths work) and the causal mask kept, unless ``self.windows`` leaves the
        window (for the Hopper kernel, which reads it). TVM cannot legalize a window
        ("Legalization for sliding-window attention is not supported yet"); the masked form
        builds on every path and the SM80-class kernel takes it.
        Key j is seen from query i when ``i + off - W < j <= i + off``, ``off`` 0 (TopLeft) or
        ``S_kv - S`` (BottomRight): flash-attention's left window of ``W - 1`` keys, as upstream
        TVM's CUTLASS offload passes it. No causal mode: left for partition to refuse."""
        attrs = call.attrs
        causal = str(attrs.causal_mask) if attrs.causal_mask is not None else "none"
        w = int(attrs.window_size.value)
        if causal not in ("TopLeft", "BottomRight") or w < 1:
            return call
        why = self.windows(call)
        if why is None:
            return call
        q, k = call.args[0], call.args[1]
        qs, ks = q.ty.shape, k.ty.shape
        if not isinstance(qs, relax.ShapeExpr) or not isinstance(ks, relax.ShapeExpr):
            return call
        s, skv = qs.values[1], ks.values[1]
        dtype = _dtype(call)
        rows = self.emit(relax.op.arange(0, s, 1, "int32"), "rows")
        # j - off for j = 0 .. S_kv - 1
        start, end = (s - skv, s) if causal == "BottomRight" else (0, skv)
        cols = self.emit(relax.op.arange(start, end, 1, "int32"), "cols")
        dist = self.emit(
            relax.op.subtract(relax.op.expand_dims(cols, [0]), relax.op.expand_dims(rows, [1])),
            "dist",
        )
        inside = self.emit(relax.op.greater(dist, relax.const(-w, "int32")), "in_window")
        mask = self.emit(
            relax.op.where(inside, relax.const(0.0, dtype), relax.const(WINDOW_MASKED, dtype)),
            "window_mask",
        )
        mask = self.emit(relax.op.expand_dims(mask, [0, 1]), "window_mask")
        bias = call.args[3] if len(call.args) > 3 else None
        if bias is not None:
            mask = self.emit(relax.op.add(bias, mask), "window_bias")
        k_, v_ = self.all_heads(q, k, call.args[2])
        att, tag = self.log.tagged(
            relax.op.nn.attention(q, k_, v_, mask, attrs.scale, causal_mask=causal), call
        )
        self.log.site(
            "sliding_window",
            tag,
            f"window_size={w} ({causal}) written as an additive mask computed in the graph, "
            f"the causal mask kept: TVM cannot legalize a window, and {why}",
        )
        return att

    # ---- ragged batches: the ragged kernel, else one masked attention ---------------------
    def var_len(self, call: relax.Call) -> Any:
        """``attention_var_len(q, k, v, seqstart_q, seqstart_k, max_seqlen_q, max_seqlen_k)``
        on packed tokens ``[1, T, N, H]``. TVM cannot legalize it. Kept for the SM80-class
        kernel, which reads seqstart, wherever :func:`worker.partition.ragged_refusal` finds
        nothing against it, with grouped K/V heads repeated up to the query heads and integer
        seqstart tensors cast to int32 (that kernel reads equal head counts and int32 offsets
        only). Elsewhere (a window, a layout or dtype the kernel
        refuses, nothing offloaded: the validation reference) ``attention_bias`` over all T
        tokens with a block-diagonal mask computed in the graph (token t is in sequence
        ``#{b : seqstart[b] <= t}``), the causal mask and the window kept inside each block:
        exact, at T x T work and a T x T mask in memory; only where q and k share one
        ``seqstart`` (each sequence its own keys)."""
        q, k, v, start_q, start_k = call.args[:5]
        attrs = call.attrs
        qs = q.ty.shape
        if not isinstance(qs, relax.ShapeExpr) or len(qs.values) != 4:
            return call
        k_, v_ = self.all_heads(q, k, v)
        done = []
        if k_ is not k:  # all_heads repeats static head counts only
            nkv, nq = (int(x.ty.shape.values[2].value) for x in (k, q))
            done.append(f"K and V repeated from {nkv} to {nq} heads")
        starts = {}
        for s_ in (start_q, start_k):
            dt = _dtype(s_) if isinstance(s_.ty, relax.TensorType) else ""
            if dt.startswith(("int", "uint")) and dt != "int32" and s_ not in starts:
                starts[s_] = self.emit(relax.op.astype(s_, "int32"), "seqstart")
                done.append(f"{_name(s_)} cast from {dt} to int32")
        ragged = call
        if done:
            args = [q, k_, v_, *(starts.get(s_, s_) for s_ in (start_q, start_k)), *call.args[5:]]
            ragged = self.builder_.normalize(
                relax.Call(call.op, args, attrs, call.ty_args, call.span)
            )
        refused = ragged_refusal(ragged, self.options)
        if refused is None:
            if ragged is call:
                return call
            ragged, tag = self.log.tagged(ragged, call)
            self.log.site(
                "ragged_operands",
                tag,
                f"attention_var_len kept for the ragged kernel (the SM80-class kernel, "
                f"which reads equal head counts and int32 offsets only): {'; '.join(done)}",
            )
            return ragged
        if not start_q.same_as(start_k) or _ndim(start_q) != 1:
            return call
        if _ints(qs.values[:1]) != [1]:
            return call  # packed tokens are one batch entry
        causal = str(attrs.causal_mask) if attrs.causal_mask is not None else "none"
        if causal not in ("none", "TopLeft", "BottomRight"):
            return call
        window = attrs.window_size
        w = int(window.value) if window is not None else None
        if w is not None and (causal == "none" or w < 1):
            return call
        dtype = _dtype(call)
        tok = self.emit(relax.op.arange(0, qs.values[1], 1, "int32"), "tokens")
        starts = start_q if _dtype(start_q) == "int32" else relax.op.astype(start_q, "int32")
        started = self.emit(
            relax.op.greater_equal(
                relax.op.expand_dims(tok, [1]), relax.op.expand_dims(starts, [0])
            ),
            "started",
        )
        seq = self.emit(relax.op.sum(relax.op.astype(started, "int32"), axis=[1]), "seq_id")
        keep = self.emit(
            relax.op.equal(relax.op.expand_dims(seq, [1]), relax.op.expand_dims(seq, [0])),
            "same_seq",
        )
        if w is not None:
            dist = relax.op.subtract(relax.op.expand_dims(tok, [0]), relax.op.expand_dims(tok, [1]))
            inside = relax.op.greater(dist, relax.const(-w, "int32"))
            keep = self.emit(relax.op.logical_and(keep, inside), "same_seq")
        mask = self.emit(
            relax.op.where(keep, relax.const(0.0, dtype), relax.const(WINDOW_MASKED, dtype)),
            "ragged_mask",
        )
        mask = self.emit(relax.op.expand_dims(mask, [0, 1]), "ragged_mask")
        # within a block queries and keys are one sequence: TopLeft is BottomRight there
        att, tag = self.log.tagged(
            relax.op.nn.attention(
                q, k_, v_, mask, attrs.scale, causal_mask=None if causal == "none" else "TopLeft"
            )
        )
        extra = f", window_size={w}" if w is not None else ""
        self.log.site(
            "var_len",
            tag,
            f"attention_var_len ({causal}{extra}) written as one attention over the packed "
            "tokens with a block-diagonal mask computed from seqstart (the mask is tokens x "
            f"tokens): TVM cannot legalize attention_var_len, and the ragged kernel refuses "
            f"it: {refused}",
        )
        return att

    # ---- constant masks ------------------------------------------------------------------
    def constant_mask(self, call: relax.Call) -> Any:
        bias = self.value(call.args[3])
        if not isinstance(bias, ir.expr.GenericConst):
            return call
        arr = bias.value.numpy().astype(np.float32)
        if arr.ndim != 4:
            return call
        attrs = call.attrs
        if attrs.window_size is not None:
            return call
        causal = attrs.causal_mask if attrs.causal_mask is not None else "none"
        sq, skv = arr.shape[2], arr.shape[3]
        keep = _mask_pattern(arr, sq, skv)
        if keep is None:  # a real additive bias (ALiBi, relative positions), or per-head masks
            return call
        want = _causal_patterns(sq, skv)
        effective = keep & want[str(causal)]
        new_causal = None
        for name in ("none", "TopLeft", "BottomRight"):
            if np.array_equal(effective, want[name] & want[str(causal)]):
                if name == "none" or causal in ("none", name):
                    new_causal = str(causal) if name == "none" else name
                break
        q, k, v = call.args[:3]
        if new_causal is None:
            return self.constant_window(call, keep, str(causal), list(arr.shape))
        found = "none" if new_causal == causal else new_causal
        att, tag = self.log.tagged(
            relax.op.nn.attention(
                q,
                k,
                v,
                None,
                attrs.scale,
                causal_mask=None if new_causal == "none" else new_causal,
            ),
            call,
        )
        what = "attends everywhere: bias dropped" if found == "none" else f"is causal ({found})"
        self.log.site("constant_mask", tag, f"constant {list(arr.shape)} mask {what}")
        return att

    def constant_window(
        self, call: relax.Call, keep: np.ndarray, causal: str, shape: list[int]
    ) -> Any:
        """A constant mask that keeps a causal band of W keys per query (transformers' Mistral
        exports its sliding window so) -> ``attention(..., causal_mask, window_size=W)`` with no
        bias, where a kernel reads windows (``self.windows`` leaves the window: the Hopper
        kernel on sm_90, which reads float16 and bfloat16); elsewhere the constant mask stays,
        which the SM80-class kernel reads."""
        if _dtype(call) not in ("float16", "bfloat16"):  # no window kernel: the mask stays
            return call
        sq, skv = keep.shape
        for mode in ("TopLeft", "BottomRight"):
            if causal not in ("none", mode):
                continue
            w = band_width(keep, skv - sq if mode == "BottomRight" else 0)
            if w is None:
                continue
            attrs = call.attrs
            q, k, v = call.args[:3]
            windowed = relax.op.nn.attention(
                q, k, v, None, attrs.scale, causal_mask=mode, window_size=w
            )
            if self.windows(windowed) is not None:
                return call
            att, tag = self.log.tagged(windowed, call)
            self.log.site(
                "constant_mask",
                tag,
                f"constant {shape} mask is a sliding window of {w} keys "
                f"({mode}): read by the kernel as window_size={w}, bias dropped",
            )
            return att
        return call


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------
_MESSAGES = {
    "transpose_pairs": "{n} transpose(s) composed, cancelled or moved below a split/slice",
    "empty_concat": "{n} concat(s) with zero-width operands simplified",
    "unit_axes": "{n} view(s) of split pieces (an unsqueeze before the split, a transpose of "
    "size-1 axes) written as reshapes: q, k and v read as pieces of one split",
    "rms_norm": "{n} RMSNorm chain(s) (mean of squares, rsqrt, scale) written as rms_norm",
    "integer_power": "{n} power(x, 2|3|4) written as multiplies (fast-math powf is NaN for x < 0)",
    "gelu_tanh": "{n} tanh-form GELU chain(s) written as gelu_tanh (fusable into a GEMM epilogue)",
    "silu": "{n} x * sigmoid(x) written as silu (fusable into a GEMM epilogue)",
}


# --------------------------------------------------------------------------------------------
# q/k/v projections that reach attention through other operators -> one GEMM
# --------------------------------------------------------------------------------------------
@dataclass
class _Projection:
    """``[add(bias)](astype?(matmul(x, w)))``: ``var`` is bound to the whole expression."""

    var: Any
    x: Any
    weight: Any  # a parameter, [N, K] under ``transposed`` or [K, N]
    transposed: bool
    bias: Any
    out_dtype: str
    mm_dtype: str
    width: int


def _projection_of(var: Any, var2val: Any, params: set[Any]) -> _Projection | None:
    e = var2val.get(var)
    bias = None
    if _op(e) == "relax.add":
        a, b = e.args
        if _ndim(b) == 1 and b in params and isinstance(a, relax.Var):
            bias, e = b, var2val.get(a)
        elif _ndim(a) == 1 and a in params and isinstance(b, relax.Var):
            bias, e = a, var2val.get(b)
        else:
            return None
    if _op(e) not in ("relax.astype", "relax.matmul"):
        return None
    out_dtype = _dtype(e)
    if _op(e) == "relax.astype" and isinstance(e.args[0], relax.Var):
        e = var2val.get(e.args[0])
    if _op(e) != "relax.matmul":
        return None
    x, w = e.args
    transposed = False
    if isinstance(w, relax.Var) and _op(var2val.get(w)) == "relax.permute_dims":
        pd = var2val[w]
        if _axes(pd) != [1, 0]:
            return None
        w, transposed = pd.args[0], True
    ws = _shape(w)
    if w not in params or ws is None or len(ws) != 2:
        return None
    return _Projection(
        var, x, w, transposed, bias, out_dtype, _dtype(e), ws[0] if transposed else ws[1]
    )


def _projections_reaching(expr: Any, var2val: Any, params: set[Any]) -> list[_Projection]:
    """The projections found walking back from ``expr`` (stopping at each one found)."""
    found: dict[Any, _Projection] = {}
    seen: set[Any] = set()
    todo = [expr]
    while todo:
        e = todo.pop()
        if not isinstance(e, relax.Var) or e in seen or e not in var2val:
            continue
        seen.add(e)
        proj = _projection_of(e, var2val, params)
        if proj is not None:
            found[e] = proj
            continue
        value = var2val[e]
        if _op(value) in ("relax.matmul", *ATTENTION_OPS):
            continue  # another matmul (not a projection by a weight) or attention ends the walk
        if isinstance(value, relax.Call):
            todo.extend(value.args)
        elif isinstance(value, relax.TupleGetItem):
            todo.append(value.tuple_value)
        elif isinstance(value, relax.Tuple):
            todo.extend(value.fields)
    return list(found.values())


def _sibling_groups(func: relax.Function) -> list[list[_Projection]]:
    var2val = relax.analysis.get_var2val(func)
    params = set(func.params)
    groups = []
    taken: list[Any] = []
    for block in func.body.blocks:
        for b in block.bindings:
            if _op(b.value) not in ATTENTION_OPS:
                continue
            per_arg = [_projections_reaching(a, var2val, params) for a in b.value.args[:3]]
            if any(len(ps) != 1 for ps in per_arg):
                continue
            group = [ps[0] for ps in per_arg]
            vars_ = [p.var for p in group]
            if any(a.same_as(b) for i, a in enumerate(vars_) for b in vars_[i + 1 :]):
                continue  # one projection already (combine_qkv), or shared between q/k/v
            if any(v.same_as(t) for v in vars_ for t in taken):
                continue
            first = group[0]
            if not all(
                p.x.same_as(first.x)
                and p.transposed == first.transposed
                and p.out_dtype == first.out_dtype
                and p.mm_dtype == first.mm_dtype
                and (p.bias is None) == (first.bias is None)
                and _dtype(p.weight) == _dtype(first.weight)
                for p in group
            ):
                continue
            taken.extend(vars_)
            groups.append(group)
    return groups


@relax.expr_functor.mutator
class _CombineProjections(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, groups: list[list[_Projection]]) -> None:
        super().__init__(mod)
        self.member = {p.var: (i, g) for g in groups for i, p in enumerate(g)}
        self.done: set[int] = set()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        hit = self.member.get(binding.var)
        if hit is None:
            super().visit_var_binding_(binding)
            return
        _, group = hit
        if id(group) in self.done:
            return  # its slice was emitted with the group's first member
        self.done.add(id(group))
        first = group[0]
        bb = self.builder_
        x = self.visit_expr(first.x)
        wcat = bb.emit(
            relax.op.concat([p.weight for p in group], axis=0 if first.transposed else 1),
            "proj_w",
        )
        w = bb.emit(relax.op.permute_dims(wcat, [1, 0]), "proj_wt") if first.transposed else wcat
        y = bb.emit(relax.op.matmul(x, w, out_dtype=first.mm_dtype), "proj_mm")
        if first.out_dtype != first.mm_dtype:
            y = bb.emit(relax.op.astype(y, first.out_dtype), "proj_mm")
        if first.bias is not None:
            bias = bb.emit(relax.op.concat([p.bias for p in group], axis=0), "proj_b")
            y = bb.emit(relax.op.add(y, bias), "proj_mm")
        axis = _ndim(y) - 1
        start = 0
        for p in group:
            piece = bb.emit(relax.op.strided_slice(y, [axis], [start], [start + p.width]), "proj")
            start += p.width
            self.set_var_remap(p.var, piece)


def _combine_projections(mod: tvm.IRModule, log: _Log) -> tvm.IRModule:
    out = tvm.IRModule(mod.functions, attrs=mod.attrs) if mod.attrs is not None else mod
    changed = False
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function) or (func.attrs and "Codegen" in func.attrs):
            continue
        groups = _sibling_groups(func)
        if not groups:
            continue
        for g in groups:
            log.counts["combine_projections"] += 1
            log.widths.append("+".join(str(p.width) for p in g))
        out[gv] = _CombineProjections(mod, groups).visit_expr(func)
        changed = True
    return _simplify(out) if changed else mod


# --------------------------------------------------------------------------------------------
# SwiGLU's gate and up projections -> one GEMM, columns paired (sm_90)
# --------------------------------------------------------------------------------------------
@dataclass
class _GateUp:
    """``out = silu_chain(view(gate)) * view(up)``: ``var`` is bound to the product."""

    var: Any
    gate: _Projection
    up: _Projection
    gate_first: bool
    #: dtype the SiLU runs in when cast up (None: no casts around it)
    silu_dtype: str | None
    #: every binding the rewrite replaces: each must have no reader outside the chain
    chain: list[Any]


def _name(var: Any) -> str:
    return str(getattr(var, "name", "?"))[:128]


def _use_counts(func: relax.Function) -> Counter[Any]:
    """How many bindings (and the function's result) read each variable."""
    counts: Counter[Any] = Counter()

    def reads(expr: Any) -> None:
        seen: set[Any] = set()

        def visit(e: Any) -> None:
            if isinstance(e, relax.Var) and e not in seen:
                seen.add(e)
                counts[e] += 1

        relax.analysis.post_order_visit(expr, visit)

    for block in func.body.blocks:
        for b in block.bindings:
            reads(b.value)
    reads(func.body.body)
    return counts


def _unview(var: Any, var2val: Any, chain: list[Any]) -> Any:
    """``var`` under a reshape that keeps its last dim (appended to ``chain``)."""
    e = var2val.get(var)
    if _op(e) == "relax.reshape" and isinstance(e.args[0], relax.Var):
        inner = e.args[0]
        s_in, s_out = getattr(inner.ty, "shape", None), getattr(var.ty, "shape", None)
        if isinstance(s_in, relax.ShapeExpr) and isinstance(s_out, relax.ShapeExpr):
            last_in, last_out = _ints(s_in.values[-1:]), _ints(s_out.values[-1:])
            if last_in is not None and last_in == last_out:
                chain.append(var)
                return inner
    return var


def _projection_chain(var: Any, var2val: Any) -> list[Any]:
    """The bindings of a projection ``astype?(matmul(x, permute_dims?(w)))`` bound to ``var``."""
    out = [var]
    e = var2val.get(var)
    if _op(e) == "relax.astype" and isinstance(e.args[0], relax.Var):
        out.append(e.args[0])
        e = var2val.get(e.args[0])
    w = e.args[1] if _op(e) == "relax.matmul" else None
    if isinstance(w, relax.Var) and w in var2val:
        out.append(w)
    return out


def _gate_up_of(var: Any, var2val: Any, params: set[Any]) -> _GateUp | None:
    e = var2val.get(var)
    if _op(e) != "relax.multiply" or not all(isinstance(a, relax.Var) for a in e.args):
        return None
    for gate_first in (True, False):
        act, up_var = e.args if gate_first else e.args[::-1]
        chain: list[Any] = []
        # the gate chain gemm_partition's _gate_chain takes: [reshape] [astype] silu [astype]
        g, silu_dtype = act, None
        cast_down = _op(var2val.get(g)) == "relax.astype"
        if cast_down:
            chain.append(g)
            g = var2val[g].args[0]
        if not isinstance(g, relax.Var) or _op(var2val.get(g)) != "relax.nn.silu":
            continue
        chain.append(g)
        g = var2val[g].args[0]
        if cast_down:
            if not isinstance(g, relax.Var) or _op(var2val.get(g)) != "relax.astype":
                continue
            chain.append(g)
            silu_dtype = _dtype(g)
            g = var2val[g].args[0]
        if not isinstance(g, relax.Var):
            continue
        g = _unview(g, var2val, chain)
        u = _unview(up_var, var2val, chain)
        gate, up = _projection_of(g, var2val, params), _projection_of(u, var2val, params)
        if gate is None or up is None or gate.var.same_as(up.var):
            continue
        dtype = gate.out_dtype
        if cast_down and (silu_dtype not in ("float32", dtype) or _dtype(act) != dtype):
            continue
        if not cast_down and _dtype(act) != dtype:
            continue
        chain += _projection_chain(gate.var, var2val) + _projection_chain(up.var, var2val)
        if not any(v.same_as(up_var) for v in chain):
            chain.append(up_var)
        return _GateUp(var, gate, up, gate_first, silu_dtype if cast_down else None, chain)
    return None


def _gate_up_groups(func: relax.Function) -> tuple[list[_GateUp], list[str]]:
    """The SwiGLU products ``combine_gate_up`` takes, and why others were left (for tests)."""
    var2val = relax.analysis.get_var2val(func)
    params = set(func.params)
    uses = _use_counts(func)
    found: list[_GateUp] = []
    skipped: list[str] = []
    for block in func.body.blocks:
        for b in block.bindings:
            gu = _gate_up_of(b.var, var2val, params)
            if gu is None:
                continue
            g, u = gu.gate, gu.up
            ws, wu = _shape(g.weight), _shape(u.weight)
            dtype = g.out_dtype
            if not (
                g.x.same_as(u.x)
                and g.bias is None
                and u.bias is None
                and g.transposed == u.transposed
                and (g.out_dtype, g.mm_dtype) == (u.out_dtype, u.mm_dtype)
                and dtype in ("float16", "bfloat16")
                and _dtype(g.weight) == _dtype(u.weight) == dtype
                and _dtype(g.x) == dtype
                and ws is not None
                and ws == wu
                and g.width % 8 == 0
                and (ws[1] if g.transposed else ws[0]) % 8 == 0
            ):
                skipped.append(f"{_name(b.var)}: not two projections of one input alike")
                continue
            if not tvm_ffi.structural_equal(b.var.ty, getattr(b.value.args[0], "ty", None)) or (
                not tvm_ffi.structural_equal(b.var.ty, b.value.args[1].ty)
            ):
                skipped.append(f"{_name(b.var)}: the product broadcasts")
                continue
            # nothing else reads the projections or the gate chain: one reader each
            if any(uses[v] != 1 for v in gu.chain):
                skipped.append(f"{_name(b.var)}: a projection's output is read elsewhere")
                continue
            found.append(gu)
    return found, skipped


@relax.expr_functor.mutator
class _CombineGateUp(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, found: list[_GateUp]) -> None:
        super().__init__(mod)
        self.by_var = {gu.var: gu for gu in found}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        gu = self.by_var.get(binding.var)
        if gu is None:
            super().visit_var_binding_(binding)
            return
        bb = self.builder_
        g, u = gu.gate, gu.up
        n = g.width
        x = self.visit_expr(g.x)
        # Wgu row 16j + i: Wg row 8j + i (i < 8), Wu row 8j + i - 8 (i >= 8); along the last
        # axis for weights stored [K, N]
        if g.transposed:
            k = _shape(g.weight)[1]  # type: ignore[index]
            blocks = [
                bb.emit(relax.op.reshape(w, (n // 8, 8, k)), "gu_w") for w in (g.weight, u.weight)
            ]
            wcat = bb.emit(relax.op.concat(blocks, axis=1), "gu_w")
            wgu = bb.emit(relax.op.reshape(wcat, (2 * n, k)), "gate_up_w")
            w = bb.emit(relax.op.permute_dims(wgu, [1, 0]), "gate_up_wt")
        else:
            k = _shape(g.weight)[0]  # type: ignore[index]
            blocks = [
                bb.emit(relax.op.reshape(w, (k, n // 8, 8)), "gu_w") for w in (g.weight, u.weight)
            ]
            wcat = bb.emit(relax.op.concat(blocks, axis=2), "gu_w")
            w = bb.emit(relax.op.reshape(wcat, (k, 2 * n)), "gate_up_w")
        y = bb.emit(relax.op.matmul(x, w, out_dtype=g.mm_dtype), "gate_up")
        if g.out_dtype != g.mm_dtype:
            y = bb.emit(relax.op.astype(y, g.out_dtype), "gate_up")
        lead = list(y.ty.shape.values[:-1])
        y4 = bb.emit(relax.op.reshape(y, [*lead, n // 8, 2, 8]), "gate_up_pairs")
        axis = len(lead) + 1
        gate = bb.emit(relax.op.strided_slice(y4, [axis], [0], [1]), "gate")
        up = bb.emit(relax.op.strided_slice(y4, [axis], [1], [2]), "up")
        if gu.silu_dtype is not None:
            act = bb.emit(relax.op.astype(gate, gu.silu_dtype), "gate")
            act = bb.emit(relax.op.nn.silu(act), "gate_act")
            act = bb.emit(relax.op.astype(act, g.out_dtype), "gate_act")
        else:
            act = bb.emit(relax.op.nn.silu(gate), "gate_act")
        prod = bb.emit(relax.op.multiply(act, up), "swiglu")
        out = relax.op.reshape(prod, binding.var.ty.shape)
        if isinstance(binding.var, relax.DataflowVar) or not bb.current_block_is_dataflow():
            new = bb.emit(out, _name(binding.var))
        else:
            new = bb.emit_output(out, _name(binding.var))
        self.set_var_remap(binding.var, new)


def _combine_gate_up(mod: tvm.IRModule, log: _Log) -> tvm.IRModule:
    out = tvm.IRModule(mod.functions, attrs=mod.attrs) if mod.attrs is not None else mod
    changed = False
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function) or (func.attrs and "Codegen" in func.attrs):
            continue
        found, _ = _gate_up_groups(func)
        if not found:
            continue
        for gu in found:
            log.counts["combine_gate_up"] += 1
            log.gate_up.append(f"{_name(gu.gate.weight)} + {_name(gu.up.weight)}")
        out[gv] = _CombineGateUp(mod, found).visit_expr(func)
        changed = True
    return _simplify(out) if changed else mod


def _simplify(mod: tvm.IRModule) -> tvm.IRModule:
    mod = relax.transform.DeadCodeElimination()(mod)
    mod = relax.transform.CanonicalizeBindings()(mod)
    return relax.transform.RemoveRedundantReshape()(mod)


def _run_local(mod: tvm.IRModule, log: _Log, policy: _Policy) -> tvm.IRModule:
    for _ in range(MAX_ROUNDS):
        before = sum(log.counts.values())
        out = tvm.IRModule(mod.functions, attrs=mod.attrs) if mod.attrs is not None else mod
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                out[gv] = _Local(mod, log, policy).visit_expr(func)
        mod = _simplify(out)
        if sum(log.counts.values()) == before:
            break
    return mod


def _attention_sites(mod: tvm.IRModule) -> dict[str, tuple[str, int, str]]:
    """rewrite tag -> (function, index among its attention calls, binding name); the index
    is the one partition's site ids use (binding order, ragged batches among them)."""
    out: dict[str, tuple[str, int, str]] = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        n = 0
        for block in func.body.blocks:
            for b in block.bindings:
                if _op(b.value) in SITE_OPS:
                    tag = _tag_of(b.value)
                    if tag is not None:
                        out[tag] = (gv.name_hint, n, str(b.var.name))
                    n += 1
    return out


def _site_rewrites(mod: tvm.IRModule, log: _Log) -> list[Rewrite]:
    """One report entry per site rewrite in ``log``, where the site now is in ``mod``."""
    sites = _attention_sites(mod)
    out = []
    for name, tag, message in log.sites:
        fn, idx, binding = sites.get(tag, ("main", -1, "?"))
        where = Where(
            function=fn[:128],
            site=f"{fn}/attention#{idx}" if idx >= 0 else "?",
            binding=binding[:128],
        )
        out.append(Rewrite(rewrite=name, where=where, message=message))
    return out


def windows_as_masks(
    mod: tvm.IRModule, refused: WindowPolicy
) -> tuple[tvm.IRModule, list[Rewrite]]:
    """The sliding windows ``normalize`` left for partition (sm_90) that no kernel took, written
    as masks (the ``sliding_window`` rewrite, nothing else): ``refused`` gives a call's reason,
    or None for a window a kernel took."""
    log = _Log()
    # only the windows are visited: nothing combines, nothing else is rewritten
    options = CompileOptions(fuse_stacked=False)
    out = _run_local(mod, log, _Policy(options, gqa=False, windows=refused, only_windows=True))
    return out, _site_rewrites(out, log)


def partition_sites(mod: tvm.IRModule, options: CompileOptions, arch: str) -> PartitionResult:
    """:func:`worker.partition.partition`, then the sliding windows no kernel took (normalize
    leaves windows on sm_90 for the Hopper kernel, which does not take every site) written as
    masks by :func:`windows_as_masks` (the reason in its message) and the patterns run again: a
    window never reaches TVM's build, which cannot legalize it."""
    result = partition(mod, options, arch)
    refused = refused_windows(result) if options.normalize else {}
    if not refused:
        return result
    assert result.tagged is not None
    masked, rewrites = windows_as_masks(result.tagged, lambda call: refused.get(site_of(call)))
    if not rewrites:
        return result
    again = partition(masked, options, arch)
    again.rewrites = [*rewrites, *again.rewrites]
    return again


def normalize(
    mod: tvm.IRModule, options: CompileOptions, arch: str | None = None
) -> tuple[tvm.IRModule, list[Rewrite]]:
    """Apply the rewrites above; return the module and one report entry per rewrite that fired.
    ``arch`` (the target's) enables the rewrites that pay only where a kernel takes their form."""
    rewrites: list[Rewrite] = []
    log = _Log()
    before = mod
    mod = relax.transform.ConvertToDataflow(min_size=1)(mod)
    mod = relax.transform.CanonicalizeBindings()(mod)
    if not tvm_ffi.structural_equal(before, mod):
        rewrites.append(Rewrite(rewrite="dataflow", message="bindings moved into dataflow blocks"))
    mod = relax.transform.EliminateCommonSubexpr()(mod)  # three reshape(x) -> one
    gqa = arch is not None and arch.rstrip("a") == "sm_90"
    reason = "options.kernel is sm80" if gqa else f"no kernel reads one on {arch or 'it'}"

    def windows(_call: relax.Call) -> str | None:
        # sm_90: the Hopper kernel reads windows, partition decides (windows_as_masks)
        return None if gqa and options.kernel != "sm80" else reason

    mod = _run_local(mod, log, _Policy(options, gqa=gqa, windows=windows))
    if options.offload_gemm and options.fuse_stacked:  # both say "combine", as combine_qkv
        mod = _combine_projections(mod, log)
    if options.offload_gemm and gqa:  # sm_90: the paired SwiGLU GEMM is a Hopper kernel
        mod = _combine_gate_up(mod, log)
    rewrites.extend(_site_rewrites(mod, log))
    if log.widths:
        rewrites.append(
            Rewrite(
                rewrite="combine_projections",
                message=f"{len(log.widths)} set(s) of q/k/v projections of one input combined "
                f"into one matmul each ({', '.join(dict.fromkeys(log.widths))} columns), "
                "each projection a column slice",
            )
        )
    if log.gate_up:
        names = ", ".join(log.gate_up[:4]) + (", ..." if len(log.gate_up) > 4 else "")
        rewrites.append(
            Rewrite(
                rewrite="combine_gate_up",
                message=f"{len(log.gate_up)} SwiGLU MLP(s) ({names}): gate and up projections "
                "combined into one matmul each on weights interleaved in blocks of 8 rows "
                "(computed once, from the weights), silu(gate) * up read from its paired "
                "columns",
            )
        )
    for name, template in _MESSAGES.items():
        if log.counts[name]:
            rewrites.append(Rewrite(rewrite=name, message=template.format(n=log.counts[name])))
    return mod, rewrites
