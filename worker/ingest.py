"""Turn a client's module into a TVM IRModule that holds only what Stackfuse compiles.

Two formats arrive here, in the job process (never in the API):

- ``tvm-json`` (the wire format): :mod:`service.wire` checks the document against TVM's own
  schema and the limits first; TVM then parses the canonical re-serialization of what was checked.
- ``tvmscript``: TVM's parser *evaluates* the Python expressions in the text (annotations,
  decorators, string shapes...), so the text is first proven harmless by a strict allow-list over
  Python's ``ast`` (:func:`worker.tvmscript_allowlist.validate_tvmscript`); only then is it
  parsed, with a namespace holding nothing but the TVMScript modules. The parsed module is then
  put through the same wire check (saved as JSON) so both formats meet one set of limits and one
  node-type allow-list.

Both end in :func:`check_ir`, an allow-list walk over the loaded IR: Relax functions only, calls
only to allowed operators or to functions of the module, function attributes from a short list,
names that can reach generated code restricted to plain identifiers, and TVM's well-formedness
check. Errors are :class:`service.errors.StackfuseError` subclasses; TVM's own exceptions are
translated here, trimmed, with server paths removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from service import wire
from service.errors import ForbiddenConstruct, InputError, LimitExceeded, StackfuseError
from service.settings import Settings, get_settings
from worker.toolchain import import_tvm
from worker.tvmscript_allowlist import validate_tvmscript

if TYPE_CHECKING:
    import tvm as tvm_types

FORMATS = ("tvm-json", "tvmscript")

#: Function attributes a client may set. Anything else (``Codegen``, ``Composite``,
#: ``Primitive``, ``relax.*`` pass markers...) would steer partitioning or code generation.
#: ``tir_var_upper_bound`` (symbolic dim name -> bound) is what TVM's memory planning sizes
#: buffers of a dynamic-shape module from (``stackfuse import --dynamic`` writes it).
ALLOWED_FUNCTION_ATTRS = frozenset({"global_symbol", "num_input", "tir_var_upper_bound"})

_MAX_MESSAGE = 600


def load_module(
    payload: bytes | str, fmt: str, settings: Settings | None = None
) -> tvm_types.IRModule:
    """The client's module as a checked ``tvm.IRModule``; raise StackfuseError otherwise."""
    settings = settings or get_settings()
    if fmt == "tvm-json":
        _, canonical = wire.checked_module_json(payload, settings)
        tvm = import_tvm(settings)
        try:
            mod = tvm.ir.load_json(canonical)
        except Exception as exc:  # TVM raises its own error types for a bad graph
            raise tvm_error("TVM could not load the module", exc) from None
    elif fmt == "tvmscript":
        text = _script_text(payload, settings)
        checked = validate_tvmscript(text, settings)
        tvm = import_tvm(settings)
        try:
            mod = tvm.script.from_source(checked, extra_vars=tvmscript_namespace())
        except Exception as exc:
            raise tvm_error("TVM could not parse the TVMScript", exc) from None
        if not isinstance(mod, tvm.IRModule):
            raise InputError("the TVMScript must define one @I.ir_module class")
        wire.check_module_json(tvm.ir.save_json(mod), settings)
    else:
        raise InputError(f"unknown module format {wire.show(fmt)}; use one of {', '.join(FORMATS)}")
    if not isinstance(mod, tvm.IRModule):
        raise InputError("the document does not hold an IRModule")
    check_ir(mod, settings)
    return mod


def tvm_error(what: str, exc: BaseException) -> InputError:
    """One TVM exception as an InputError a client may see: first lines, no server paths."""
    text = str(exc).replace("\r", "")
    lines = [ln for ln in text.split("\n") if ln.strip() and not ln.startswith("note: run with")]
    body = "\n".join(lines[:8])
    body = re.sub(r"(?<![\w<])/(?:[\w.+-]+/)+[\w.+-]*", "<path>", body)
    body = "".join(c if c.isprintable() or c == "\n" else "?" for c in body)
    if len(body) > _MAX_MESSAGE:
        body = body[:_MAX_MESSAGE] + "..."
    return InputError(f"{what}: {body}" if body else what, tvm_error=type(exc).__name__)


