"""The hostile-input corpus: every case is refused with a structured error by the layer meant to
stop it, and the sentinel file its payload tries to create does not exist afterwards.

Layers: ``wire`` (service.wire, the API's check before anything is queued), ``script`` (the
TVMScript allow-list, before TVM's parser sees the text), ``ingest`` (the IR allow-list after TVM
loaded a well-formed graph). ``test_tvmscript_payloads_are_live`` shows that the code-execution
payloads do run when TVM's parser gets them unchecked, so the sentinel assertions can fail.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from service import wire
from service.errors import (
    ForbiddenConstruct,
    ForbiddenScript,
    InputError,
    LimitExceeded,
    MalformedJSON,
    StackfuseError,
)
from tests.hostile import hostile_kit as hk
from worker import ingest, sandbox, tvmscript_allowlist


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str  # "tvm-json" | "tvmscript"
    build: Callable[[Path], str | bytes]  # sentinel path -> payload
    error: type[StackfuseError]
    layer: str  # "wire" | "script" | "ingest"
    match: str = ""  # a substring of the message
    limits: dict[str, Any] = field(default_factory=dict)


# --- TVMScript ---------------------------------------------------------------------------------


def _script(
    ann: str = 'R.Tensor((4, 8), "float16")',
    ret: str = 'R.Tensor((4, 8), "float16")',
    body: str = "",
    head: str = "",
    deco: str = "@R.function",
    cls: str = "class Module:",
    value: str = "R.add(x, x)",
    params: str = "",
) -> str:
    return f"""{head}
@I.ir_module
{cls}
    {deco}
    def main(x: {ann}{params}) -> {ret}:
        {body}
        with R.dataflow():
            y = {value}
            R.output(y)
        return y
