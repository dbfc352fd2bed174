"""From a PyTorch module or an ONNX file to a Relax module the service accepts (`stackfuse import`).

Runs on the client's own machine (it needs torch or onnx, which the service never imports). The
output is three files side by side:

- ``model.json``: the Relax module as TVM JSON, ready for ``/optimize``. Weights are *function
  parameters* (``keep_params_as_input``): the JSON holds the graph and small constants only, so
  it stays far below the service's 64 MiB body limit however large the model is.
- ``model.params.npz``: the weights, keyed by parameter name, in ``main``'s parameter order.
- ``model.inputs.json``: a manifest: the user inputs and the parameters, in calling order, and
  ``dynamic``: the symbolic dims (name, upper bound, which inputs' axes), empty when static.

The library built from ``model.json`` is called as ``main(*inputs, *params)``.

PyTorch: ``torch.export`` with the core-ATen decompositions *except* scaled-dot-product attention,
which stays one operator and becomes one ``R.nn.attention`` (TVM's own converter drops ``scale``
and refuses boolean masks; ours keeps both). Whatever else is left is graph normalization's job
(:mod:`worker.normalize`), which the service runs and reports.

ONNX: external-data files must resolve inside the model's folder (no ``..``, no absolute paths,
no links that lead out); anything else is refused before a byte of it is read.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import InputError
from worker import dynamic as dyn
from worker.attention import MASKED
from worker.toolchain import import_tvm

PARAMS_SUFFIX = ".params.npz"
MANIFEST_SUFFIX = ".inputs.json"
#: names that reach generated code must match this (service.wire.is_code_name); longer or odd
#: names are shortened with a hash so that two names never collide
_CODE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
#: function attributes the importers attach that the service refuses (ingest allow-list)
_DROP_ATTRS = ("params", "tir_var_lower_bound", "tir_var_upper_bound")


@dataclass
class Imported:
    """A Relax module plus the weights its ``main`` takes after the user inputs."""

    mod: Any
    params: dict[str, np.ndarray]
    inputs: list[dict[str, Any]]
    source: str
    notes: list[str] = field(default_factory=list)
    #: parameter name -> where its weight came from (the state_dict key, the ONNX initializer)
    origins: dict[str, str] = field(default_factory=dict)

    def save(self, out: Path) -> Path:
        """Write ``out`` (TVM JSON), the weights and the manifest beside it; return ``out``."""
        tvm = import_tvm()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(tvm.ir.save_json(self.mod))
        stem = out.with_suffix("")
        np.savez(stem.with_name(stem.name + PARAMS_SUFFIX), **self.params)  # type: ignore[arg-type]
        manifest = {
            "source": self.source,
            "inputs": self.inputs,
            "params": [
                {
                    "name": k,
                    "shape": list(v.shape),
                    "dtype": str(v.dtype),
                    "origin": self.origins.get(k, ""),
                }
                for k, v in self.params.items()
            ],
            "num_input": len(self.inputs),
            "calling_convention": "main(*inputs, *params)",
            "dynamic": dyn.describe(self.mod["main"]),
            "notes": self.notes,
        }
        stem.with_name(stem.name + MANIFEST_SUFFIX).write_text(json.dumps(manifest, indent=2))
        return out


def params_path(module_json: Path) -> Path:
    stem = module_json.with_suffix("")
    return stem.with_name(stem.name + PARAMS_SUFFIX)


def load_params(module_json: Path) -> list[np.ndarray]:
    """The weights written by :meth:`Imported.save`, in ``main``'s parameter order."""
    with np.load(params_path(module_json)) as data:
        return [data[k] for k in data.files]


