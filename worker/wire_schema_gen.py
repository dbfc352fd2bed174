"""Generates :mod:`service.wire_schema` from the installed TVM's reflection.

The wire check (:mod:`service.wire`) runs in the API without TVM, so what it knows of TVM's node
types (fields, encodings) and of each operator's attrs type is a generated file. Run
``python -m worker.wire_schema_gen --write-wire-schema`` after changing the allow-lists or the
pinned TVM; tests/hostile/test_wire.py fails until the file matches. Development time only.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from service import wire
from worker.toolchain import import_tvm

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
    ``python -m worker.wire_schema_gen --write-wire-schema``; a test keeps the file in step with
    TVM.
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
        "edit; run `python -m worker.wire_schema_gen --write-wire-schema` after changing the",
        'allow-lists or the pinned TVM (tests/hostile/test_wire.py fails until you do)."""',
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

    parser = argparse.ArgumentParser(prog="python -m worker.wire_schema_gen")
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