"""


def _run(s: Path) -> str:
    return f'__import__("os").system("touch {s}")'


def _open(s: Path) -> str:
    return f'open("{s}", "w")'


def _subclasses(s: Path) -> str:
    return (
        '[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close"][0]'
        f'.__init__.__globals__["system"]("touch {s}")'
    )


SCRIPT_CASES = [
    Case(
        "script-shape-annotation",
        "tvmscript",
        lambda s: _script(ann=f'R.Tensor((4, {_run(s)}), "float16")'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-string-shape-eval",
        "tvmscript",
        lambda s: _script(ann=f'R.Tensor(({_run(s)!r}, 8), "float16")'.replace("\\'", "'")),
        ForbiddenScript,
        "script",
        "string dimension",
    ),
    Case(
        "script-string-shape-eval-nested",
        "tvmscript",
        lambda s: _script(
            ann="R.Tensor((\"eval('" + _run(s).replace('"', "\\\\'") + '\')", 8), "float16")'
        ),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-dtype-position",
        "tvmscript",
        lambda s: _script(ann=f'R.Tensor((4, 8), {_run(s)} or "float16")'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-dtype-keyword",
        "tvmscript",
        lambda s: _script(ann=f"R.Tensor((4, 8), dtype=str({_open(s)}))"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-return-annotation",
        "tvmscript",
        lambda s: _script(ret=f'R.Tensor(({_run(s)}, 8), "float16")'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-function-decorator",
        "tvmscript",
        lambda s: _script(deco=f"@({_run(s)} or R.function)"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-class-decorator",
        "tvmscript",
        lambda s: _script().replace("@I.ir_module", f"@({_run(s)} or I.ir_module)"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-default-argument",
        "tvmscript",
        lambda s: _script(params=f', z: R.Tensor((4, 8), "float16") = {_open(s)}'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-func-attr-value",
        "tvmscript",
        lambda s: _script(body=f'R.func_attr({{"global_symbol": {_run(s)}}})'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-func-attr-fstring",
        "tvmscript",
        lambda s: _script(body=f"R.func_attr({{\"global_symbol\": f'{{{_run(s)}}}'}})"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-floatimm-argument",
        "tvmscript",
        lambda s: _script(body=f'c = T.FloatImm("float32", {_run(s)})'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-class-base",
        "tvmscript",
        lambda s: _script(cls=f"class Module({_run(s)}):"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-metaclass-keyword",
        "tvmscript",
        lambda s: _script(cls=f"class Module(metaclass={_run(s)}):"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-subclasses-chain",
        "tvmscript",
        lambda s: _script(value=_subclasses(s)),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-dunder-attribute-chain",
        "tvmscript",
        lambda s: _script(value=f'R.add.__globals__["__builtins__"]["exec"]({_run(s)!r})'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-getattr-builtin",
        "tvmscript",
        lambda s: _script(value=f'getattr(__builtins__, "exec")({_run(s)!r})'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-lambda",
        "tvmscript",
        lambda s: _script(value=f"(lambda: {_run(s)})()"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-walrus-in-with",
        "tvmscript",
        lambda s: _script(body=f"(z := {_run(s)})"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-module-level-code",
        "tvmscript",
        lambda s: _script(head=f"import os\nos.system('touch {s}')"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-with-item",
        "tvmscript",
        lambda s: _script().replace("with R.dataflow():", f"with {_open(s)}:"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-if-test",
        "tvmscript",
        lambda s: _script(body=f"if {_run(s)}:\n            pass\n        else:\n            pass"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-symbolic-decl-argument",
        "tvmscript",
        lambda s: _script(body=f"n = T.int64({_run(s)})"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-typevar-argument",
        "tvmscript",
        lambda s: _script(head=f"n = TypeVar({_run(s)})"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-cls-dunder",
        "tvmscript",
        lambda s: _script(body="cls = Module", value=f"cls.__init__.__globals__({_run(s)!r})"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-starred-kwargs",
        "tvmscript",
        lambda s: _script(value=f"R.add(x, **{{'y': {_open(s)}}})"),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-metadata-constant",
        "tvmscript",
        lambda s: _script(value='metadata["relax.expr.Constant"][0]'),
        ForbiddenScript,
        "script",
        "metadata",
    ),
    Case(
        "script-call-packed",
        "tvmscript",
        lambda s: _script(value=f'R.call_packed("system", R.str("touch {s}"), ty_args=R.Object)'),
        ForbiddenScript,
        "script",
        "R.call_packed",
    ),
    Case(
        "script-extern-func",
        "tvmscript",
        lambda s: _script(value='R.ExternFunc("system")'),
        ForbiddenScript,
        "script",
    ),
    Case(
        "script-prim-func-call-extern",
        "tvmscript",
        lambda s: _script(
            cls='class Module:\n    @T.prim_func\n    def evil(A: T.Buffer((4,), "float32")):\n'
            f'        T.evaluate(T.call_extern("int32", "system", "touch {s}"))\n'
        ),
        ForbiddenScript,
        "script",
        "@R.function",
    ),
    Case(
        "script-import-os",
        "tvmscript",
        lambda s: _script(head="from os import system"),
        ForbiddenScript,
        "script",
        "import",
    ),
    Case("script-nul-byte", "tvmscript", lambda s: _script() + "\x00", InputError, "script"),
    Case(
        "script-not-utf8",
        "tvmscript",
        lambda s: _script().encode() + b"\xff\xfe",
        InputError,
        "ingest",
    ),
    Case(
        "script-parentheses-1e5",
        "tvmscript",
        lambda s: _script(value="(" * 100_000 + "x" + ")" * 100_000),
        InputError,
        "script",
    ),
    Case(
        "script-nesting-past-limit",
        "tvmscript",
        lambda s: _script(value="R.add(" * 80 + "x" + ", x)" * 80),
        LimitExceeded,
        "script",
        "max_script_depth",
    ),
    Case(
        "script-too-large",
        "tvmscript",
        lambda s: _script() + "#" * 2048,
        LimitExceeded,
        "ingest",
        "max_script_bytes",
        {"max_script_bytes": 1024},
    ),
    Case(
        "script-scan-axis-past-rank",
        "tvmscript",
        lambda s: _script(value="R.cumsum(x, axis=2)"),
        InputError,
        "ingest",
        "cumsum along axis 2: out of range for a tensor of 2 dims",
    ),
    Case(
        "script-scan-axis-int64-max",
        "tvmscript",
        lambda s: _script(value="R.cumsum(x, axis=9223372036854775807)"),
        InputError,
        "ingest",
        "axis 9223372036854775807 is out of range",
    ),
    Case(
        "script-scan-bool-result",
        "tvmscript",
        lambda s: _script(
            value='R.cumsum(x, axis=0, dtype="bool")', ret='R.Tensor((4, 8), "bool")'
        ),
        ForbiddenConstruct,
        "ingest",
        "result dtype 'bool'",
    ),
]


# --- TVM JSON ----------------------------------------------------------------------------------


def _doc(mutate: Callable[[dict[str, Any]], Any], sample: str = "stacked_attention") -> str:
    doc = hk.graph(sample)
    mutate(doc)
    return json.dumps(doc, separators=(",", ":"))


def _set(doc: dict[str, Any], kind: str, key: str, value: Any) -> None:
    doc["nodes"][hk.find(doc, kind)]["data"][key] = value


def _first_int(doc: dict[str, Any], value: int) -> dict[str, Any]:
    return next(n for n in doc["nodes"] if n["type"] == "int" and n["data"] == value)


def _renamed(name: str) -> Callable[[Path], str]:
    return lambda s: hk.tvm().ir.save_json(hk.stacked_attention(qkv_name=name))


JSON_CASES = [
    Case(
        "json-malformed",
        "tvm-json",
        lambda s: '{"root_index": 0, "nodes": [',
        MalformedJSON,
        "wire",
    ),
    Case(
        "json-truncated-module",
        "tvm-json",
        lambda s: hk.saved("stacked_attention")[: len(hk.saved("stacked_attention")) // 2],
        MalformedJSON,
        "wire",
    ),
    Case("json-not-utf8", "tvm-json", lambda s: b'{"nodes": "\xff"}', MalformedJSON, "wire"),
    Case(
        "json-duplicate-top-key",
        "tvm-json",
        lambda s: hk.saved("stacked_attention").replace(
            '{"root_index"', '{"root_index":0,"root_index"', 1
        ),
        MalformedJSON,
        "wire",
        "duplicate key",
    ),
    Case(
        "json-duplicate-field-key",
        "tvm-json",
        lambda s: hk.saved("stacked_attention").replace('"op":', '"op":0,"op":', 1),
        MalformedJSON,
        "wire",
        "duplicate key",
    ),
    Case(
        "json-nan",
        "tvm-json",
        lambda s: hk.saved("stacked_attention").replace('"data":4}', '"data":NaN}', 1),
        MalformedJSON,
        "wire",
        "NaN",
    ),
    Case(
        "json-infinity",
        "tvm-json",
        lambda s: hk.saved("biased_attention").replace('"value":0.125', '"value":-Infinity', 1),
        MalformedJSON,
        "wire",
    ),
    Case(
        "json-float-overflow",
        "tvm-json",
        lambda s: _doc(lambda d: d.update(metadata={"tvm_version": "x"})).replace(
            '"data":4}', '"data":1e999}', 1
        ),
        InputError,
        "wire",
        "overflows",
    ),
    Case(
        "json-brackets-1e5",
        "tvm-json",
        lambda s: "[" * 100_000 + "]" * 100_000,
        LimitExceeded,
        "wire",
        "max_json_depth",
    ),
    Case(
        "json-legacy-format",
        "tvm-json",
        lambda s: '{"root": 1, "nodes": [], "attrs": {}}',
        InputError,
        "wire",
        "legacy",
    ),
    Case("json-not-a-graph", "tvm-json", lambda s: "[1, 2, 3]", InputError, "wire"),
    Case(
        "json-unknown-node-type",
        "tvm-json",
        lambda s: _doc(lambda d: d["nodes"][5].update(type="runtime.Module")),
        ForbiddenConstruct,
        "wire",
        "runtime.Module",
    ),
    Case(
        "json-wrong-node-type-for-field",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "ir.Call", "op", hk.find(d, "ffi.String"))),
        InputError,
        "wire",
        "field 'op'",
    ),
    Case(
        "json-call-op-is-a-dim",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "ir.Call", "op", hk.find(d, "ir.IntImm"))),
        InputError,
        "wire",
        "field 'op'",
    ),
    Case(
        "json-reference-out-of-range",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "ir.Call", "args", 10**6)),
        InputError,
        "wire",
        "earlier node",
    ),
    Case(
        "json-reference-negative",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "ir.Call", "args", -1)),
        InputError,
        "wire",
    ),
    Case(
        "json-reference-cycle",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "ir.Call", "args", hk.find(d, "ir.Call"))),
        InputError,
        "wire",
        "earlier node",
    ),
    Case(
        "json-root-index-out-of-range",
        "tvm-json",
        lambda s: _doc(lambda d: d.update(root_index=10**9)),
        InputError,
        "wire",
    ),
    Case(
        "json-missing-field",
        "tvm-json",
        lambda s: _doc(lambda d: d["nodes"][hk.find(d, "ir.Call")]["data"].pop("args")),
        InputError,
        "wire",
        "lacks field",
    ),
    Case(
        "json-wrong-attrs-for-op",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "relax.attrs.SplitAttrs", "axis", True)),
        InputError,
        "wire",
    ),
    Case(
        "json-attrs-of-other-op",
        "tvm-json",
        lambda s: _doc(
            lambda d: d["nodes"][hk.find(d, "relax.attrs.AttentionAttrs")].update(
                type="relax.attrs.SoftmaxAttrs", data={"axis": 1}
            )
        ),
        InputError,
        "wire",
        "needs attrs",
    ),
    Case(
        "json-huge-dim",
        "tvm-json",
        lambda s: _doc(lambda d: _first_int(d, 5120).update(data=2**40)),
        LimitExceeded,
        "wire",
        "max_dim",
    ),
    Case(
        "json-int64-overflow",
        "tvm-json",
        lambda s: hk.saved("stacked_attention").replace('"data":5120', '"data":' + "9" * 30, 1),
        InputError,
        "wire",
        "int64",
    ),
    Case(
        "json-element-count-overflow",
        "tvm-json",
        lambda s: _doc(lambda d: [_first_int(d, v).update(data=2**31 - 1) for v in (4, 8, 5120)]),
        LimitExceeded,
        "wire",
        "max_tensor_elements",
    ),
    Case(
        "json-negative-dim",
        "tvm-json",
        lambda s: _doc(lambda d: _first_int(d, 5120).update(data=-5120)),
        InputError,
        "wire",
        "negative",
    ),
    Case(
        "json-rank-past-limit",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "relax.TensorType", "ndim", 64)),
        LimitExceeded,
        "wire",
        "max_tensor_rank",
    ),
    Case(
        "json-ndim-lies",
        "tvm-json",
        lambda s: _doc(lambda d: _set(d, "relax.TensorType", "ndim", 2)),
        InputError,
        "wire",
        "ndim",
    ),
    Case(
        "json-constant-header-lies",
        "tvm-json",
        lambda s: _doc(
            lambda d: d["nodes"][hk.find(d, "ffi.Tensor")].update(
                data=d["nodes"][hk.find(d, "ffi.Tensor")]["data"][:64]
            ),
            "decomposed_attention",
        ),
        InputError,
        "wire",
        "ffi.Tensor",
    ),
    Case(
        "json-constants-past-limit",
        "tvm-json",
        lambda s: hk.saved("decomposed_attention"),
        LimitExceeded,
        "wire",
        "max_constant_bytes",
        {"max_constant_bytes": 100_000},
    ),
    Case(
        "json-too-many-nodes",
        "tvm-json",
        lambda s: hk.saved("stacked_attention"),
        LimitExceeded,
        "wire",
        "max_json_nodes",
        {"max_json_nodes": 100},
    ),
    Case(
        "json-too-many-functions",
        "tvm-json",
        lambda s: hk.saved("script_module"),
        LimitExceeded,
        "wire",
        "max_functions",
        {"max_functions": 1},
    ),
    Case(
        "json-too-many-bindings",
        "tvm-json",
        lambda s: hk.saved("stacked_attention"),
        LimitExceeded,
        "wire",
        "max_bindings",
        {"max_bindings": 3},
    ),
    Case(
        "json-graph-too-deep",
        "tvm-json",
        lambda s: hk.saved("stacked_attention"),
        LimitExceeded,
        "wire",
        "max_ir_depth",
        {"max_ir_depth": 10},
    ),
    Case(
        "json-string-too-long",
        "tvm-json",
        _renamed("q" * 5000),
        LimitExceeded,
        "wire",
        "max_string_bytes",
    ),
    Case("json-nul-in-name", "tvm-json", _renamed("qkv\x00evil"), InputError, "wire", "NUL"),
    Case(
        "json-attr-string-injection",
        "tvm-json",
        lambda s: hk.saved("biased_attention").replace(
            '"data":"TopLeft"', '"data":"TopLeft\\n#include \\"/etc/passwd\\""', 1
        ),
        InputError,
        "wire",
        "short words",
    ),
    Case(
        "json-hostile-function-name",
        "tvm-json",
        lambda s: hk.tvm().ir.save_json(hk.stacked_attention(name='main"\n#include "/etc/passwd')),
        InputError,
        "wire",
        "function name",
    ),
    Case(
        "json-call-packed",
        "tvm-json",
        lambda s: hk.hostile_json("call_packed", s),
        ForbiddenConstruct,
        "wire",
        "ExternFunc",
    ),
    Case(
        "json-call-pure-packed",
        "tvm-json",
        lambda s: hk.hostile_json("call_pure_packed", s),
        ForbiddenConstruct,
        "wire",
        "ExternFunc",
    ),
    Case(
        "json-call-dps-packed",
        "tvm-json",
        lambda s: hk.hostile_json("call_dps_packed", s),
        ForbiddenConstruct,
        "wire",
        "ExternFunc",
    ),
    Case(
        "json-extern-func",
        "tvm-json",
        lambda s: hk.hostile_json("extern_func", s),
        ForbiddenConstruct,
        "wire",
        "ExternFunc",
    ),
    Case(
        "json-primfunc-call-extern-system",
        "tvm-json",
        lambda s: hk.hostile_json("call_extern_primfunc", s),
        ForbiddenConstruct,
        "wire",
        "PrimFunc 'evil'",
    ),
    Case(
        "json-relax-print",
        "tvm-json",
        lambda s: hk.hostile_json("print", s),
        ForbiddenConstruct,
        "wire",
        "relax.print",
    ),
    Case(
        "json-forbidden-op-by-name",
        "tvm-json",
        lambda s: hk.saved("stacked_attention").replace(
            '"relax.split"', '"relax.vm.alloc_storage"'
        ),
        ForbiddenConstruct,
        "wire",
        "relax.vm.alloc_storage",
    ),
    Case(
        "json-codegen-attr",
        "tvm-json",
        lambda s: hk.hostile_json("codegen_attr", s),
        ForbiddenConstruct,
        "ingest",
        "Codegen",
    ),
    Case(
        "json-composite-attr",
        "tvm-json",
        lambda s: hk.hostile_json("composite_attr", s),
        ForbiddenConstruct,
        "ingest",
        "Composite",
    ),
    Case(
        "json-hostile-global-symbol",
        "tvm-json",
        lambda s: hk.hostile_json("hostile_global_symbol", s),
        InputError,
        "ingest",
        "global_symbol",
    ),
    Case(
        "json-call-to-foreign-function",
        "tvm-json",
        lambda s: hk.without_function("helper"),
        ForbiddenConstruct,
        "ingest",
        "not a function of this module",
    ),
]


def _scan_json(**kw: Any) -> Callable[[Path], str]:
    return lambda s: str(hk.tvm().ir.save_json(hk.scan(**kw)))


def _scan_attrs(edit: Callable[[dict[str, Any], dict[str, Any]], Any]) -> Callable[[Path], str]:
    """The scan sample's JSON with ``edit(doc, attrs_data)`` applied to its ScanopAttrs."""

    def build(s: Path) -> str:
        doc = json.loads(hk.tvm().ir.save_json(hk.scan()))
        edit(doc, doc["nodes"][hk.find(doc, "relax.attrs.ScanopAttrs")]["data"])
        return json.dumps(doc, separators=(",", ":"))

    return build


