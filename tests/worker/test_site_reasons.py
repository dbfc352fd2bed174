"""report.site_reasons: attention that is not fused stacked, or not seen at all, says why."""

from __future__ import annotations

from typing import Any

from service.spec import CompileOptions
from worker.partition import partition
from worker.toolchain import import_tvm

tvm = import_tvm()


def _alibi_module() -> Any:
    """Bloom's attention as exported: scores plus a bias computed from an input, softmax,
    matmul (the ``baddbmm`` form). Not constant, so not a site."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import relax as rb
    from tvm.script.parser import relax as R

    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        q = R.arg("q", R.Tensor((8, 64, 32), "float16"))
        k = R.arg("k", R.Tensor((8, 32, 64), "float16"))
        v = R.arg("v", R.Tensor((8, 64, 32), "float16"))
        alibi = R.arg("alibi", R.Tensor((8, 1, 64), "float16"))
        with R.dataflow() as frame:
            scores = R.emit(R.matmul(q, k))
            scaled = R.emit(R.multiply(scores, R.const(0.125, "float16")))
            biased = R.emit(R.add(scaled, alibi))
            probs = R.emit(R.nn.softmax(biased, axis=-1))
            out = R.emit(R.matmul(probs, v))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def test_a_softmax_chain_that_is_not_a_site_is_explained() -> None:
    res = partition(_alibi_module(), CompileOptions())
    assert res.sites == {}
    (reason,) = res.reasons
    assert reason.outcome == "not_attention"
    assert "`add`" in reason.reason and "`multiply`" in reason.reason
    assert "not recognised as attention" in reason.reason
