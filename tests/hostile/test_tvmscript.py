"""The TVMScript allow-list accepts what TVM's printer writes and little else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.errors import ForbiddenConstruct, ForbiddenScript, InputError
from tests.hostile import hostile_kit as hk
from worker import ingest, tvmscript_allowlist

REPO = Path(__file__).resolve().parents[2]


def _printed_modules() -> dict[str, object]:
    from tests import models

    # decomposed_attention holds constants; TVM prints attention_var_len's arguments in its
    # own order (seqstart_q, seqstart_k, max_seqlen_q, ...), not the parser's (seqstart_q,
    # max_seqlen_q, seqstart_k, ...), so ragged_attention does not read back as itself
    left_out = ("decomposed_attention", "ragged_attention")
    mods = {name: build() for name, build in hk.SAMPLES.items() if name not in left_out}
    mods["models_stacked_symbolic"] = models.stacked_attention_module(
        "b", 128, 12, 64, causal="TopLeft", scale=0.1
    )
    mods["models_strided_slice"] = models.stacked_attention_module(2, 64, 8, 64, op="strided_slice")
    mods["models_leak_epilogue"] = models.stacked_attention_module(
        2, 64, 8, 64, leak=True, epilogue=True
    )
    mods["models_bias"] = models.attention_module(2, 64, 64, 8, 64, bias_shape=(2, 8, 64, 64))
    return mods


@pytest.mark.parametrize("name", list(_printed_modules()))
def test_printed_modules_round_trip(name: str) -> None:
    """What `mod.script()` prints passes the validator and parses back to the same module."""
    tvm = hk.tvm()
    mod = _printed_modules()[name]
    text = mod.script()  # type: ignore[attr-defined]
    assert tvmscript_allowlist.validate_tvmscript(text, hk.settings()) == text
    back = ingest.load_module(text, "tvmscript", hk.settings())
    tvm.ir.assert_structural_equal(back, mod)


def test_imports_of_the_script_modules_are_accepted_and_blanked() -> None:
    text = (
        "from tvm.script import ir as I\nfrom tvm.script import relax as R\n"
        "from tvm.script import tirx as T\n" + hk.SCRIPT_MODULE
    )
    checked = tvmscript_allowlist.validate_tvmscript(text, hk.settings())
    assert checked.splitlines()[:3] == ["", "", ""]
    assert checked.count("\n") == text.count("\n")  # line numbers in errors stay right
    ingest.load_module(text, "tvmscript", hk.settings())


@pytest.mark.parametrize(
    "line",
    [
        "from tvm.script import relax as R; import os",
        "from tvm.script import relax as Q",
        "from tvm.script import relax",
        "from tvm import relax as R",
        "from .x import R",
        "import tvm.script",
    ],
)
def test_other_imports_are_refused(line: str) -> None:
    with pytest.raises(ForbiddenScript):
        tvmscript_allowlist.validate_tvmscript(line + "\n" + hk.SCRIPT_MODULE, hk.settings())


def test_constructs_of_real_programs_are_accepted() -> None:
    text = '''
n = TypeVar("n")
@I.ir_module
class Module:
    """A docstring."""
    @R.function(private=False)
    def main(x: R.Tensor((n, 8), dtype="float16"), s: R.Shape([2, 2]), o: R.Object,
             p: R.Prim("int64"), t: R.Tuple(R.Tensor((2,), "float32"), R.Any)) -> R.Tensor(ndim=2):
        m = T.int64()
        R.func_attr({"num_input": 1, "global_symbol": "main"})
        with R.dataflow():
            a, b = R.split(x, indices_or_sections=2, axis=0)
            c = R.multiply(a, R.const(-0.5, "float16"))
            d = R.reshape(c, R.shape([n // 2 * 8 + 0 - 0]))
            e: R.Tensor((n * 4,), dtype="float16") = R.nn.softmax(d, axis=-1)
            f = R.const([[1, 2], [3, 4]], "int32")
            R.output(e)
        return e
'''
    tvmscript_allowlist.validate_tvmscript(text, hk.settings())


@pytest.mark.parametrize(
    ("snippet", "why"),
    [
        ("y = R.add(x, x) if True else x", "IfExp"),
        ("y = x and x", "BoolOp"),
        ("y = x < x", "Compare"),
        ("y = R.add(x, x)[0:1]", "subscripts"),
        ("y = R.nn", "Attribute"),
        ("y = R.add(x, x).op", "Attribute"),
        ("y = R.call_tir(x)", "call of"),
        ("y = R.builtin.alloc_tensor(x)", "call of"),
        ("y = R.memory.alloc_storage(x)", "call of"),
        ("y = R.vm.alloc_storage(x)", "call of"),
        ("y = R.print(x)", "call of"),
        ("y = R.const(x)", "literal"),
        ("y = R.Tensor((4,), vdevice='cuda')", "vdevice"),
        ("y = R.Callable([], R.Object)", "call of"),
        ("y = R._private(x)", "only calls"),
        ("y = T.float32(__name__)", "number"),
        ("y = R.add(x, x) @ x", "MatMult"),
        ("y = b'bytes'", "bytes"),
        ("y = 1j", "complex"),
        ("y = ...", "ellipsis"),
        ("R = R.add(x, x)", "rebinding"),
        ("del x", "Delete"),
        ("global x", "Global"),
        ("assert x", "Assert"),
        ("for i in x: pass", "For"),
        ("while x: pass", "While"),
        ("try:\n            pass\n        except Exception:\n            pass", "Try"),
        ("async def f(): pass", "AsyncFunctionDef"),
        ("def inner(): pass", "FunctionDef"),
        ("class Inner: pass", "ClassDef"),
        ("x.y = 1", "Attribute"),
        ("x[0] = 1", "Subscript"),
        ("y = yield x", "Yield"),
        ("y = await x", "Await"),
        ("y = {x}", "Set"),
        ("y = {'a': x}", "Dict"),
        ("y = 10 ** 400", "Pow"),
        ("y = 9223372036854775808", "int64"),
        ("y = 1e999", "non-finite"),
        ("__x = R.add(x, x)", "plain name"),
        ("R.output(x)", "expression statement"),
        ("y = R.add(x, x); R.func_attr({'Codegen': __name__})", "literal"),
    ],
)
def test_python_outside_the_allow_list_is_refused(snippet: str, why: str) -> None:
    text = f"""
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        {snippet}
        return x
