"""Turn a client's module into a TVM IRModule that holds only what Stackfuse compiles.

Two formats arrive here, in the job process (never in the API):

- ``tvm-json`` (the wire format): :mod:`service.wire` checks the document against TVM's own
  schema and the limits first; TVM then parses the canonical re-serialization of what was checked.
- ``tvmscript``: TVM's parser *evaluates* the Python expressions in the text (annotations,
  decorators, string shapes...), so the text is first proven harmless by a strict allow-list over
  Python's ``ast`` (:func:`validate_tvmscript`); only then is it parsed, with a namespace holding
  nothing but the TVMScript modules. The parsed module is then put through the same wire check
  (saved as JSON) so both formats meet one set of limits and one node-type allow-list.

Both end in :func:`check_ir`, an allow-list walk over the loaded IR: Relax functions only, calls
only to allowed operators or to functions of the module, function attributes from a short list,
names that can reach generated code restricted to plain identifiers, and TVM's well-formedness
check. Errors are :class:`service.errors.StackfuseError` subclasses; TVM's own exceptions are
translated here, trimmed, with server paths removed.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from service import wire
from service.errors import (
    ForbiddenConstruct,
    ForbiddenScript,
    InputError,
    LimitExceeded,
    StackfuseError,
)
from service.settings import Settings, get_settings
from worker.toolchain import import_tvm

if TYPE_CHECKING:
    import tvm as tvm_types

FORMATS = ("tvm-json", "tvmscript")

#: Function attributes a client may set. Anything else (``Codegen``, ``Composite``,
#: ``Primitive``, ``relax.*`` pass markers...) would steer partitioning or code generation.
ALLOWED_FUNCTION_ATTRS = frozenset({"global_symbol", "num_input"})

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
        _check_function_attrs(func, name)
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


def _check_function_attrs(func: Any, name: str) -> None:
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
    num_input = attrs.get("num_input")
    if num_input is not None:
        try:
            count = int(num_input)
        except (TypeError, ValueError):
            count = -1
        if not 0 <= count <= len(func.params):
            raise InputError(f"function {wire.show(name)}: num_input must be 0..{len(func.params)}")


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


# fmt: off
_DTYPE_ATTRS = frozenset((
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
    "float32", "float64", "bfloat16",
))
# fmt: on
#: R.<name>(...) helpers besides the operators: they build types and literal values only.
_R_HELPERS = frozenset({"const", "shape", "prim_value", "match_cast"})
_R_TYPES = frozenset({"Tensor", "Tuple", "Shape", "Prim", "Object", "Any"})
_IMPORTS = {
    ("tvm.script", "ir", "I"),
    ("tvm.script", "relax", "R"),
    ("tvm.script", "tirx", "T"),
    ("tvm.script", "tir", "T"),
    ("typing", "TypeVar", None),
}
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)


def _op_paths() -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(op.split(".")[1:]) for op in wire.ALLOWED_OPS)


def validate_tvmscript(text: str, settings: Settings | None = None) -> str:
    """Prove ``text`` harmless to TVM's parser, or raise; return the text to parse.

    Accepted: one ``@I.ir_module`` class of ``@R.function`` defs whose statements are bindings,
    ``with R.dataflow()``, ``R.output``, ``R.func_attr``, if/else and return, and whose
    expressions are literals, bound names, tuples/lists, ``name[int]``, integer arithmetic and
    calls of allowed ``R.``/``T.``/``I.`` names (operators from :data:`service.wire.ALLOWED_OPS`).
    Strings inside tensor shapes (which TVM evaluates) must be integer arithmetic over names.
    Imports of the TVMScript modules are accepted and blanked out (TVM's parser refuses them).
    """
    settings = settings or get_settings()
    tree = _parse_script(text, settings)
    checker = _ScriptChecker(settings)
    checker.module(tree)
    if not checker.import_lines:
        return text
    lines = text.split("\n")
    for first, last in checker.import_lines:
        for n in range(first - 1, last):
            lines[n] = ""
    blanked = "\n".join(lines)
    again = _ScriptChecker(settings)
    again.module(_parse_script(blanked, settings))  # what TVM parses is what was checked
    if again.import_lines:
        raise ForbiddenScript("imports must stand on lines of their own")
    return blanked


def _parse_script(text: str, settings: Settings) -> ast.Module:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.parse(text, mode="exec")
    except SyntaxError as exc:
        raise InputError(
            f"TVMScript is not valid Python: {exc.msg} (line {exc.lineno})", line=exc.lineno
        ) from None
    except (RecursionError, MemoryError):
        raise LimitExceeded(
            "TVMScript is nested too deeply for Python's parser",
            setting="max_script_depth",
            limit=settings.max_script_depth,
        ) from None
    except ValueError as exc:  # NUL bytes
        raise InputError(f"TVMScript cannot be parsed: {exc}") from None


@dataclass
class _Scope:
    names: set[str]


class _ScriptChecker:
    """The allow-list. Every method either accepts its node or raises ForbiddenScript."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.import_lines: list[tuple[int, int]] = []
        self.module_names: set[str] = set()
        self.class_name = ""
        self.functions: set[str] = set()
        self.ops = _op_paths()

    # -- structure ----------------------------------------------------------------------------
    def refuse(self, node: ast.AST, why: str) -> NoReturn:
        line = getattr(node, "lineno", None)
        where = f" (line {line})" if line is not None else ""
        raise ForbiddenScript(
            f"TVMScript refused{where}: {why}", line=line, construct=type(node).__name__
        )

    def module(self, tree: ast.Module) -> None:
        classes = 0
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom):
                self._import(stmt)
            elif isinstance(stmt, ast.Assign) and self._is_typevar(stmt):
                self.module_names.add(stmt.targets[0].id)  # type: ignore[attr-defined]
            elif isinstance(stmt, ast.ClassDef):
                classes += 1
                self._class(stmt)
            elif self._is_docstring(stmt):
                continue
            else:
                self.refuse(stmt, f"{type(stmt).__name__} at module level")
        if classes != 1:
            self.refuse(tree, "exactly one @I.ir_module class is expected")

    def _import(self, stmt: ast.ImportFrom) -> None:
        if stmt.level != 0 or stmt.module is None:
            self.refuse(stmt, "relative import")
        for alias in stmt.names:
            if (stmt.module, alias.name, alias.asname) not in _IMPORTS:
                self.refuse(stmt, f"import of {wire.show(stmt.module + '.' + alias.name)}")
        self.import_lines.append((stmt.lineno, stmt.end_lineno or stmt.lineno))

    def _is_typevar(self, stmt: ast.Assign) -> bool:
        """``n = TypeVar("n")``: how TVM's printer declares a symbolic dim at module level."""
        target, value = stmt.targets, stmt.value
        return (
            len(target) == 1
            and isinstance(target[0], ast.Name)
            and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "TypeVar"
            and not value.keywords
            and len(value.args) == 1
            and isinstance(value.args[0], ast.Constant)
            and value.args[0].value == target[0].id
            and self._plain_name(target[0].id)
        )

    @staticmethod
    def _is_docstring(stmt: ast.stmt) -> bool:
        return (
            isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str)
        )

    def _class(self, node: ast.ClassDef) -> None:
        if node.bases or node.keywords:
            self.refuse(node, "a class with bases or keywords (metaclass=...)")
        if len(node.decorator_list) != 1 or self._path(node.decorator_list[0]) != (
            "I",
            "ir_module",
        ):
            self.refuse(node, "the class must be decorated with exactly @I.ir_module")
        if not self._plain_name(node.name):
            self.refuse(node, f"class name {wire.show(node.name)}")
        self.class_name = node.name
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef):
                if not self._plain_name(stmt.name):
                    self.refuse(stmt, f"function name {wire.show(stmt.name)}")
                self.functions.add(stmt.name)
            elif not self._is_docstring(stmt):
                self.refuse(stmt, f"{type(stmt).__name__} in the module class")
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef):
                self._function(stmt)

    def _function(self, node: ast.FunctionDef) -> None:
        if len(node.decorator_list) != 1:
            self.refuse(node, "a function needs exactly one decorator, @R.function")
        dec = node.decorator_list[0]
        if isinstance(dec, ast.Call):
            if self._path(dec.func) != ("R", "function") or dec.args:
                self.refuse(dec, "decorator must be @R.function")
            for kw in dec.keywords:
                if (
                    kw.arg not in ("private", "pure")
                    or not isinstance(kw.value, ast.Constant)
                    or (not isinstance(kw.value.value, bool))
                ):
                    self.refuse(kw, "R.function takes only private=/pure= with True or False")
        elif self._path(dec) != ("R", "function"):
            self.refuse(dec, "decorator must be @R.function")
        a = node.args
        if a.posonlyargs or a.vararg or a.kwonlyargs or a.kw_defaults or a.kwarg or a.defaults:
            self.refuse(node, "parameters must be plain, annotated, without defaults")
        if node.type_comment or node.type_params if hasattr(node, "type_params") else False:
            self.refuse(node, "type comments or type parameters")
        scope = _Scope(set(self.module_names))
        for arg in a.args:
            if not self._plain_name(arg.arg) or arg.annotation is None or arg.type_comment:
                self.refuse(arg, "every parameter needs a plain name and an R. type annotation")
            self._type(arg.annotation, scope, 1, define=True)
        for arg in a.args:
            scope.names.add(arg.arg)
        if node.returns is not None:
            self._type(node.returns, scope, 1, define=True)
        self._body(node.body, scope, depth=1, in_dataflow=False)

    def _body(self, body: list[ast.stmt], scope: _Scope, depth: int, in_dataflow: bool) -> None:
        self._deep(body[0] if body else None, depth)
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                self._assign(stmt, scope, depth)
            elif isinstance(stmt, ast.AnnAssign):
                if not isinstance(stmt.target, ast.Name) or stmt.value is None or not stmt.simple:
                    self.refuse(stmt, "annotated assignment must bind one name to a value")
                self._type(stmt.annotation, scope, depth + 1, define=False)
                self._expr(stmt.value, scope, depth + 1)
                self._bind(stmt.target, scope)
            elif isinstance(stmt, ast.Expr):
                self._statement_call(stmt, scope, depth, in_dataflow)
            elif isinstance(stmt, ast.With):
                if in_dataflow or len(stmt.items) != 1:
                    self.refuse(stmt, "only a single, unnested `with R.dataflow():` is accepted")
                item = stmt.items[0]
                ctx = item.context_expr
                if (
                    item.optional_vars is not None
                    or not isinstance(ctx, ast.Call)
                    or (self._path(ctx.func) != ("R", "dataflow") or ctx.args or ctx.keywords)
                ):
                    self.refuse(stmt, "only `with R.dataflow():` is accepted")
                self._body(stmt.body, scope, depth + 1, in_dataflow=True)
            elif isinstance(stmt, ast.If) and not in_dataflow:
                if not isinstance(stmt.test, ast.Name) or stmt.test.id not in scope.names:
                    self.refuse(stmt, "an if condition must be a bound variable")
                if not stmt.orelse:
                    self.refuse(stmt, "an if needs an else branch")
                self._body(stmt.body, scope, depth + 1, in_dataflow=False)
                self._body(stmt.orelse, scope, depth + 1, in_dataflow=False)
            elif isinstance(stmt, ast.Return) and not in_dataflow:
                if stmt.value is None:
                    self.refuse(stmt, "return needs a value")
                self._expr(stmt.value, scope, depth + 1)
            elif self._is_docstring(stmt):
                continue
            else:
                self.refuse(stmt, f"{type(stmt).__name__} statement")

    def _assign(self, stmt: ast.Assign, scope: _Scope, depth: int) -> None:
        if len(stmt.targets) != 1:
            self.refuse(stmt, "chained assignment")
        target, value = stmt.targets[0], stmt.value
        if (
            isinstance(target, ast.Name)
            and isinstance(value, ast.Name)
            and (target.id == "cls" and value.id == self.class_name)
        ):
            scope.names.add("cls")
            return
        if (
            isinstance(target, ast.Name)
            and isinstance(value, ast.Call)
            and (self._is_symbolic_decl(value))
        ):
            self._bind(target, scope)
            return
        self._expr(value, scope, depth + 1)
        if isinstance(target, ast.Tuple):
            for elt in target.elts:
                if not isinstance(elt, ast.Name):
                    self.refuse(elt, "unpacking may only bind names")
                self._bind(elt, scope)
        elif isinstance(target, ast.Name):
            self._bind(target, scope)
        else:
            self.refuse(target, f"assignment to a {type(target).__name__}")

    def _is_symbolic_decl(self, call: ast.Call) -> bool:
        """``n = T.int64()``: declares a symbolic dim."""
        path = self._path(call.func)
        return (
            path is not None
            and len(path) == 2
            and path[0] == "T"
            and path[1] in _DTYPE_ATTRS
            and not call.args
            and not call.keywords
        )

    def _statement_call(self, stmt: ast.Expr, scope: _Scope, depth: int, in_dataflow: bool) -> None:
        if self._is_docstring(stmt):
            return
        call = stmt.value
        if not isinstance(call, ast.Call):
            self.refuse(stmt, "an expression statement that is not R.output / R.func_attr")
        path = self._path(call.func)
        if path == ("R", "output") and in_dataflow and not call.keywords:
            for arg in call.args:
                if not isinstance(arg, ast.Name) or arg.id not in scope.names:
                    self.refuse(arg, "R.output takes bound variables")
            return
        if (
            path == ("R", "func_attr")
            and not in_dataflow
            and len(call.args) == 1
            and (not call.keywords)
        ):
            attrs = call.args[0]
            if not isinstance(attrs, ast.Dict):
                self.refuse(attrs, "R.func_attr takes a dict literal")
            for k, v in zip(attrs.keys, attrs.values, strict=True):
                if not isinstance(k, ast.Constant) or not isinstance(k.value, str):
                    self.refuse(attrs, "R.func_attr keys must be strings")
                self._literal(v, depth + 2)
            return
        self.refuse(stmt, "an expression statement that is not R.output / R.func_attr")

    def _bind(self, target: ast.expr, scope: _Scope) -> None:
        if not isinstance(target, ast.Name) or not self._plain_name(target.id):
            self.refuse(target, "a binding must be a plain name")
        if target.id in ("R", "T", "I", "cls", "TypeVar"):
            self.refuse(target, f"rebinding {target.id}")
        scope.names.add(target.id)

    # -- expressions --------------------------------------------------------------------------
    def _deep(self, node: ast.AST | None, depth: int) -> None:
        if depth > self.settings.max_script_depth:
            raise LimitExceeded(
                f"TVMScript nests deeper than {self.settings.max_script_depth} "
                f"(line {getattr(node, 'lineno', '?')}; setting max_script_depth)",
                setting="max_script_depth",
                limit=self.settings.max_script_depth,
            )

    def _expr(self, node: ast.expr, scope: _Scope, depth: int) -> None:
        self._deep(node, depth)
        if isinstance(node, ast.Constant):
            self._constant(node)
        elif isinstance(node, ast.Name):
            if node.id not in scope.names:
                self.refuse(node, f"name {wire.show(node.id)} is not a bound variable")
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                self._expr(elt, scope, depth + 1)
        elif isinstance(node, ast.Subscript):
            base: ast.expr = node
            while isinstance(base, ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name) and base.id == "metadata":
                self.refuse(
                    node,
                    "constants (metadata[...]) are not accepted in TVMScript; "
                    "send modules with weights as TVM JSON",
                )
            if (
                not isinstance(node.value, ast.Name)
                or node.value.id not in scope.names
                or not (
                    isinstance(node.slice, ast.Constant)
                    and type(node.slice.value) is int
                    and node.slice.value >= 0
                )
            ):
                self.refuse(node, "only `variable[integer]` subscripts are accepted")
        elif isinstance(node, ast.BinOp):
            if not isinstance(node.op, _ARITH):
                self.refuse(node, f"operator {type(node.op).__name__}")
            self._expr(node.left, scope, depth + 1)
            self._expr(node.right, scope, depth + 1)
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, ast.USub | ast.UAdd):
                self.refuse(node, f"operator {type(node.op).__name__}")
            self._expr(node.operand, scope, depth + 1)
        elif isinstance(node, ast.Call):
            self._call(node, scope, depth)
        else:
            self.refuse(node, f"{type(node).__name__} expression")

    def _call(self, node: ast.Call, scope: _Scope, depth: int) -> None:
        path = self._path(node.func)
        if path is None:
            self.refuse(node, "only calls of R./T./I. names and module functions are accepted")
        for kw in node.keywords:
            if kw.arg is None or not self._plain_name(kw.arg):
                self.refuse(kw, "keyword arguments must be plain names (no **)")
        head, rest = path[0], path[1:]
        if head == "cls":
            if len(rest) != 1 or rest[0] not in self.functions or "cls" not in scope.names:
                self.refuse(node, "cls.<name> must call a function of this module")
        elif head == "R" and rest in self.ops:
            pass
        elif head == "R" and len(rest) == 1 and rest[0] in _R_HELPERS:
            if rest[0] == "const":
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    self._literal(arg, depth + 1)
                return
            if rest[0] == "match_cast":
                if len(node.args) != 2 or node.keywords:
                    self.refuse(node, "R.match_cast(value, type)")
                self._expr(node.args[0], scope, depth + 1)
                self._type(node.args[1], scope, depth + 1, define=False)
                return
        elif head == "R" and len(rest) == 1 and rest[0] in _R_TYPES:
            self._type(node, scope, depth, define=False)
            return
        elif head == "T" and len(rest) == 1 and rest[0] in _DTYPE_ATTRS:
            if node.keywords or len(node.args) > 1:
                self.refuse(node, "T.<dtype>() takes at most one number")
            for arg in node.args:
                self._number(arg)
            return
        else:
            self.refuse(node, f"call of {wire.show('.'.join(path))} is not accepted")
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                self.refuse(arg, "starred arguments")
            self._expr(arg, scope, depth + 1)
        for kw in node.keywords:
            self._expr(kw.value, scope, depth + 1)

    def _type(self, node: ast.expr, scope: _Scope, depth: int, *, define: bool) -> None:
        """A type annotation: R.Tensor/Tuple/Shape/Prim/Object/Any or T.<dtype>."""
        self._deep(node, depth)
        path = self._path(node.func if isinstance(node, ast.Call) else node)
        if path is None:
            self.refuse(node, "a type must be R.Tensor(...), R.Tuple(...), R.Shape(...), ...")
        if not isinstance(node, ast.Call):
            if path in (("R", "Object"), ("R", "Any")) or (
                len(path) == 2 and path[0] == "T" and path[1] in _DTYPE_ATTRS
            ):
                return
            self.refuse(node, f"type {wire.show('.'.join(path))}")
        kws = {kw.arg: kw.value for kw in node.keywords}
        if None in kws or len(kws) != len(node.keywords):
            self.refuse(node, "keyword arguments must be plain names (no **)")
        if path == ("R", "Tensor"):
            if len(node.args) > 2 or set(kws) - {"dtype", "ndim"}:
                self.refuse(node, "R.Tensor(shape, dtype, ndim=...) only (no vdevice)")
            args = list(node.args)
            if args and not (isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)):
                self._shape(args.pop(0), scope, depth + 1, define=define)
            for value in [*args, *([kws["dtype"]] if "dtype" in kws else [])]:
                if not isinstance(value, ast.Constant) or value.value not in wire.DTYPES:
                    self.refuse(value, 'the dtype must be a string such as "float16"')
            if "ndim" in kws:
                self._number(kws["ndim"])
        elif path == ("R", "Tuple"):
            if kws:
                self.refuse(node, "R.Tuple takes types only")
            for arg in node.args:
                self._type(arg, scope, depth + 1, define=define)
        elif path == ("R", "Shape"):
            if len(node.args) > 1 or set(kws) - {"ndim"}:
                self.refuse(node, "R.Shape(dims) or R.Shape(ndim=n)")
            for arg in node.args:
                self._shape(arg, scope, depth + 1, define=define)
            if "ndim" in kws:
                self._number(kws["ndim"])
        elif path == ("R", "Prim"):
            if (
                len(node.args) != 1
                or kws
                or not isinstance(node.args[0], ast.Constant)
                or (node.args[0].value not in wire.DTYPES)
            ):
                self.refuse(node, 'R.Prim("dtype") only')
        elif path in (("R", "Object"), ("R", "Any")):
            if node.args or kws:
                self.refuse(node, f"{'.'.join(path)}() takes no arguments")
        else:
            self.refuse(node, f"type {wire.show('.'.join(path))}")

    def _shape(self, node: ast.expr, scope: _Scope, depth: int, *, define: bool) -> None:
        self._deep(node, depth)
        if isinstance(node, ast.Name):  # a shape variable, or a symbolic dim list elsewhere
            if node.id not in scope.names:
                self.refuse(node, f"name {wire.show(node.id)} is not bound")
            return
        if isinstance(node, ast.Constant) and node.value is None:
            return
        if not isinstance(node, ast.Tuple | ast.List):
            self.refuse(node, "a shape must be a tuple or list of dimensions")
        for dim in node.elts:
            self._dim(dim, scope, depth + 1, define=define)

    def _dim(self, node: ast.expr, scope: _Scope, depth: int, *, define: bool) -> None:
        """One dimension: an int, a symbolic name, integer arithmetic, or the same as a string
        (TVM evaluates string dims with eval(): they get the same grammar, parsed here)."""
        self._deep(node, depth)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if len(node.value) > 200:
                self.refuse(node, "a string dimension longer than 200 characters")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", SyntaxWarning)
                    inner = ast.parse(node.value, mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                self.refuse(node, f"string dimension {wire.show(node.value)} is not arithmetic")
            what = f"string dimension {wire.show(node.value)}: "
            self._dim_expr(node, inner, scope, depth + 1, define=define, what=what)
            return
        self._dim_expr(node, node, scope, depth, define=define)

    def _dim_expr(
        self,
        where: ast.AST,
        node: ast.expr,
        scope: _Scope,
        depth: int,
        *,
        define: bool,
        what: str = "",
    ) -> None:
        self._deep(where, depth)
        if isinstance(node, ast.Constant):
            if type(node.value) is not int or node.value < 0:
                self.refuse(where, what + "a dimension must be a non-negative integer or a name")
        elif isinstance(node, ast.Name):
            if not self._plain_name(node.id):
                self.refuse(where, what + f"dimension name {wire.show(node.id)}")
            if node.id not in scope.names:
                if not define:
                    self.refuse(where, what + f"dimension {wire.show(node.id)} is not bound")
                scope.names.add(node.id)  # a string dim in a signature declares the name
        elif isinstance(node, ast.BinOp) and isinstance(node.op, _ARITH):
            self._dim_expr(where, node.left, scope, depth + 1, define=define, what=what)
            self._dim_expr(where, node.right, scope, depth + 1, define=define, what=what)
        else:
            self.refuse(
                where, what + "a dimension must be an integer, a name, or + - * // % of those"
            )

    def _literal(self, node: ast.expr, depth: int) -> None:
        """Data: numbers, strings, booleans, None, and tuples/lists of those."""
        self._deep(node, depth)
        if isinstance(node, ast.Constant):
            self._constant(node)
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                self._literal(elt, depth + 1)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            self._number(node.operand)
        else:
            self.refuse(node, "only literal values (numbers, strings, tuples, lists) here")

    def _number(self, node: ast.expr) -> None:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            node = node.operand
        if not isinstance(node, ast.Constant) or type(node.value) not in (int, float):
            self.refuse(node, "a number is expected")
        self._constant(node)

    def _constant(self, node: ast.Constant) -> None:
        value = node.value
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, int):
            if abs(value) >= 2**63:
                self.refuse(node, "an integer outside the int64 range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                self.refuse(node, "a non-finite float")
        elif isinstance(value, str):
            if len(value.encode("utf-8", "surrogatepass")) > self.settings.max_string_bytes:
                raise LimitExceeded(
                    f"a string literal is longer than {self.settings.max_string_bytes} bytes "
                    f"(line {node.lineno}; setting max_string_bytes)",
                    setting="max_string_bytes",
                    limit=self.settings.max_string_bytes,
                )
        else:
            self.refuse(node, f"a {type(value).__name__} literal")

    # -- names --------------------------------------------------------------------------------
    def _path(self, node: ast.expr) -> tuple[str, ...] | None:
        """``R.nn.attention`` -> ("R", "nn", "attention"); None unless a chain rooted at R/T/I/cls
        made of plain (non-dunder, non-underscore) names."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            if not self._plain_name(node.attr):
                return None
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in ("R", "T", "I", "cls"):
            return None
        parts.append(node.id)
        return tuple(reversed(parts))

    @staticmethod
    def _plain_name(name: str) -> bool:
        return bool(_PLAIN.match(name)) and not keyword.iskeyword(name)


_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}\Z")


# --- the wire schema, derived from TVM's reflection ------------------------------------------

#: Types TVM writes with a custom ``__data_to_json__`` (a string, not a field object).
CUSTOM_JSON_TYPES = ("ffi.Tensor", "ir.Op", "ir.SourceName")
_POD_ENCODINGS = {0: "none", 1: "int", 2: "bool", 3: "float", 5: "dtype"}
_NOT_OBJECTS = frozenset(
    {"None", "bool", "int", "float", "DataType", "ffi.String", "ffi.Array", "ffi.Map"}
)


def derive_wire_schema() -> dict[
    str, tuple[tuple[str, ...], tuple[tuple[str, str, str, bool], ...]]
]:
    """``type_key -> (ancestors, fields)`` for every allowed object type, from TVM reflection.

    Each field is ``(name, encoding, declared type, has_default)``; ``encoding`` is ``"ref"``
    (a node index) or the JSON literal kind TVM writes inline. Run by
    ``python -m worker.ingest --write-wire-schema``; a test keeps the file in step with TVM.
    """
    import_tvm()
    import tvm_ffi.core as ffi_core  # private API: only at development time, pinned TVM

    out: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str, str, bool], ...]]] = {}
    for key in sorted(wire.ALLOWED_NODE_TYPES - _NOT_OBJECTS):
        info = ffi_core._lookup_or_register_type_info_from_type_key(key)
        chain = []
        t: Any = info
        while t is not None:
            chain.append(t)
            t = t.parent_type_info
        ancestors = tuple(str(t.type_key) for t in chain[1:])
        custom = ffi_core._lookup_type_attr(info.type_index, "__data_to_json__") is not None
        if custom != (key in CUSTOM_JSON_TYPES):
            raise RuntimeError(f"{key}: custom JSON encoding changed; review service/wire.py")
        fields: list[tuple[str, str, str, bool]] = []
        if not custom:
            for t in reversed(chain):
                for f in t.fields:
                    encoding = _POD_ENCODINGS.get(f.field_static_type_index, "ref")
                    fields.append((str(f.name), encoding, str(f.ty), bool(f.c_has_default)))
        out[key] = (ancestors, tuple(fields))
    return out


def _example_call(relax: ModuleType, tvm: ModuleType, op_name: str) -> Any:
    """A call of ``op_name`` built by TVM's own Python constructor, to learn its attrs type."""
    import inspect

    builder: Any = relax.op
    for part in op_name.split(".")[1:]:
        builder = getattr(builder, part)

    def tensor(dtype: str = "float32") -> Any:
        return relax.Var("x", relax.TensorType([2, 2, 2, 2], dtype))

    special: dict[str, tuple[Any, ...]] = {
        "relax.arange": (0, 4),
        "relax.eye": (4,),
        "relax.clip": (
            tensor(),
            relax.prim_value(tvm.tirx.FloatImm("float32", 0.0)),
            relax.prim_value(tvm.tirx.FloatImm("float32", 1.0)),
        ),
        "relax.flip": (tensor(), 0),
        "relax.one_hot": (
            tensor("int64"),
            relax.prim_value(tvm.tirx.FloatImm("float32", 1.0)),
            relax.prim_value(tvm.tirx.FloatImm("float32", 0.0)),
            4,
        ),
        "relax.slice_scatter": (tensor(), tensor(), 0, 1, 1),
        "relax.split": (tensor(), 2),
        "relax.nn.attention_bias": (tensor(), tensor(), tensor(), tensor()),
    }
    if op_name in special:
        return builder(*special[op_name])
    args: list[Any] = []
    for param in inspect.signature(builder).parameters.values():
        if param.default is not inspect.Parameter.empty:
            break
        ann = str(param.annotation)
        if "int" in ann and any(w in ann for w in ("list", "List", "tuple", "Tuple", "Sequence")):
            args.append([0])
        elif "Expr" in ann or "Var" in ann or ann == "<class 'inspect._empty'>":
            args.append(tensor())
        elif "int" in ann:
            args.append(1)
        elif "float" in ann:
            args.append(1.0)
        else:
            args.append("float32")
    return builder(*args)


def derive_op_attrs() -> dict[str, str | None]:
    """``operator -> attrs type key`` (None: no attrs). TVM's op registry does not record this
    for most Relax ops, and a call with missing or foreign attrs crashes TVM's type inference,
    so the wire check needs it: learn it by building one call of each allowed operator."""
    tvm = import_tvm()
    from tvm import relax

    out: dict[str, str | None] = {}
    for name in sorted(wire.ALLOWED_OPS):
        call = _example_call(relax, tvm, name)
        if str(call.op.name) != name:
            raise RuntimeError(f"the constructor of {name} builds {call.op.name}")
        attrs = call.attrs
        out[name] = None if attrs is None else str(type(attrs).__tvm_ffi_type_info__.type_key)
    return out


def render_wire_schema() -> str:
    """The source of :mod:`service.wire_schema`."""
    from importlib.metadata import version

    lines = [
        '"""TVM\'s reflection schema for the node types service.wire accepts. GENERATED: do not',
        "edit; run `python -m worker.ingest --write-wire-schema` after changing the allow-lists",
        'or the pinned TVM (tests/hostile/test_wire.py fails until you do)."""',
        "",
        "# ruff: noqa: E501",
        "# fmt: off",
        "from __future__ import annotations",
        "",
        f"TVM_VERSION = {_py(version('apache-tvm'))}",
        f"TVM_FFI_VERSION = {_py(version('apache-tvm-ffi'))}",
        "",
        "#: type_key -> (ancestors, ((field, encoding, declared type, has_default), ...))",
        "NODE_TYPES: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str, str, bool], ...]]] = {",
    ]
    for key, (ancestors, fields) in derive_wire_schema().items():
        lines.append(f"    {_py(key)}: ({_py(ancestors)}, {_py(fields)}),")
    lines.append("}")
    lines += [
        "",
        "#: operator -> the attrs node type its calls carry (None: no attrs)",
        "OP_ATTRS: dict[str, str | None] = {",
    ]
    for op, attrs in derive_op_attrs().items():
        lines.append(f"    {_py(op)}: {_py(attrs)},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _py(value: Any) -> str:
    """Python source for nested tuples of str/bool/None, double-quoted like ruff format."""
    import json

    if isinstance(value, tuple):
        inner = ", ".join(_py(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m worker.ingest")
    parser.add_argument(
        "--write-wire-schema",
        action="store_true",
        help="regenerate service/wire_schema.py from the installed TVM",
    )
    args = parser.parse_args(argv)
    if args.write_wire_schema:
        target = Path(wire.__file__).with_name("wire_schema.py")
        target.write_text(render_wire_schema())
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