#: cumsum/cumprod: attrs TVM's inference takes but its build does not (or crashes on)
SCAN_CASES = [
    Case(
        "json-scan-axis-int64-max",
        "tvm-json",
        _scan_json(axis=2**63 - 1),
        InputError,
        "wire",
        "axis 9223372036854775807 is out of range for a tensor of at most 8 dims",
    ),
    Case(
        "json-scan-axis-int64-min",
        "tvm-json",
        _scan_json(axis=-(2**63)),
        InputError,
        "wire",
        "out of range",
    ),
    Case(
        "json-scan-axis-past-the-tensors-rank",
        "tvm-json",
        _scan_json(axis=1),
        InputError,
        "ingest",
        "cumsum along axis 1: out of range for a tensor of 1 dims",
    ),
    Case(
        "json-scan-negative-axis-past-the-tensors-rank",
        "tvm-json",
        _scan_json(op="cumprod", axis=-2),
        InputError,
        "ingest",
        "cumprod along axis -2",
    ),
    Case(
        "json-scan-axis-a-string",
        "tvm-json",
        _scan_attrs(lambda doc, a: a.update(axis=hk.find(doc, "ffi.String"))),
        InputError,
        "wire",
        "field 'axis' must be int | None",
    ),
    Case(
        "json-scan-axis-a-float",
        "tvm-json",
        _scan_attrs(lambda doc, a: doc["nodes"][a["axis"]].update(type="float", data=0.5)),
        InputError,
        "wire",
        "field 'axis' must be int | None",
    ),
    Case(
        "json-scan-exclusive-not-a-bool",
        "tvm-json",
        _scan_attrs(lambda doc, a: a.update(exclusive=1)),
        InputError,
        "wire",
        "exclusive must be a JSON bool",
    ),
    Case(
        "json-scan-unknown-attribute",
        "tvm-json",
        _scan_attrs(lambda doc, a: a.update(reverse=True)),
        InputError,
        "wire",
        "has no field 'reverse'",
    ),
    Case(
        "json-scan-attrs-given-to-sum",
        "tvm-json",
        lambda s: hk.tvm().ir.save_json(hk.scan()).replace('"relax.cumsum"', '"relax.sum"'),
        InputError,
        "wire",
        "needs attrs relax.attrs.StatisticalAttrs, not relax.attrs.ScanopAttrs",
    ),
    Case(
        "json-scan-given-split-attrs",
        "tvm-json",
        lambda s: hk.saved("stacked_attention").replace('"relax.split"', '"relax.cumsum"'),
        InputError,
        "wire",
        "needs attrs relax.attrs.ScanopAttrs",
    ),
    Case(
        "json-scan-bool-result",
        "tvm-json",
        _scan_json(dtype="bool"),
        ForbiddenConstruct,
        "wire",
        "result dtype 'bool' is not accepted",
    ),
    Case(
        "json-scan-int8-result",
        "tvm-json",
        _scan_json(dtype="int8"),
        ForbiddenConstruct,
        "wire",
        "result dtype 'int8'",
    ),
    Case(
        "json-scan-float8-result",
        "tvm-json",
        _scan_json(in_dtype="float32", dtype="float8_e4m3fn"),
        ForbiddenConstruct,
        "wire",
        "result dtype 'float8_e4m3fn'",
    ),
    Case(
        "json-scan-void-result",
        "tvm-json",
        _scan_json(dtype="void"),
        InputError,
        "wire",
        "unsupported dtype ''",
    ),
    Case(
        "json-scan-bool-input-no-dtype",
        "tvm-json",
        _scan_json(in_dtype="bool"),
        ForbiddenConstruct,
        "ingest",
        "result dtype 'bool' (the input's; set dtype=)",
    ),
    Case(
        "json-cumprod-uint8-input-no-dtype",
        "tvm-json",
        _scan_json(op="cumprod", in_dtype="uint8"),
        ForbiddenConstruct,
        "ingest",
        "cumprod with result dtype 'uint8'",
    ),
    Case(
        "json-scan-of-unknown-shape",
        "tvm-json",
        _scan_json(shape=None),
        ForbiddenConstruct,
        "ingest",
        "needs one tensor of known shape and dtype",
    ),
]