# --------------------------------------------------------------------------------------------
# shared post-processing
# --------------------------------------------------------------------------------------------
def code_name(name: str, taken: set[str]) -> str:
    """``name`` if the service accepts it as is, else a short, unique, hashed form of it."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", name)
    if not clean or not clean[0].isalpha():
        clean = "v_" + clean
    if _CODE_NAME.match(clean) and clean not in taken:
        return clean
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    cand = f"{clean[:52]}_{digest}"
    n = 0
    while cand in taken:
        n += 1
        cand = f"{clean[:48]}_{digest}_{n}"
    return cand


def _finish(
    mod: Any, num_input: int, dynamic: Mapping[str, int] | None = None
) -> tuple[Any, list[str]]:
    """Rename parameters to code names, drop attributes the service refuses, fold constants.

    Folding runs here, on the client, because exporters build masks and position tables from
    ``arange``/``cumsum`` chains that depend on no input: folded, they become small constants
    that normalization can recognise (a causal mask, an all-true mask) and the service's
    operator allow-list never sees the ops that built them. With ``dynamic`` (dim name -> upper
    bound) the exporter's symbolic dims are renamed ``batch``/``seq`` and their bounds set as
    ``tir_var_upper_bound``.
    """
    tvm = import_tvm()
    from tvm import relax

    notes: list[str] = []
    func = mod["main"]
    bounds = dict(dynamic or {})
    func = _name_symbolic_dims(func, num_input, bounds)
    taken: set[str] = set()
    renamed = 0
    new_params = []
    for p in func.params:
        new = code_name(p.name, taken)
        taken.add(new)
        if new != p.name:
            renamed += 1
        new_params.append(relax.Var(new, p.ty))
    bound = func.bind_params({old: nv for old, nv in zip(func.params, new_params, strict=True)})
    if renamed:
        notes.append(f"{renamed} parameter name(s) made code names ('.' -> '_', long ones hashed)")
    old_attrs = dict(func.attrs.items()) if func.attrs is not None else {}
    dropped = [k for k in old_attrs if k in _DROP_ATTRS and k != "params" and not bounds]
    if dropped:
        notes.append(f"dropped function attributes {sorted(dropped)}")
    attrs: dict[str, Any] = {"global_symbol": "main", "num_input": num_input}
    if bounds:
        attrs[dyn.UPPER_BOUND_ATTR] = {k: tvm.tirx.IntImm("int64", v) for k, v in bounds.items()}
    new_func = relax.Function(new_params, bound.body, func.ret_ty, func.is_pure).with_attrs(attrs)
    out = tvm.IRModule({"main": new_func})
    out, fold = _fold_input_free(out, bounds)
    if fold.values:
        n = len(fold.values)
        notes.append(f"folded {n} input-free values (masks, position tables) to constants")
    if fold.masks:
        forms = ", ".join(f"{k} x{v}" for k, v in Counter(fold.mask_notes).items())
        notes.append(
            f"{len(fold.masks)} constant attention mask(s) taken as the attention's causal flag, "
            f"not stored: {forms}"
        )
    if fold.sliced:
        notes.append(
            f"{fold.sliced} folded value(s) sized by a dynamic dim stored at the upper bound "
            "and sliced to the run-time extent"
        )
    if fold.kept:
        notes.append(
            f"{fold.kept} input-free value(s) that change with a dynamic dim stay computed"
        )
    return out, notes


def _name_symbolic_dims(func: Any, num_input: int, bounds: dict[str, int]) -> Any:
    """``func`` with the exporter's symbolic dims at the inputs' batch/seq axes renamed to
    ``batch``/``seq``; refuses a dim the exporter made static and any other symbolic dim."""
    tvm = import_tvm()
    from tvm import relax

    rename: dict[Any, Any] = {}
    named: dict[str, Any] = {}
    for p in list(func.params)[:num_input]:
        if not isinstance(p.ty, relax.TensorType) or not isinstance(p.ty.shape, relax.ShapeExpr):
            continue
        values = list(p.ty.shape.values)
        for axis, name in dyn.axes_of(len(values), bounds).items():
            d = values[axis]
            if not isinstance(d, tvm.tirx.Var):
                raise InputError(
                    f"input {p.name!r} axis {axis} ({name}) came out of the export as {d}, not "
                    f"symbolic: the model fixes it (an example size of 1 is specialized; give "
                    f"{name} >= 2), or drop {name} from dynamic"
                )
            new = named.setdefault(name, tvm.tirx.Var(name, "int64"))
            if rename.setdefault(d, new) is not new:
                raise InputError(
                    f"input {p.name!r} axis {axis}: the export made {name} the same dim as "
                    f"{rename[d].name}; give them different example sizes"
                )
    free = [v for v in relax.analysis.defined_symbolic_vars(func) if v not in rename]
    if free and bounds:
        raise InputError(
            f"the module has symbolic dims {sorted(str(v.name) for v in free)} that are not "
            f"{' or '.join(dyn.AXES)} at the inputs' axes; import with static shapes or "
            "--dynamic naming them"
        )
    return func.bind_symbolic_vars(rename) if rename else func


#: input-free values larger than this stay computed where the service accepts the operator that
#: computes them (their smaller inputs are folded instead); a value computed by an operator the
#: service refuses, or by a scan (``cumsum`` of packed-sequence positions: the service takes a
#: scan only over a known shape, and exporters' types are often shapeless), is folded at any size
FOLD_MAX_BYTES = 16 * 1024 * 1024
#: input-free attention biases up to this size are evaluated to see whether they are causal or
#: all-true masks ([B, 1, S, S]: 256 MiB is float16 at B32 S2048)
MASK_MAX_BYTES = 1024 * 1024 * 1024


def _dim_text(d: Any) -> int | str:
    return int(d.value) if hasattr(d, "value") else str(d)


def _extent(d: Any, sizes: Mapping[str, int]) -> int | None:
    """A dim's extent, symbolic dims taken at ``sizes`` (by name); ``None`` when unknown."""
    if hasattr(d, "value"):
        return int(d.value)
    tvm = import_tvm()
    ana = tvm.sym.Analyzer()
    for v in tvm.tirx.analysis.undefined_vars(d):
        if v.name not in sizes:
            return None
        ana.bind(v, tvm.tirx.IntImm("int64", sizes[v.name]))
    got = ana.simplify(d)
    return int(got.value) if hasattr(got, "value") else None


def _nbytes(ty: Any, sizes: Mapping[str, int] | None = None) -> int | None:
    """Bytes of a tensor type; symbolic dims at ``sizes`` (their upper bounds, for folding)."""
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None:
        return None
    n = 1
    for d in values:
        e = _extent(d, sizes or {})
        if e is None:
            return None
        n *= e
    dtype = str(ty.dtype).removeprefix("T.")
    return n * (1 if dtype == "bool" else np.dtype(dtype).itemsize)


def mask_form(bias: np.ndarray, causal: str = "none") -> str | None:
    """What a constant additive attention bias does, given the call's own ``causal`` flag:
    ``"none"`` (attends everywhere), ``"TopLeft"`` or ``"BottomRight"`` (causal), or ``None``
    (a real bias or a mask of another shape, which must stay). Same rule as normalize's
    ``constant_mask``: open entries exactly 0, masked ones at or below -1e4, equal for every
    batch entry and head."""
    forms = mask_forms(bias, causal)
    return next((f for f in _FORMS if f in forms), None)


_FORMS = ("none", "TopLeft", "BottomRight")


def mask_forms(bias: np.ndarray, causal: str = "none") -> set[str]:
    """Every form :func:`mask_form` could read ``bias`` as: a 1 x 1 mask is all-true and
    causal alike, a square one TopLeft and BottomRight alike. A mask sampled at several
    lengths is one form if some form fits every sample."""
    if bias.ndim != 4:
        return set()
    keep = bias > MASKED
    if np.any(bias[keep] != 0.0):
        return set()
    sq, skv = bias.shape[2], bias.shape[3]
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    want: dict[str, np.ndarray] = {
        "none": np.ones((sq, skv), bool),
        "TopLeft": j <= i,
        "BottomRight": j <= i + (skv - sq),
    }
    if causal not in want:
        return set()
    pattern = keep.reshape(-1, keep.shape[2], keep.shape[3])
    first = pattern[0]
    if not all(np.array_equal(first, pattern[n]) for n in range(1, pattern.shape[0])):
        return set()
    effective = np.broadcast_to(first, (sq, skv)) & want[causal]
    out: set[str] = set()
    for name in _FORMS:
        if np.array_equal(effective, want[name] & want[causal]):
            if name == "none":
                out.add(causal)
            elif causal in ("none", name):
                out.add(name)
    return out


