"""The TVMScript allow-list: proves a client's text harmless before TVM's parser sees it.

TVM's parser *evaluates* the Python expressions in a script (annotations, decorators, string
shapes...), so :func:`validate_tvmscript` walks Python's ``ast`` of the text and accepts only the
constructs a Relax module needs; :mod:`worker.ingest` parses what it returns. Runs without TVM.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
import warnings
from dataclasses import dataclass
from typing import NoReturn

from service import wire
from service.errors import ForbiddenScript, InputError, LimitExceeded
from service.settings import Settings, get_settings

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