CASES = SCRIPT_CASES + JSON_CASES + SCAN_CASES


def _stop(case: Case, payload: str | bytes, settings: Any) -> Callable[[], object]:
    if case.layer == "wire":
        return lambda: wire.check_module_json(payload, settings)
    if case.layer == "script":
        text = payload if isinstance(payload, str) else payload.decode()
        return lambda: tvmscript_allowlist.validate_tvmscript(text, settings)
    return lambda: ingest.load_module(payload, case.fmt, settings)


def test_corpus_is_large_and_named_uniquely() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hostile_input_is_refused(case: Case) -> None:
    s = hk.sentinel()
    payload = case.build(s)
    settings = hk.settings(**case.limits)
    if case.layer == "ingest" and case.fmt == "tvm-json":
        wire.check_module_json(payload, settings)  # it gets past the wire check...
    with pytest.raises(StackfuseError) as stopped:
        _stop(case, payload, settings)()  # ...and the layer meant to stop it does
    err = stopped.value
    assert type(err) is case.error, f"{type(err).__name__}: {err.message}"
    assert err.to_dict()["type"] == case.error.type
    assert case.match in err.message
    with pytest.raises(case.error):  # the whole ingest refuses it the same way
        ingest.load_module(payload, case.fmt, settings)
    assert len(err.message) < 2000
    assert not s.exists()