def _evaluate(
    order: list[Any], outputs: list[Any], symbolic: Sequence[Any] = (), samples: Sequence[Any] = ()
) -> list[list[np.ndarray]]:
    """Run the input-free bindings ``order`` on the CPU (LLVM); the values of ``outputs``, once
    per entry of ``samples`` (symbolic dim name -> extent; one empty entry when static).

    The symbolic dims enter as one shape parameter, so the chain compiles once for all sizes."""
    tvm = import_tvm()
    from tvm import relax

    bb = relax.BlockBuilder()
    params = [relax.Var("dims", relax.ShapeType(list(symbolic)))] if symbolic else []
    with bb.function("main", params):
        for b in order:
            bb.emit_normalized(b)
        bb.emit_func_output(relax.Tuple(outputs))
    fold = relax.transform.DeadCodeElimination(["main"])(bb.get())
    try:
        vm = relax.VirtualMachine(tvm.compile(fold, target="llvm"), tvm.cpu())
    except Exception:
        if not symbolic:
            raise
        vm = None  # TVM cannot lower some op at a shape it cannot infer (cumsum): specialize
    out: list[list[np.ndarray]] = []
    for sizes in samples or [{}]:
        if vm is not None:
            args = [tvm.runtime.ShapeTuple([sizes[v.name] for v in symbolic])] if symbolic else []
            results = vm["main"](*args)
        else:
            exe = tvm.compile(_specialized(fold["main"], symbolic, sizes), target="llvm")
            results = relax.VirtualMachine(exe, tvm.cpu())["main"]()
        out.append([results[i].numpy() for i in range(len(outputs))])
    return out


def _specialized(func: Any, symbolic: Sequence[Any], sizes: Mapping[str, int]) -> Any:
    """``func`` (one shape parameter, as :func:`_evaluate` builds it) at fixed ``sizes``, every
    binding's type inferred afresh: the exporter's types are often shapeless where it could not
    prove two symbolic extents equal (``min(1, seq) + seq - 1`` vs ``seq``), and TVM lowers
    some ops (cumsum) only with a known shape."""
    tvm = import_tvm()
    from tvm import relax

    fixed = func.bind_symbolic_vars({v: tvm.tirx.IntImm("int64", sizes[v.name]) for v in symbolic})
    new: dict[Any, Any] = {}
    ana = tvm.sym.Analyzer()

    def redo(e: Any) -> Any:
        if isinstance(e, relax.Var) and e in new:
            return new[e]
        if isinstance(e, relax.Call):
            return relax.Call(e.op, [redo(a) for a in e.args], e.attrs, e.ty_args)
        if isinstance(e, relax.Tuple):
            return relax.Tuple([redo(f) for f in e.fields])
        if isinstance(e, relax.TupleGetItem):
            return relax.TupleGetItem(redo(e.tuple_value), e.index)
        if isinstance(e.ty, tvm.ir.PrimType):  # a scalar argument: `seq + 1` -> 17
            return ana.simplify(e)
        if isinstance(e, relax.ShapeExpr):
            return relax.ShapeExpr([ana.simplify(d) for d in e.values])
        return e

    bb = relax.BlockBuilder()
    with bb.function("main", []):
        for block in fixed.body.blocks:
            for b in block.bindings:
                new[b.var] = bb.emit(redo(b.value))
        bb.emit_func_output(redo(fixed.body.body))
    return bb.get()


def _samples(bounds: Mapping[str, int]) -> list[dict[str, int]]:
    """The sizes an input-free value is checked at when dims are symbolic: every dim at its
    bound first, then each dim alone at 1, 3 and its bound - 1, then all at 1 and all at 2."""
    if not bounds:
        return [{}]
    top = dict(bounds)
    out = [top]
    for name, ub in bounds.items():
        for n in sorted({1, 3, ub - 1}):
            if 1 <= n < ub:
                out.append({**top, name: n})
    out += [dict.fromkeys(bounds, 1), dict.fromkeys(bounds, 2)]
    unique: dict[tuple[tuple[str, int], ...], dict[str, int]] = {}
    for s in out:
        unique.setdefault(tuple(sorted(s.items())), s)
    return list(unique.values())


def _prefix_of(var: Any, top: np.ndarray, got: list[np.ndarray], samples: list[Any]) -> bool:
    """Whether ``var``, evaluated at ``samples``, is always ``top`` (its value at the bounds)
    cut to the sample's extents: then it is stored once at the bounds and sliced at run time.
    Every dim must be static or one symbolic dim itself (``seq``, not ``seq + 1``)."""
    dims = getattr(getattr(var.ty, "shape", None), "values", None)
    if dims is None or any(not hasattr(d, "value") and not hasattr(d, "name") for d in dims):
        return False
    for sizes, arr in zip(samples, got, strict=True):
        cut = tuple(slice(None) if hasattr(d, "value") else slice(0, sizes[d.name]) for d in dims)
        want = top[cut]
        if arr.shape != want.shape or not np.array_equal(arr, want):
            return False
    return True


@dataclass
class _Fold:
    """What :func:`fold_input_free` decided: constants per variable, attention calls whose
    constant mask became their ``causal_mask``, and the masks' descriptions for the notes."""

    values: dict[Any, Any] = field(default_factory=dict)
    masks: dict[Any, str] = field(default_factory=dict)
    mask_notes: list[str] = field(default_factory=list)
    #: values sized by a symbolic dim, stored at the bounds and sliced; values kept computed
    sliced: int = 0
    kept: int = 0


def _input_free(func: Any, symbolic: Sequence[Any] = ()) -> list[Any]:
    """Bindings of ``func`` (non-dataflow) whose values depend on no parameter, in order; the
    ``symbolic`` dims count as known (they are evaluated at sampled sizes)."""
    tvm = import_tvm()
    from tvm import relax

    params = set(func.params)
    const: set[Any] = set(symbolic)
    order: list[Any] = []
    for block in func.body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.VarBinding):
                continue
            value = b.value
            if isinstance(value, relax.Function | tvm.ir.expr.GenericConst):
                continue
            if isinstance(value, relax.Call) and not isinstance(value.op, tvm.ir.Op):
                continue
            free = relax.analysis.free_vars(value)
            if any(v in params or v not in const for v in free):
                continue
            const.add(b.var)
            order.append(b)
    return order


