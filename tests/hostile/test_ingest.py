"""worker.ingest.check_ir, the allow-list over the loaded IR, on modules built in-process (so
they never met the wire check: this layer must stand on its own)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.errors import ForbiddenConstruct, InputError, LimitExceeded
from tests.hostile import hostile_kit as hk
from worker import ingest


def _script(kind: str) -> Any:
    source = hk.HOSTILE_SCRIPTS[kind].format(S=hk.sentinel())
    return hk.tvm().script.from_source(source, check_well_formed=False)


@pytest.mark.parametrize(
    ("kind", "error", "words"),
    [
        ("call_extern_primfunc", ForbiddenConstruct, "PrimFunc 'evil'"),
        ("call_packed", ForbiddenConstruct, "external function 'system'"),
        ("call_pure_packed", ForbiddenConstruct, "'relax.call_pure_packed'"),
        ("call_dps_packed", ForbiddenConstruct, "'relax.call_dps_packed'"),
        ("extern_func", ForbiddenConstruct, "external function 'system'"),
        ("print", ForbiddenConstruct, "relax.print"),
        ("codegen_attr", ForbiddenConstruct, "attribute 'Codegen'"),
        ("composite_attr", ForbiddenConstruct, "attribute 'Composite'"),
        ("hostile_global_symbol", InputError, "global_symbol 'main\\n#include"),
    ],
)
def test_loaded_ir_allow_list(kind: str, error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info:
        ingest.check_ir(_script(kind), hk.settings())
    assert type(info.value) is error
    assert words in info.value.message, info.value.message  # type: ignore[attr-defined]


def test_local_functions_are_refused() -> None:
    tvm = hk.tvm()
    text = """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        @R.function
        def inner(y: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            return y
        z = inner(x)
        return z
"""
    mod = tvm.script.from_source(text)
    with pytest.raises(ForbiddenConstruct, match="local function"):
        ingest.check_ir(mod, hk.settings())


def test_module_attributes_are_refused() -> None:
    mod = hk.stacked_attention().with_attr("external_mods", ["x"])
    with pytest.raises(ForbiddenConstruct, match="module attribute 'external_mods'"):
        ingest.check_ir(mod, hk.settings())


def test_hostile_variable_names_are_refused_when_they_skipped_the_wire_check() -> None:
    mod = hk.stacked_attention(qkv_name='a"\n#include "/etc/passwd"')
    with pytest.raises(InputError, match="variable name"):
        ingest.check_ir(mod, hk.settings())
    with pytest.raises(InputError, match="symbolic dimension 'threadIdx'"):
        ingest.check_ir(hk.stacked_attention(batch="threadIdx"), hk.settings())


def test_limits_are_checked_again_on_the_loaded_ir() -> None:
    with pytest.raises(LimitExceeded, match="max_dim"):
        ingest.check_ir(hk.stacked_attention(), hk.settings(max_dim=1000))


def test_ill_formed_modules_are_input_errors() -> None:
    """A graph that passes the wire check but uses a variable before defining it."""
    doc = hk.graph("stacked_attention")
    nodes = doc["nodes"]
    block = next(n for n in nodes if n["type"] == "relax.expr.DataflowBlock")
    bindings = nodes[block["data"]["bindings"]]["data"]
    bindings[0], bindings[-1] = bindings[-1], bindings[0]
    with pytest.raises(InputError, match="not well formed"):
        ingest.load_module(json.dumps(doc), "tvm-json", hk.settings())


def test_unknown_format() -> None:
    with pytest.raises(InputError, match="unknown module format 'onnx'"):
        ingest.load_module(b"", "onnx", hk.settings())


def test_tvm_errors_are_trimmed_and_hold_no_server_paths() -> None:
    exc = RuntimeError(
        'Traceback (most recent call last):\n  File "/project/src/relax/ir/x.cc", line 3\n'
        + "\n".join(f"frame {i} in /usr/lib/libtvm.so" for i in range(50))
        + "\x1b[31m"
        + "y" * 5000
    )
    err = ingest.tvm_error("TVM could not load the module", exc)
    assert "/project" not in err.message and "/usr/lib" not in err.message
    assert "<path>" in err.message and "\x1b" not in err.message
    assert len(err.message) < 800
    assert err.detail["tvm_error"] == "RuntimeError"
