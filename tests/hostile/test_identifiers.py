"""Names in a Relax module are arbitrary strings. TVM copies variable and symbolic-dim names into
the CUDA it generates (``float* <name>_ptr``, ``int64_t <name>``), so a name holding a newline
and ``#include "/etc/passwd"`` becomes a preprocessor line nvcc obeys. The wire check replaces
every name that is not a plain identifier before TVM loads the module; these tests show the
hostile names reach no generated source, and that without the check they would."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service import wire
from service.spec import CompileOptions
from tests.hostile import hostile_kit as hk
from worker import ingest, sandbox

MARK = "PWNMARK"
HOSTILE = {
    "qkv_name": f'qkv\n#include "/etc/passwd"\n//{MARK}',
    "batch": f"b*/{MARK}/*",
    "out_name": f'o";system("id");//{MARK}',
}


def _hostile_json() -> str:
    return str(hk.tvm().ir.save_json(hk.stacked_attention(**HOSTILE)))  # type: ignore[arg-type]


def test_hostile_names_are_replaced_before_tvm_sees_them() -> None:
    summary, canonical = wire.checked_module_json(_hostile_json(), hk.settings())
    assert summary.renamed == 3
    assert MARK not in canonical and "passwd" not in canonical
    mod = ingest.load_module(_hostile_json(), "tvm-json", hk.settings())
    assert MARK not in mod.script()


def test_plain_names_are_kept() -> None:
    summary, canonical = wire.checked_module_json(hk.saved("decomposed_attention"), hk.settings())
    assert summary.renamed == 0
    assert '"input_ids"' in canonical and '"seq_len"' in canonical


@pytest.mark.parametrize("name", ["int", "threadIdx", "_private", "a" * 65, "x.y", "ünï", ""])
def test_names_that_are_not_code_names(name: str) -> None:
    assert not wire.is_code_name(name)


_BUILD = """
import json, sys
from worker.toolchain import import_tvm
tvm = import_tvm()
import tvm_ffi
from worker import ingest
sources = []

@tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
def capture(code, *_):
    sources.append(code)
    return bytearray(16)

text = open(sys.argv[1]).read()
mod = ingest.load_module(text, "tvm-json") if sys.argv[3] == "ingest" else tvm.ir.load_json(text)
target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
with target:
    lib = tvm.compile(mod, target=target).mod

def walk(m):
    try:
        sources.append(m.inspect_source())
    except Exception:
        pass
    for child in m.imports:
        walk(child)

walk(lib)
open(sys.argv[2], "w").write(json.dumps(sources))
"""


@pytest.mark.parametrize("path", ["ingest", "unchecked"])
def test_hostile_names_reach_no_generated_source(tmp_path: Path, path: str) -> None:
    """TVM's CUDA and host code for the module, built in a child (no nvcc: the CUDA compile
    callback only records the source). ``unchecked`` is the control: TVM loads the module
    directly and the names do reach the CUDA source, so the ``ingest`` assertion can fail."""
    (tmp_path / "mod.json").write_text(_hostile_json())
    out = tmp_path / "sources.json"
    done = sandbox.run_python(
        _BUILD,
        [str(tmp_path / "mod.json"), str(out), path],
        limits=sandbox.Limits(timeout_s=240),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.output[-3000:]
    generated = "\n".join(json.loads(out.read_text()))
    assert "__global__" in generated  # the CUDA kernels are there
    if path == "ingest":
        assert MARK not in generated and "passwd" not in generated
    else:
        assert '#include "/etc/passwd"' in generated


def test_cutlass_codegen_emits_no_client_names() -> None:
    """Our own codegen, given the hostile module straight (no renaming): its kernel source is
    made of numbers and our own symbols only."""
    from worker import partition, selection

    mod = hk.stacked_attention(**HOSTILE)  # type: ignore[arg-type]
    result = partition.partition(mod, CompileOptions())
    assert result.fused, "the stacked attention should be fused"
    for fused in result.fused:
        ks, _ = selection.select_kernel(fused.analysis.spec, "sm_90", "auto")  # type: ignore[arg-type]
        assert MARK not in ks.source and "passwd" not in ks.source
        assert ks.symbol.isidentifier() and MARK not in ks.symbol