def _mask_calls(func: Any, free: dict[Any, Any], bounds: Mapping[str, int]) -> dict[Any, Any]:
    """attention calls (by binding) whose bias is an input-free tensor -> that bias variable."""
    tvm = import_tvm()
    from tvm import relax

    out: dict[Any, Any] = {}
    for block in func.body.blocks:
        for b in block.bindings:
            call = b.value
            if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)):
                continue
            if call.op.name != "relax.nn.attention_bias" or call.attrs.window_size is not None:
                continue
            bias = call.args[3]
            size = _nbytes(bias.ty, bounds) if bias in free else None
            if size is not None and size <= MASK_MAX_BYTES:
                out[b.var] = bias
    return out


def _frontier(
    order: list[Any],
    used_outside: set[Any],
    accepted: frozenset[str],
    bounds: Mapping[str, int],
    stay: set[Any],
) -> tuple[list[Any], int]:
    """The input-free variables to fold: each one used outside the input-free part, except a
    large value whose operator the service accepts, which stays computed from folded inputs
    (``broadcast_to`` of a small constant stays ``broadcast_to``), and the variables of
    ``stay`` (values that change with a symbolic dim in a way a slice cannot follow). Sizes
    are taken at the symbolic dims' ``bounds``. Returns the variables and how many bindings
    stay computed."""
    tvm = import_tvm()
    from tvm import relax

    by_var = {b.var: b for b in order}
    frontier: list[Any] = []
    kept = 0
    needed = set(used_outside)
    for b in reversed(order):
        if b.var not in needed:
            continue
        size = _nbytes(b.var.ty, bounds) if isinstance(b.var.ty, relax.TensorType) else None
        op = b.value.op.name if isinstance(b.value, relax.Call) else None
        small = size is not None and size <= FOLD_MAX_BYTES
        if b.var not in stay and (small or (size is not None and op not in accepted)):
            frontier.append(b.var)
            continue
        kept += 1
        needed.update(v for v in relax.analysis.free_vars(b.value) if v in by_var)
    _ = tvm
    return frontier[::-1], kept


def fold_input_free(mod: Any, bounds: Mapping[str, int] | None = None) -> tuple[Any, int]:
    """Evaluate, on the CPU, every value of ``main`` that depends on no input; bind constants.

    TVM's FoldConstant folds only ``call_tir`` with constant arguments, not high-level ops such
    as ``arange``, so exported mask and position chains survive it. Here the input-free bindings
    are compiled for LLVM, run once, and their results replace them. An attention bias that is
    a constant causal or all-true mask is not stored at all: the call takes it as its
    ``causal_mask`` (a [8, 1, 1024, 1024] float16 mask is 16 MiB of JSON per distinct value).

    With symbolic dims (``bounds``: name -> upper bound) a value is evaluated at the bounds and
    at smaller sizes (:func:`_samples`): a mask is taken as causal only if it is causal at every
    one, and a value sized by a symbolic dim (a position table) is folded at the bounds and
    sliced at run time only if every smaller value is that slice; other values stay computed.
    Returns the module and how many values were folded (masks included).
    """
    out, fold = _fold_input_free(mod, bounds or {})
    return out, len(fold.values) + len(fold.masks) + fold.sliced


def _fold_input_free(mod: Any, bounds: Mapping[str, int]) -> tuple[Any, _Fold]:
    tvm = import_tvm()
    from tvm import relax

    from service.wire import ALLOWED_OPS, SCAN_OPS

    @relax.expr_functor.mutator
    class _StaticShapeOf(relax.PyExprMutator):
        """``shape_of(x)`` of a statically shaped ``x`` is that shape (ONNX's Shape op)."""

        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.shape_of":
                shape = getattr(call.args[0].ty, "shape", None)
                if isinstance(shape, relax.ShapeExpr) and all(
                    hasattr(d, "value") for d in shape.values
                ):
                    return relax.ShapeExpr([int(d.value) for d in shape.values])
            return call

    mod = tvm.IRModule({"main": _StaticShapeOf(mod).visit_expr(mod["main"])})
    nd = relax.transform.ToNonDataflow()(mod)
    func = nd["main"]
    fold = _Fold()
    symbolic = [v for v in relax.analysis.defined_symbolic_vars(func) if v.name in bounds]
    order = _input_free(func, symbolic)
    if not order:
        return mod, fold
    free = {b.var: b for b in order}

    samples = _samples(bounds)

    # 1. constant masks: evaluated whatever their size, and never stored when causal/all-true
    # (with symbolic dims: only when the mask has the same form at every sampled size)
    candidates = _mask_calls(func, free, bounds)
    bias_vars = list(dict.fromkeys(candidates.values()))
    per_sample = _evaluate(order, bias_vars, symbolic, samples) if bias_vars else []
    masks: dict[Any, str] = {}
    calls = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    for var, bias in candidates.items():
        call = calls[var]
        causal = call.attrs.causal_mask if call.attrs.causal_mask is not None else "none"
        i = bias_vars.index(bias)
        forms = set(_FORMS)
        for r in per_sample:
            forms &= mask_forms(r[i].astype(np.float32), str(causal))
        form = next((f for f in _FORMS if f in forms), None)
        if form is not None:
            masks[var] = form
            what = "attends everywhere" if form == "none" else f"is causal ({form})"
            shape = [_dim_text(d) for d in bias.ty.shape.values]
            at = f" at {len(samples)} sizes up to the bounds" if symbolic else ""
            fold.mask_notes.append(f"{shape} mask {what}{at}")
    fold.masks = masks

    # 2. everything else used outside the input-free part is folded (or kept computed)
    used_outside: set[Any] = set()
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var in free:
                continue
            args = b.value.args[:3] if b.var in masks else [b.value]
            for a in args:
                used_outside.update(relax.analysis.free_vars(a))
    used_outside.update(relax.analysis.free_vars(func.body.body))
    used_outside &= set(free)
    # with symbolic dims a value is folded only if each smaller one is its slice; the others
    # stay computed, and then their inputs are candidates in turn
    stay: set[Any] = set()
    at_bounds: dict[Any, np.ndarray] = {}
    while True:
        frontier, _kept = _frontier(order, used_outside, ALLOWED_OPS - SCAN_OPS, bounds, stay)
        todo = [v for v in frontier if v not in at_bounds]
        if not todo:
            break
        got = _evaluate(order, todo, symbolic, samples)
        for i, v in enumerate(todo):
            if symbolic and not _prefix_of(v, got[0][i], [r[i] for r in got], samples):
                stay.add(v)
            else:
                at_bounds[v] = got[0][i]
    fold.kept = len(stay)
    # one constant per distinct value: exporters rebuild the same mask for every layer, and
    # the JSON stores a constant once per object (GPT-2 small at S1024: twelve 16 MiB masks)
    distinct: dict[tuple[str, tuple[int, ...], str], Any] = {}
    slices: dict[Any, Any] = {}
    for v in frontier:
        arr = at_bounds[v]
        dtype = str(v.ty.dtype).removeprefix("T.")
        key = (dtype, arr.shape, hashlib.sha256(arr.tobytes()).hexdigest())
        if key not in distinct:
            distinct[key] = relax.const(arr, dtype)
        dims = list(v.ty.shape.values)
        cut = [(axis, d) for axis, d in enumerate(dims) if not hasattr(d, "value")]
        if cut:
            axes = [axis for axis, _ in cut]
            slices[v] = relax.op.strided_slice(
                distinct[key], axes, [0] * len(axes), [d for _, d in cut], assume_inbound=True
            )
        else:
            fold.values[v] = distinct[key]
    fold.sliced = len(slices)
    if not fold.values and not masks and not slices:
        return mod, fold
    values = fold.values

    @relax.expr_functor.mutator
    class _Bind(relax.PyExprMutator):
        def visit_var_(self, var: Any) -> Any:
            return values.get(var, var)

        def visit_var_binding_(self, binding: Any) -> None:
            if binding.var in slices:
                value = self.builder_.normalize(slices[binding.var])
                self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
                return
            form = masks.get(binding.var)
            if form is None:
                super().visit_var_binding_(binding)
                return
            call = binding.value
            q, k, v = (self.visit_expr(a) for a in call.args[:3])
            att = relax.op.nn.attention(
                q, k, v, None, call.attrs.scale, causal_mask=None if form == "none" else form
            )
            att = self.builder_.normalize(att)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, att))

    new = _Bind(nd).visit_expr(func)
    out = tvm.IRModule({"main": new})
    out = relax.transform.ConvertToDataflow(min_size=1)(out)
    out = relax.transform.DeadCodeElimination(["main"])(out)
    out = relax.transform.CanonicalizeBindings()(out)
    return out, fold