def test_tvmscript_payloads_are_live(tmp_path: Path) -> None:
    """Unchecked, TVM's parser runs these payloads: the sentinel assertions above can fail."""
    live = [
        "script-shape-annotation",
        "script-string-shape-eval",
        "script-return-annotation",
        "script-function-decorator",
        "script-func-attr-value",
        "script-subclasses-chain",
    ]
    cases = {c.name: c for c in SCRIPT_CASES}
    sentinels = {name: tmp_path / f"pwned-{name}" for name in live}
    payloads = {name: cases[name].build(sentinels[name]) for name in live}
    (tmp_path / "payloads.json").write_text(json.dumps(payloads))
    code = (
        "import json, sys\n"
        "from worker.toolchain import import_tvm\n"
        "tvm = import_tvm()\n"
        "for text in json.load(open(sys.argv[1])).values():\n"
        "    try:\n"
        "        tvm.script.from_source(text)\n"
        "    except Exception:\n"
        "        pass\n"
    )
    done = sandbox.run_python(
        code, [str(tmp_path / "payloads.json")], limits=sandbox.Limits(timeout_s=120), cwd=tmp_path
    )
    assert done.returncode == 0, done.output[-2000:]
    ran = sorted(name for name, path in sentinels.items() if path.exists())
    assert ran == sorted(live)
