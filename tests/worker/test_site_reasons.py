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


def test_a_bias_is_named_by_what_it_masks() -> None:
    """The bias a plain site reads, in words: causal, a window of w keys, all-true, a position
    bias (values other than 0 and masked), or computed from the inputs."""
    import numpy as np
    from tvm import relax

    from worker.partition import _bias_kind

    s = 8
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]

    def const(keep: np.ndarray, values: float | np.ndarray = 0.0) -> Any:
        bias = np.where(keep, values, np.float32(-3.0e4)).astype("float16")
        return relax.const(np.broadcast_to(bias, (2, 1, s, s)).copy())

    assert "causal mask" in _bias_kind(const(j <= i), {})
    window = _bias_kind(const((j <= i) & (j > i - 3)), {})
    assert "sliding-window mask" in window and "last 3 keys" in window
    assert "keeps every key" in _bias_kind(const(np.ones((s, s), bool)), {})
    alibi = _bias_kind(const(j <= i, -0.5 * (i - j).astype("float32")), {})
    assert "position bias" in alibi and "ALiBi" in alibi
    x = relax.Var("mask", relax.TensorType((2, 1, s, s), "float16"))
    assert "computed from the inputs" in _bias_kind(x, {})