#: the service's default request body limit (service.settings.Settings.max_body_bytes)
BODY_LIMIT_BYTES = 64 * 1024 * 1024


def over_limit_message(text: str, size: int, limit: int = BODY_LIMIT_BYTES) -> str:
    """Why a module of ``size`` JSON bytes cannot be submitted, naming its largest constants
    (:func:`service.wire.largest_constants`, the same list the service's 413 gives)."""
    from service.wire import constant_text, largest_constants

    biggest = "; ".join(constant_text(c) for c in largest_constants(text, 3))
    return (
        f"the module is {size / 2**20:.1f} MiB of JSON, over the service's "
        f"{limit / 2**20:.0f} MiB body limit; largest constants: {biggest or 'none'}"
    )


# --------------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------------
def _sdpa_converter(node: Any, importer: Any) -> Any:
    """``aten.scaled_dot_product_attention`` -> one ``R.nn.attention`` between two transposes.

    Keeps ``scale`` (TVM's own converter drops it), turns a boolean mask into an additive one
    (``0`` where attended, the dtype's lowest finite value elsewhere: a fully masked row then
    averages V instead of producing NaN), and maps ``is_causal`` to ``TopLeft`` as PyTorch does.
    """
    from tvm import relax, tirx

    bb = importer.block_builder
    env = importer.env
    args = list(node.args) + [None] * (6 - len(node.args))
    q, k, v = env[args[0]], env[args[1]], env[args[2]]
    mask_node = args[3] if args[3] is not None else node.kwargs.get("attn_mask")
    dropout = args[4] if args[4] is not None else node.kwargs.get("dropout_p", 0.0)
    is_causal = args[5] if args[5] is not None else node.kwargs.get("is_causal", False)
    scale = node.kwargs.get("scale")
    if dropout:
        raise InputError(
            f"scaled_dot_product_attention with dropout_p={dropout}: export the model in eval mode"
        )
    if node.kwargs.get("enable_gqa"):
        raise InputError("scaled_dot_product_attention with enable_gqa is not supported yet")
    if q.ty.ndim != 4:
        raise InputError(f"scaled_dot_product_attention on rank-{q.ty.ndim} tensors; need rank 4")
    dtype = q.ty.dtype
    perm = [0, 2, 1, 3]  # torch [B, N, S, H] <-> relax [B, S, N, H]
    qt, kt, vt = (bb.emit(relax.op.permute_dims(t, perm)) for t in (q, k, v))
    bias = None
    if mask_node is not None:
        mask = env[mask_node]
        while mask.ty.ndim < 4:
            mask = bb.emit(relax.op.expand_dims(mask, 0))
        if str(mask.ty.dtype) in ("bool", "T.bool"):
            lowest = (
                float(np.finfo(np.dtype(str(dtype).removeprefix("T."))).min)
                if str(dtype).removeprefix("T.") != "bfloat16"
                else -3.3895313892515355e38
            )
            zero = relax.const(0.0, dtype)
            low = relax.const(lowest, dtype)
            mask = bb.emit(relax.op.where(mask, zero, low))
        elif mask.ty.dtype != dtype:
            mask = bb.emit(relax.op.astype(mask, dtype))
        bias = mask
    scale_imm = tirx.FloatImm("float32", float(scale)) if scale is not None else None
    out = bb.emit(
        relax.op.nn.attention(
            qt, kt, vt, bias, scale_imm, causal_mask="TopLeft" if is_causal else None
        )
    )
    return bb.emit(relax.op.permute_dims(out, perm))


def _cumsum_converter(node: Any, importer: Any) -> Any:
    """``aten.cumsum`` with PyTorch's result dtype (a bool or int32 input sums to int64; TVM's
    converter keeps the input dtype, and a bool cumsum does not even compile)."""
    from tvm import relax

    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    val = node.meta.get("val")
    want = str(val.dtype).removeprefix("torch.") if val is not None else None
    have = str(x.ty.dtype).removeprefix("T.")
    if want == "bool":
        want = "int64"
    if want is not None and want != have:
        x = importer.block_builder.emit(relax.op.astype(x, want))
    return importer.block_builder.emit(relax.op.cumsum(x, dim))