"""
    with pytest.raises(ForbiddenScript) as info:
        tvmscript_allowlist.validate_tvmscript(text, hk.settings())
    assert why in info.value.message, info.value.message
    assert info.value.detail["line"] is not None
    assert isinstance(info.value, ForbiddenConstruct) and info.value.type == "forbidden-script"


def test_string_dims_get_the_dim_grammar() -> None:
    base = """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor((DIM, 4), "float32")) -> R.Tensor((DIM, 4), "float32"):
        return x
"""
    for ok in ('"n"', '"n * 2 + 1"', '"n // 4"', "8"):
        tvmscript_allowlist.validate_tvmscript(base.replace("DIM", ok), hk.settings())
    for bad in (
        '"n.real"',
        '"f(n)"',
        '"n if n else 1"',
        '"__import__"',
        '"-1"',
        '"n ** 2"',
        '"[n]"',
        '"n; m"',
        '"x" * 300',
    ):
        with pytest.raises(ForbiddenScript):
            tvmscript_allowlist.validate_tvmscript(base.replace("DIM", bad), hk.settings())


def test_two_modules_or_none_are_refused() -> None:
    with pytest.raises(ForbiddenScript):
        tvmscript_allowlist.validate_tvmscript(hk.SCRIPT_MODULE + hk.SCRIPT_MODULE, hk.settings())
    with pytest.raises(ForbiddenScript):
        tvmscript_allowlist.validate_tvmscript("", hk.settings())


def test_the_validator_needs_no_tvm() -> None:
    code = (
        "import sys\nfrom worker.tvmscript_allowlist import validate_tvmscript\n"
        "from tests.hostile.hostile_kit import SCRIPT_MODULE\n"
        "validate_tvmscript(SCRIPT_MODULE)\n"
        "assert 'tvm' not in sys.modules and 'tvm_ffi' not in sys.modules\n"
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


def test_parse_errors_are_input_errors_with_the_clients_own_text() -> None:
    text = hk.SCRIPT_MODULE.replace("R.nn.relu(x)", "R.nn.relu(x, x)")
    with pytest.raises(InputError) as info:
        ingest.load_module(text, "tvmscript", hk.settings())
    err = info.value
    assert type(err) is InputError, err
    assert "TVM could not parse" in err.message and "/project/" not in err.message
