"""service.wire on real modules: what it accepts, what it counts, and that its schema is TVM's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service import wire, wire_schema
from service.errors import InputError, LimitExceeded, MalformedJSON
from tests.hostile import hostile_kit as hk
from worker import ingest, wire_schema_gen

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(hk.SAMPLES))
def test_real_modules_pass_and_round_trip(name: str) -> None:
    """The canonical text TVM gets loads into the very module that was saved."""
    tvm = hk.tvm()
    summary, canonical = wire.checked_module_json(hk.saved(name), hk.settings())
    assert summary.nodes == len(hk.graph(name)["nodes"])
    assert summary.renamed == 0
    tvm.ir.assert_structural_equal(tvm.ir.load_json(canonical), hk.SAMPLES[name]())


def test_summary_counts() -> None:
    summary = wire.check_module_json(hk.saved("decomposed_attention"), hk.settings())
    float32_elements = 64 * 128 + 128 + 128 * 384 + 2 * 128 * 256 + 2 * 128 + 1
    assert summary.functions == 1
    assert summary.constant_bytes == 4 * float32_elements
    assert summary.bindings == 28
    assert len(summary.sha256) == 64
    script = wire.check_module_json(hk.saved("script_module"), hk.settings())
    assert script.functions == 2


def test_bytes_and_str_give_the_same_answer() -> None:
    text = hk.saved("stacked_attention")
    assert wire.check_module_json(text, hk.settings()) == wire.check_module_json(
        text.encode(), hk.settings()
    )


def test_models_of_the_test_suite_pass() -> None:
    """The lead's fixtures (tests/models.py) are what clients send; none may be refused."""
    from tests import models

    for mod in (
        models.stacked_attention_module(4, 128, 12, 64),
        models.stacked_attention_module("b", 128, 12, 64, causal="TopLeft", scale=0.1),
        models.stacked_attention_module(2, 64, 8, 64, op="strided_slice"),
        models.stacked_attention_module(2, 64, 8, 64, leak=True, epilogue=True, dtype="bfloat16"),
        models.attention_module(2, 64, 64, 8, 64, bias_shape=(2, 8, 64, 64)),
    ):
        ingest.load_module(models.to_json(mod), "tvm-json", hk.settings())


def test_brackets_inside_strings_do_not_count() -> None:
    text = hk.tvm().ir.save_json(hk.stacked_attention(qkv_name="[" * 1000 + "{" * 1000))
    summary = wire.check_module_json(text, hk.settings(max_string_bytes=4096))
    assert summary.renamed == 1


def test_tensor_shape_uses_exact_integers() -> None:
    s = hk.settings()
    wire.check_tensor_shape([2**31 - 1, 512], s, where="t")
    with pytest.raises(LimitExceeded) as big:
        wire.check_tensor_shape([2**62, 2**62, 0], s, where="t")
    assert big.value.detail["setting"] == "max_dim"
    with pytest.raises(LimitExceeded) as many:
        wire.check_tensor_shape([2**31 - 1] * 3, s, where="t")
    assert many.value.detail == {
        "setting": "max_tensor_elements",
        "limit": 2**40,
        "actual": (2**31 - 1) ** 3,
    }
    wire.check_tensor_shape([None, 2**31 - 1, None], s, where="t")
    with pytest.raises(InputError):
        wire.check_tensor_shape([-1], s, where="t")


def test_a_limit_error_names_its_setting() -> None:
    with pytest.raises(LimitExceeded) as info:
        wire.check_module_json(hk.saved("stacked_attention"), hk.settings(max_tensor_rank=3))
    err = info.value
    assert err.detail["setting"] == "max_tensor_rank" and err.detail["limit"] == 3
    assert err.detail["actual"] == 4 and isinstance(err.detail["node"], int)
    assert "max_tensor_rank" in err.message and err.status == 413


def test_constant_of_a_forbidden_dtype_is_refused() -> None:
    tvm = hk.tvm()
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2], "float16"))
    with bb.function("main", [x]):
        c = relax.const(np.zeros((2,), "float32"))
        bb.emit_func_output(bb.emit(relax.op.add(x, relax.op.astype(c, "float16"))))
    doc = json.loads(tvm.ir.save_json(bb.get()))
    wire.check_module_json(json.dumps(doc), hk.settings())
    tensor = next(n for n in doc["nodes"] if n["type"] == "ffi.Tensor")
    import base64

    blob = bytearray(base64.b64decode(tensor["data"]))
    blob[28] = 5  # DLPack type code 5 (complex)
    tensor["data"] = base64.b64encode(bytes(blob)).decode()
    with pytest.raises(InputError, match="unsupported dtype"):
        wire.check_module_json(json.dumps(doc), hk.settings())