def _torch_dtype(node: Any) -> str | None:
    val = node.meta.get("val")
    return str(val.dtype).removeprefix("torch.") if val is not None else None


def _addmm_converter(node: Any, importer: Any) -> Any:
    """``aten.addmm``: accumulate in float32 as TVM's converter does, then come back to the
    model's dtype before the bias (TVM's adds a float16 bias to a float32 product and fails)."""
    from tvm import relax

    bb = importer.block_builder
    bias, x, w = (importer.env[a] for a in node.args[:3])
    alpha = node.kwargs.get("alpha", 1)
    beta = node.kwargs.get("beta", 1)
    want = _torch_dtype(node) or str(x.ty.dtype).removeprefix("T.")
    res = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
    if alpha != 1:
        res = bb.emit(relax.op.multiply(res, relax.const(alpha, "float32")))
    if want != "float32":
        res = bb.emit(relax.op.astype(res, want))
    if beta == 0:
        return res
    if beta != 1:
        bias = bb.emit(relax.op.multiply(bias, relax.const(beta, want)))
    return bb.emit(relax.op.add(bias, res))


def _keep_dtype(name: str) -> Any:
    """Wrap TVM's converter for ``name`` (mm, bmm: float32 products) with a cast back to the
    dtype PyTorch computes in, so float16 models stay float16 between ops."""

    def convert(node: Any, importer: Any) -> Any:
        from tvm import relax

        stock = getattr(importer, "_stackfuse_stock", None)
        if stock is None:
            stock = importer._stackfuse_stock = importer.create_convert_map()
        res = stock[name](node)
        want = _torch_dtype(node)
        if want is not None and want != str(res.ty.dtype).removeprefix("T."):
            res = importer.block_builder.emit(relax.op.astype(res, want))
        return res

    return convert


def _convolution_converter(node: Any, importer: Any) -> Any:
    """``aten.convolution`` (ViT's patch embedding): a 2-D float16 convolution accumulates in
    float32 as TVM's converter does, then comes back to the model's dtype before the bias
    (TVM's adds a float16 bias to the float32 result and fails). Other forms: TVM's."""
    from tvm import relax

    want = _torch_dtype(node)
    args = importer.retrieve_args(node)
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else None
    transposed = bool(args[6]) if len(args) > 6 else False
    if want in (None, "float32") or transposed or len(importer.shape_of(x)) != 4:
        stock = getattr(importer, "_stackfuse_stock", None)
        if stock is None:
            stock = importer._stackfuse_stock = importer.create_convert_map()
        return stock["convolution.default"](node)
    bb = importer.block_builder
    res = bb.emit(
        relax.op.nn.conv2d(
            x,
            w,
            strides=args[3] if len(args) > 3 else 1,
            padding=args[4] if len(args) > 4 else 0,
            dilation=args[5] if len(args) > 5 else 1,
            groups=args[8] if len(args) > 8 else 1,
            data_layout="NCHW",
            kernel_layout="OIHW",
            out_dtype="float32",
        )
    )
    res = bb.emit(relax.op.astype(res, want))
    if importer._is_no_bias(bias):
        return res
    return bb.emit(relax.op.add(res, relax.op.reshape(bias, (1, -1, 1, 1))))


#: our converters for aten ops whose stock TVM conversion loses meaning
CONVERTERS = {
    "convolution.default": _convolution_converter,
    "scaled_dot_product_attention.default": _sdpa_converter,
    "cumsum.default": _cumsum_converter,
    "addmm.default": _addmm_converter,
    "mm.default": _keep_dtype("mm.default"),
    "bmm.default": _keep_dtype("bmm.default"),
    "matmul.default": _keep_dtype("matmul.default"),
    "baddbmm.default": _keep_dtype("baddbmm.default"),
}


def _keep_sdpa_table() -> dict[Any, Any]:
    import torch

    table = torch.export.default_decompositions()
    for op in list(table):
        if "scaled_dot_product" in str(op):
            del table[op]
    return table