# --- the loaded IR ---------------------------------------------------------------------------


def check_ir(mod: tvm_types.IRModule, settings: Settings) -> None:
    """Allow-list walk over a loaded module; raise ForbiddenConstruct/InputError on a refusal.

    TVM's own exceptions (a visitor or accessor refusing a malformed node) become InputError.
    """
    try:
        _check_ir(mod, settings)
    except StackfuseError:
        raise
    except Exception as exc:
        raise tvm_error("the module is not well formed", exc) from None


def _check_ir(mod: tvm_types.IRModule, settings: Settings) -> None:
    tvm = import_tvm(settings)
    from tvm import relax

    module_attrs = [str(k) for k in mod.attrs.keys()] if mod.attrs is not None else []  # noqa: SIM118
    if module_attrs:
        raise ForbiddenConstruct(f"module attribute {wire.show(module_attrs[0])} is not accepted")
    if len(mod.global_infos):
        raise ForbiddenConstruct("module global_infos (virtual devices...) are not accepted")
    functions = {str(gv.name_hint): func for gv, func in mod.functions.items()}
    for name, func in functions.items():
        if not isinstance(func, relax.Function):
            kind = "a PrimFunc" if isinstance(func, tvm.tirx.PrimFunc) else type(func).__name__
            raise ForbiddenConstruct(
                f"module contains {kind} {wire.show(name)}; Stackfuse accepts Relax functions only",
                function=name[:80],
            )
        _check_code_name(name, "function name")
        _check_function_attrs(func, name, settings)
    seen_symbols: set[str] = set()
    for name, func in functions.items():
        symbol = func.attrs.get("global_symbol") if func.attrs is not None else None
        if symbol is not None:
            if str(symbol) in seen_symbols:
                raise InputError(f"two functions export the symbol {wire.show(str(symbol))}")
            seen_symbols.add(str(symbol))
        walker = _IRWalker(tvm, relax, settings, set(functions), name)
        walker.walk(func)
        if walker.problem is not None:
            raise walker.problem
    relax.analysis.well_formed(mod)


def _check_code_name(name: str, what: str) -> None:
    if not wire.is_code_name(name):
        raise InputError(
            f"{what} {wire.show(name)} is not accepted: use a letter followed by up to 63 "
            "letters, digits or underscores (not a C/CUDA keyword)",
            name=name[:80],
        )


def _check_function_attrs(func: Any, name: str, settings: Settings) -> None:
    attrs = func.attrs
    if attrs is None:
        return
    for raw_key in attrs.keys():  # noqa: SIM118 - DictAttrs iterates by index, not by key
        key = str(raw_key)
        if key not in ALLOWED_FUNCTION_ATTRS:
            raise ForbiddenConstruct(
                f"function {wire.show(name)} has attribute {wire.show(key)}, which Stackfuse "
                f"does not accept (allowed: {', '.join(sorted(ALLOWED_FUNCTION_ATTRS))})",
                function=name[:80],
                attribute=key[:80],
            )
    symbol = attrs.get("global_symbol")
    if symbol is not None:
        if not isinstance(symbol, str):
            raise InputError(f"function {wire.show(name)}: global_symbol must be a string")
        _check_code_name(str(symbol), "global_symbol")
    bounds = attrs.get("tir_var_upper_bound")
    if bounds is not None:
        _check_upper_bounds(func, name, bounds, settings)
    num_input = attrs.get("num_input")
    if num_input is not None:
        try:
            count = int(num_input)
        except (TypeError, ValueError):
            count = -1
        if not 0 <= count <= len(func.params):
            raise InputError(f"function {wire.show(name)}: num_input must be 0..{len(func.params)}")