def test_every_allowed_op_is_one_tvm_lowers() -> None:
    """LegalizeOps lowers every allowed op but the scans; those TVM's library dispatch lowers,
    which the CUDA pipeline the worker builds with runs first."""
    tvm = hk.tvm()
    from tvm import relax

    from worker.build import relax_pipeline

    for name in wire.ALLOWED_OPS - wire.SCAN_OPS:
        assert tvm.ir.Op.get(name).get_attr("FLegalize") is not None, name
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    for name in wire.SCAN_OPS:
        assert tvm.ir.Op.get(name).get_attr("FLegalize") is None, name  # else: move it up
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType([4, 3], "int32"))
        with bb.function("main", [x]):
            bb.emit_func_output(bb.emit(getattr(relax.op, name.removeprefix("relax."))(x, 1)))
        lowered = relax_pipeline(target)(bb.get())  # Relax passes only: no nvcc
        assert name not in lowered["main"].script(), name
    assert set(wire_schema.OP_ATTRS) == set(wire.ALLOWED_OPS)
    assert {a for a in wire_schema.OP_ATTRS.values() if a} == set(wire.ATTRS_TYPES)


def test_wire_schema_is_generated_from_this_tvm() -> None:
    """service/wire_schema.py matches TVM's reflection; regenerate with
    `python -m worker.wire_schema_gen --write-wire-schema` when this fails."""
    assert wire_schema_gen.render_wire_schema() == Path(wire_schema.__file__).read_text()


def test_wire_imports_no_tvm(tmp_path: Path) -> None:
    """The API checks modules without TVM in its process."""
    module = tmp_path / "module.json"
    module.write_text(hk.saved("stacked_attention"))
    code = (
        "import sys\nfrom service import wire\nfrom service.settings import Settings\n"
        f"wire.check_module_json(open({str(module)!r}).read(), Settings())\n"
        "assert 'tvm' not in sys.modules and 'tvm_ffi' not in sys.modules, 'TVM imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# --- the shape scan before json.loads -------------------------------------------------------------
def _shape(doc: bytes, depth: int = 64, values: int = 1000) -> wire.JsonShape:
    return wire.check_json_shape(doc, max_depth=depth, max_values=values)


def _true_depth(doc: object) -> int:
    if isinstance(doc, dict):
        return 1 + max(map(_true_depth, doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max(map(_true_depth, doc), default=0)
    return 0


@pytest.mark.parametrize(
    "doc",
    [
        b"1",
        b'"[[[["',
        b"[]",
        b'{"a": [1, {"b": [[]]}], "c": "]]]}"}',
        b"[" * 20 + b"]" * 20,  # deeper than the pair passes: the prefix sum finishes it
        b"[" + b",".join([b"[" * 30 + b"]" * 30, b"[[]]", b"[" * 12 + b"]" * 12]) + b"]",
        b'["\\"[", "\\\\", "\\u005b"]',  # escaped quotes and backslashes stay inside strings
    ],
)
def test_shape_scan_measures_depth_and_values_exactly(doc: bytes) -> None:
    parsed = json.loads(doc)
    shape = _shape(doc)
    assert shape.depth == _true_depth(parsed)
    assert shape.values >= 1


def test_shape_scan_counts_values_as_an_upper_bound() -> None:
    doc = json.dumps([[1, 2, "a,b,[c]"], {"k": [None, True]}]).encode()
    assert _shape(doc).values == 9  # exact for valid JSON with no empty array or object
    assert _shape(b"[[], {}]").values == 5  # 3 values: an empty container counts one extra
    with pytest.raises(LimitExceeded) as info:
        wire.check_json_shape(doc, max_depth=64, max_values=5, values_setting="max_json_values")
    assert info.value.detail == {"setting": "max_json_values", "limit": 5, "actual": 9}


def test_shape_scan_refuses_depth_past_the_limit() -> None:
    _shape(b"[" * 64 + b"]" * 64)
    with pytest.raises(LimitExceeded) as info:
        wire.check_json_shape(
            b"[" * 65 + b"]" * 65, max_depth=64, max_values=1000, depth_setting="max_json_depth"
        )
    assert info.value.detail["actual"] == 65 and info.value.detail["setting"] == "max_json_depth"


def test_shape_scan_refuses_long_numbers() -> None:
    _shape(b"[9223372036854775807, -1.5e300]")
    with pytest.raises(InputError, match="more than 19 digits"):
        _shape(b"[1" + b"0" * 19 + b"]")
    with pytest.raises(InputError):
        _shape(b'{"a": ' + b"7" * 4301 + b"}")


def test_shape_scan_is_not_fooled_by_unbalanced_brackets() -> None:
    with pytest.raises(MalformedJSON):
        _shape(b"[" + b"]" * 5000)
    _shape(b'{"module": ')  # short and broken: left to the parser, which names the position


def test_module_of_nested_arrays_is_refused_before_it_is_parsed() -> None:
    """The shape that cost ~46x its size in json.loads: refused by count, nothing parsed."""
    nested = b"[" + (b"[" * 40 + b"]" * 40 + b",") * 20_000 + b"[]]"
    with pytest.raises(LimitExceeded) as info:
        wire.check_module_json(nested, hk.settings(max_json_values=100_000))
    assert info.value.detail["setting"] == "max_json_values"


def test_real_modules_are_well_inside_the_value_limit() -> None:
    for name in hk.SAMPLES:
        text = hk.saved(name).encode()
        nodes = len(hk.graph(name)["nodes"])
        assert _shape(text, values=10**9).values < 8 * nodes