def _np(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        raise InputError("bfloat16 weights cannot be stored in .npz; export in float16/float32")
    return t.contiguous().numpy()


def _tensors(model: Any) -> Any:
    yield from model.parameters()
    yield from model.buffers()


def import_torch(
    model: Any,
    example_args: Sequence[Any],
    example_kwargs: dict[str, Any] | None = None,
    *,
    dtype: str | None = None,
    dynamic: Mapping[str, int] | None = None,
) -> Imported:
    """Export ``model`` with ``torch.export`` on the example inputs and convert it to Relax.

    ``dtype`` ("float16", "float32") casts floating weights and inputs first, on a copy: the
    caller's model keeps its dtype and its train/eval mode. Without ``dynamic`` shapes are
    static: the library is built for the example shapes. ``dynamic`` (``{"batch": 8, "seq":
    1024}``, either or both) exports those input axes as ``torch.export.Dim``s up to the given
    bounds (:mod:`worker.dynamic`); the example sizes must be >= 2 and within them.
    """
    import torch

    tvm = import_tvm()
    from tvm.relax.frontend.torch import from_exported_program

    args = tuple(example_args)
    if dtype is not None:
        tdt = getattr(torch, dtype)
        if any(t.is_floating_point() and t.dtype != tdt for t in _tensors(model)):
            # Module.to converts in place: the caller's model keeps its own dtype
            model = copy.deepcopy(model).to(tdt)
        args = tuple(a.to(tdt) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    bounds = dyn.checked(dynamic) if dynamic is not None else {}
    shapes = _dynamic_shapes(model, args, example_kwargs or {}, bounds) if bounds else None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                ep = torch.export.export(
                    model, args, kwargs=example_kwargs or {}, dynamic_shapes=shapes, strict=False
                )
            except torch._dynamo.exc.UserError as exc:  # dynamic-shape constraint violations
                first = str(exc).strip().split("\n")[0][:400]
                raise InputError(
                    f"torch.export refused the dynamic dims {bounds}: {first}"
                ) from None
            ep = ep.run_decompositions(_keep_sdpa_table())
    finally:
        model.train(was_training)
    mod = from_exported_program(
        ep,
        keep_params_as_input=True,
        unwrap_unit_return_tuple=True,
        run_ep_decomposition=False,
        custom_convert_map=CONVERTERS,
    )
    from torch.export.graph_signature import InputKind

    sig = ep.graph_signature
    state = dict(ep.named_parameters())
    params: dict[str, np.ndarray] = {}
    targets: list[str] = []
    user: list[str] = []
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            params[spec.arg.name] = _np(state[spec.target])
            targets.append(str(spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            user.append(spec.arg.name)
    func = mod["main"]
    names = [p.name for p in func.params]
    if names != user + list(params):
        raise InputError(
            "internal: the converted module's parameters do not follow the export's inputs "
            f"({names[:4]}... vs {(user + list(params))[:4]}...)"
        )
    mod, notes = _finish(mod, len(user), bounds)
    func = mod["main"]
    names = [p.name for p in func.params[len(user) :]]
    params = dict(zip(names, params.values(), strict=True))
    inputs = [_input_entry(p) for p in func.params[: len(user)]]
    origins = dict(zip(names, targets, strict=True))
    _ = tvm
    return Imported(mod, params, inputs, f"torch:{type(model).__name__}", notes, origins)


def _dynamic_shapes(
    model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], bounds: Mapping[str, int]
) -> dict[str, Any]:
    """torch.export's ``dynamic_shapes`` for ``bounds``, by argument name: one ``Dim`` per
    dynamic dim, shared by every tensor input's batch/seq axis (:func:`worker.dynamic.axes_of`)."""
    import inspect

    import torch

    dims = {name: torch.export.Dim(name, max=bound) for name, bound in bounds.items()}
    bound_args = inspect.signature(model.forward).bind(*args, **kwargs)
    shapes: dict[str, Any] = {}
    for name, value in bound_args.arguments.items():
        if torch.is_tensor(value):
            axes = dyn.axes_of(value.ndim, bounds)
            for axis, dim in axes.items():
                if not 2 <= value.shape[axis] <= bounds[dim]:
                    raise InputError(
                        f"input {name!r}: example {dim} = {value.shape[axis]} must be within "
                        f"2..{bounds[dim]} (torch.export specializes a size of 1)"
                    )
            shapes[name] = {axis: dims[dim] for axis, dim in axes.items()} or None
        else:
            shapes[name] = None
    return shapes


def _input_entry(p: Any) -> dict[str, Any]:
    shape = [int(d) if hasattr(d, "value") else str(d) for d in p.ty.shape.values]
    return {"name": p.name, "shape": shape, "dtype": str(p.ty.dtype).removeprefix("T.")}


# --------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------
def check_external_data(model: Any, base_dir: Path) -> list[Path]:
    """Refuse external-data locations outside ``base_dir``; return the files they name.

    Checked before anything is read: an absolute path, a ``..`` that climbs out, or a link
    that resolves outside the folder is refused.
    """
    from onnx.external_data_helper import _get_all_tensors

    base = base_dir.resolve()
    files: list[Path] = []
    for tensor in _get_all_tensors(model):
        if tensor.data_location != 1:  # TensorProto.EXTERNAL
            continue
        info = {e.key: e.value for e in tensor.external_data}
        loc = info.get("location", "")
        rel = Path(loc)
        if not loc or rel.is_absolute() or loc.startswith(("/", "\\")) or ":" in rel.parts[0]:
            raise InputError(
                f"ONNX tensor {tensor.name[:80]!r} keeps its data at {loc[:200]!r}: external "
                "data must be a relative path inside the model's folder"
            )
        target = (base / rel).resolve()
        if target != base and base not in target.parents:
            raise InputError(
                f"ONNX tensor {tensor.name[:80]!r} keeps its data at {loc[:200]!r}, which "
                f"resolves outside the model's folder {base}"
            )
        if not target.is_file():
            raise InputError(f"ONNX external data file {loc[:200]!r} does not exist")
        files.append(target)
    return files


def import_onnx(
    path: Path,
    *,
    shape_dict: dict[str, list[int]] | None = None,
    dtype_dict: str | dict[str, str] | None = None,
    dynamic: Mapping[str, int] | None = None,
) -> Imported:
    """Load an ONNX file (external data checked first) and convert it with weights as inputs.

    The file's symbolic dims (``dim_param``) at the inputs' batch/seq axes stay symbolic when
    ``dynamic`` names them (with its bounds); without ``dynamic`` they stay as TVM reads them."""
    import onnx

    tvm = import_tvm()
    from tvm.relax.frontend.onnx import from_onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    if check_external_data(model, path.parent):
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(model, str(path.parent.resolve()))
    constants = _initializers_to_constants(model)
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in inits]
    if dtype_dict is None:
        dtype_dict = {
            i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name
            for i in graph_inputs
        }
    try:
        mod = from_onnx(
            model, shape_dict=shape_dict, dtype_dict=dtype_dict, keep_params_in_input=True
        )
    except Exception as exc:
        if dynamic is None:
            raise
        # TVM's frontend loses the shape of values computed from symbolic dims (a Reshape of
        # Gather(Shape(x)), then of a shapeless tensor): a dynamo export of GPT-2 stops there
        from worker.ingest import tvm_error

        raise tvm_error(
            "TVM's ONNX frontend could not convert the model with symbolic dims (import the "
            "PyTorch model with --dynamic instead, or export the ONNX file with static shapes)",
            exc,
        ) from None
    mod, params_nd = tvm.relax.frontend.detach_params(mod)
    weights = [np.asarray(a.numpy()) for a in params_nd.get("main", [])]
    num_input = len(mod["main"].params) - len(weights)
    originals = [p.name for p in mod["main"].params[num_input:]]
    mod, notes = _finish(mod, num_input, dyn.checked(dynamic) if dynamic is not None else None)
    if constants:
        notes.insert(0, f"{constants} ONNX initializers that are not weights kept as constants")
    func = mod["main"]
    params = {p.name: arr for p, arr in zip(func.params[num_input:], weights, strict=True)}
    inputs = [_input_entry(p) for p in func.params[:num_input]]
    origins = dict(zip(params, originals, strict=True))
    return Imported(mod, params, inputs, f"onnx:{path.name}", notes, origins)


#: ONNX ops whose initializer inputs (at these positions) are model weights
_WEIGHT_INPUTS: dict[str, tuple[int, ...]] = {
    "MatMul": (0, 1),
    "Gemm": (0, 1, 2),
    "Gather": (0,),
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "LayerNormalization": (1, 2),
    "SimplifiedLayerNormalization": (1,),
    "RMSNormalization": (1,),
    "BatchNormalization": (1, 2, 3, 4),
    "InstanceNormalization": (1, 2),
    "GroupNormalization": (1, 2),
}


def _initializers_to_constants(model: Any) -> int:
    """Turn initializers that are not weights (shapes, scales, masks) into Constant nodes.

    With ``keep_params_in_input`` TVM makes *every* initializer a parameter, so a reshape's
    target shape or a causal mask becomes a run-time input and the graph cannot be simplified.
    Weights are the float initializers that a MatMul/Gemm/Gather/Conv/normalization reads, or
    1-D float initializers an Add reads (biases); everything else becomes a constant.
    """
    import onnx

    weights: set[str] = set()
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if i in _WEIGHT_INPUTS.get(node.op_type, ()):
                weights.add(name)
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    bias_like = set()
    for node in model.graph.node:
        if node.op_type == "Add":
            bias_like.update(node.input)
    keep: list[Any] = []
    moved: list[Any] = []
    for t in model.graph.initializer:
        is_weight = t.data_type in floats and (
            t.name in weights or (len(t.dims) == 1 and t.name in bias_like and t.dims[0] > 1)
        )
        (keep if is_weight else moved).append(t)
    if not moved:
        return 0
    nodes = [
        onnx.helper.make_node("Constant", [], [t.name], value=t, name=f"const_{i}")
        for i, t in enumerate(moved)
    ]
    moved_names = {t.name for t in moved}
    inputs = [i for i in model.graph.input if i.name not in moved_names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    existing = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes + existing)
    return len(moved)


# --------------------------------------------------------------------------------------------
# one entry point for the CLI and for Python callers
# --------------------------------------------------------------------------------------------
def _load_entry(ref: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``pkg.module:function`` -> function() returning (model, args) or (model, args, kwargs)."""
    import importlib

    mod_name, _, fn_name = ref.partition(":")
    if not mod_name or not fn_name:
        raise InputError(f"{ref!r}: expected an .onnx/.pt2 file or 'package.module:function'")
    sys.path.insert(0, str(Path.cwd()))
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    finally:
        sys.path.pop(0)
    got = fn()
    if not isinstance(got, tuple) or len(got) not in (2, 3):
        raise InputError(f"{ref} must return (model, args) or (model, args, kwargs)")
    model, args = got[0], tuple(got[1])
    kwargs = dict(got[2]) if len(got) == 3 else {}
    return model, args, kwargs


def import_model(
    source: Any,
    *,
    out: Path,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    dtype: str | None = None,
    dynamic: Mapping[str, int] | None = None,
    check: bool = True,
) -> Path:
    """Import ``source`` and write ``out`` (+ weights and manifest); return ``out``.

    ``source``: a ``torch.nn.Module`` (with ``example_inputs``), a path to an ``.onnx`` file or
    to a ``torch.export``-saved ``.pt2`` program, or ``"package.module:function"`` returning
    ``(model, args[, kwargs])``. ``dynamic`` (``{"batch": 8, "seq": 1024}``) makes those input
    axes symbolic up to the bounds (:mod:`worker.dynamic`). ``check`` runs the service's own
    ingest checks on the result, so a module the service would refuse fails here, with the
    same message.
    """
    imported = import_any(
        source,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        dtype=dtype,
        dynamic=dynamic,
    )
    if check:
        from worker.ingest import load_module

        load_module(import_tvm().ir.save_json(imported.mod), "tvm-json")
    return imported.save(Path(out))


def import_any(
    source: Any,
    *,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    dtype: str | None = None,
    dynamic: Mapping[str, int] | None = None,
) -> Imported:
    if isinstance(source, str | Path) and str(source).endswith(".onnx"):
        return import_onnx(Path(source), dynamic=dynamic)
    if isinstance(source, str | Path) and str(source).endswith(".pt2"):
        import torch

        ep = torch.export.load(str(source))
        return import_torch(
            ep.module(), ep.example_inputs[0], ep.example_inputs[1], dtype=dtype, dynamic=dynamic
        )
    if isinstance(source, str):
        model, args, kwargs = _load_entry(source)
        return import_torch(model, args, kwargs, dtype=dtype, dynamic=dynamic)
    if example_inputs is None:
        raise InputError("a PyTorch module needs example_inputs")
    return import_torch(source, example_inputs, example_kwargs, dtype=dtype, dynamic=dynamic)


# --------------------------------------------------------------------------------------------
# CLI: `stackfuse import MODEL --out model.json [--submit URL]`
# --------------------------------------------------------------------------------------------
def run_cli(args: argparse.Namespace, settings: Any = None) -> int:
    """Exit status as service.cli's: 0 ok, 1 failed, 2 bad input, 3 infrastructure."""
    from service.errors import StackfuseError

    try:
        dynamic = dyn.parse(args.dynamic) if getattr(args, "dynamic", None) else None
        out = import_model(args.model, out=args.out, dtype=args.dtype, dynamic=dynamic)
    except StackfuseError as err:
        print(f"stackfuse: error: {err.type}: {err.message}", file=sys.stderr)
        return 2
    size = out.stat().st_size
    print(f"module: {out} ({size} bytes)")
    print(f"weights: {params_path(out)}")
    if size > BODY_LIMIT_BYTES:
        message = over_limit_message(out.read_text(), size)
        if args.submit:
            print(f"stackfuse: error: {message}", file=sys.stderr)
            return 2
        print(f"warning: {message}", file=sys.stderr)
    if not args.submit:
        return 0
    import httpx

    body = {"module": out.read_text(), "format": "tvm-json", "target": {"arch": args.arch}}
    try:
        r = httpx.post(args.submit.rstrip("/") + "/optimize", json=body, timeout=120.0)
    except httpx.HTTPError as exc:
        print(f"stackfuse: error: cannot reach {args.submit}: {exc}", file=sys.stderr)
        return 3
    if r.status_code != 202:
        print(f"stackfuse: error: HTTP {r.status_code}: {r.text[:400]}", file=sys.stderr)
        return 2 if r.status_code < 500 else 3
    job = r.json()
    print(f"job {job['id']} {job['status']}: {args.submit.rstrip('/')}{job['links']['self']}")
    return 0