def _check_upper_bounds(func: Any, name: str, bounds: Any, settings: Settings) -> None:
    """``tir_var_upper_bound``: a map from the function's own symbolic dims to positive ints
    (TVM plans memory from them; a missing or wrong one would size buffers wrongly)."""
    from tvm import relax

    try:
        items = [(str(k), int(v)) for k, v in bounds.items()]
    except (AttributeError, TypeError, ValueError):
        raise InputError(
            f"function {wire.show(name)}: tir_var_upper_bound must map symbolic dim names to "
            "integers"
        ) from None
    dims = {str(v.name) for v in relax.analysis.defined_symbolic_vars(func)}
    for key, bound in items:
        if key not in dims:
            raise InputError(
                f"function {wire.show(name)}: tir_var_upper_bound names {wire.show(key)}, "
                "which is not a symbolic dim of its parameters"
            )
        if not 1 <= bound <= settings.max_dim:
            raise InputError(
                f"function {wire.show(name)}: tir_var_upper_bound of {wire.show(key)} is "
                f"{bound}; it must be 1..{settings.max_dim}"
            )


@dataclass
class _IRWalker:
    """Visits every expression of one function (TVM's post-order visitor; depth is bounded by
    the wire check). Records the first problem: raising inside TVM's callback would lose it."""

    tvm: ModuleType
    relax: ModuleType
    settings: Settings
    functions: set[str]
    name: str
    problem: StackfuseError | None = None
    _symbolic: set[str] = field(default_factory=set)

    def walk(self, func: Any) -> None:
        for param in func.params:
            self._var(param)
        self.relax.analysis.post_order_visit(func.body, self._visit)

    def _fail(self, exc: StackfuseError) -> None:
        if self.problem is None:
            self.problem = exc

    def _visit(self, expr: Any) -> None:
        if self.problem is not None:
            return
        relax, tvm = self.relax, self.tvm
        try:
            if isinstance(expr, relax.Call):
                self._call(expr)
            elif isinstance(expr, relax.ExternFunc):
                raise ForbiddenConstruct(
                    f"function {wire.show(self.name)} refers to the external function "
                    f"{wire.show(str(expr.global_symbol))}; calls to named functions are refused",
                    function=self.name[:80],
                )
            elif isinstance(expr, relax.Function):
                raise ForbiddenConstruct(
                    f"function {wire.show(self.name)} defines a local function; define it at "
                    "module level instead",
                    function=self.name[:80],
                )
            elif isinstance(expr, relax.Var):
                self._var(expr)
            elif isinstance(expr, tvm.ir.Op):
                self._op(expr)
            self._type(getattr(expr, "ty", None))
        except StackfuseError as exc:
            self._fail(exc)

    def _call(self, call: Any) -> None:
        op = call.op
        if isinstance(op, self.tvm.ir.Op):
            self._op(op)
            if op.name in wire.SCAN_OPS:
                self._scan(call)
        elif isinstance(op, self.relax.GlobalVar):
            if op.name_hint not in self.functions:
                raise ForbiddenConstruct(
                    f"function {wire.show(self.name)} calls {wire.show(op.name_hint)}, which is "
                    "not a function of this module",
                    function=self.name[:80],
                )
        else:
            raise ForbiddenConstruct(
                f"function {wire.show(self.name)} calls a {type(op).__name__}; only Relax "
                "operators and functions of this module may be called",
                function=self.name[:80],
            )

    def _op(self, op: Any) -> None:
        if op.name not in wire.ALLOWED_OPS:
            raise ForbiddenConstruct(
                f"function {wire.show(self.name)} uses operator {wire.show(op.name)}, which "
                "Stackfuse does not accept",
                function=self.name[:80],
                operator=str(op.name)[:80],
            )

    def _scan(self, call: Any) -> None:
        """cumsum/cumprod: one tensor of known shape and dtype (TVM lowers a scan only over a
        shape it knows), the axis within its rank, a result dtype TVM builds a scan in (the
        input is cast to it first, so any input dtype builds)."""
        what = f"function {wire.show(self.name)}: {str(call.op.name).removeprefix('relax.')}"
        ty = call.args[0].ty if len(call.args) == 1 else None
        if (
            not isinstance(ty, self.relax.TensorType)
            or not isinstance(ty.shape, self.relax.ShapeExpr)
            or str(ty.dtype) == "void"
        ):
            raise ForbiddenConstruct(
                f"{what} needs one tensor of known shape and dtype (symbolic dims are fine): "
                "TVM builds a scan only over a shape it knows",
                function=self.name[:80],
                operator=str(call.op.name),
            )
        ndim = len(ty.shape.values)
        axis = call.attrs.axis
        if axis is not None and not -ndim <= int(axis) < ndim:
            raise InputError(
                f"{what} along axis {int(axis)}: out of range for a tensor of {ndim} dims",
                function=self.name[:80],
                axis=int(axis),
            )
        want = str(call.attrs.dtype) if call.attrs.dtype is not None else str(ty.dtype)
        if want not in wire.SCAN_DTYPES:
            given = "" if call.attrs.dtype is not None else " (the input's; set dtype=)"
            raise ForbiddenConstruct(
                f"{what} with result dtype {wire.show(want)}{given} is not accepted: TVM does "
                f"not build it for every target; use one of {', '.join(sorted(wire.SCAN_DTYPES))}",
                function=self.name[:80],
                operator=str(call.op.name),
                dtype=want[:40],
            )

    def _var(self, var: Any) -> None:
        _check_code_name(str(var.name), "variable name")
        self._type(var.ty)

    def _type(self, ty: Any) -> None:
        """Tensor shapes: the wire limits again, and names of symbolic dims."""
        relax = self.relax
        if isinstance(ty, relax.TensorType):
            shape = ty.shape
            if isinstance(shape, relax.ShapeExpr):
                self._dims(list(shape.values))
        elif isinstance(ty, relax.ShapeType) and ty.values is not None:
            self._dims(list(ty.values))
        elif isinstance(ty, relax.TupleType):
            for f in ty.fields:
                self._type(f)
        elif isinstance(ty, relax.FuncType) and ty.params is not None:
            for p in ty.params:
                self._type(p)
            self._type(ty.ret)

    def _dims(self, values: list[Any]) -> None:
        dims: list[int | None] = []
        for v in values:
            if isinstance(v, self.tvm.tirx.IntImm):
                dims.append(int(v.value))
            else:
                dims.append(None)
                for var in self.tvm.tirx.analysis.undefined_vars(v):
                    if var.name not in self._symbolic:
                        _check_code_name(var.name, "symbolic dimension")
                        self._symbolic.add(var.name)
        wire.check_tensor_shape(dims, self.settings, where=f"a tensor in {wire.show(self.name)}")


# --- TVMScript -------------------------------------------------------------------------------


def tvmscript_namespace() -> dict[str, Any]:
    """The only names TVM's parser may resolve: the TVMScript modules, and no builtins."""
    from typing import TypeVar

    import_tvm()
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script import tirx as T

    return {"I": I, "R": R, "T": T, "TypeVar": TypeVar, "__builtins__": {}}


def _script_text(payload: bytes | str, settings: Settings) -> str:
    raw = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else payload
    if len(raw) > settings.max_script_bytes:
        raise LimitExceeded(
            f"TVMScript is {len(raw)} bytes; the limit is {settings.max_script_bytes} "
            "(setting max_script_bytes)",
            setting="max_script_bytes",
            limit=settings.max_script_bytes,
            actual=len(raw),
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"TVMScript is not UTF-8 (byte {exc.start})") from None
