"""Scans (``relax.cumsum``, ``relax.cumprod``): what the checks accept, TVM builds.

The refusals (axes out of range, result dtypes TVM does not build, shapes it cannot lower) are
cases of the hostile corpus (``test_corpus.py``); here every accepted form (each result dtype,
each axis form, exclusive, inputs of dtypes cast by the scan) goes through ingest as TVM JSON,
then is built for LLVM and run against numpy, and, with nvcc, built for CUDA.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service import wire
from tests.hostile import hostile_kit as hk
from worker import ingest

SHAPE = (2, 5)

#: (op, input dtype, result dtype or None, axis, exclusive)
FORMS: list[tuple[str, str, str | None, int | None, bool]] = [
    # on CUDA: TVM's own cumsum kernel along the last axis, topi's scans elsewhere
    *(
        (op, "int32", dtype, axis, False)
        for op in ("cumsum", "cumprod")
        for dtype in sorted(wire.SCAN_DTYPES)
        for axis in (-1, 0)
    ),
    *(("cumsum", "int32", None, axis, False) for axis in (0, 1, -2, None)),
    ("cumprod", "float32", None, None, False),
    ("cumsum", "int32", None, 1, True),
    ("cumprod", "float16", None, 0, True),
    # inputs of dtypes no scan is built in, cast to the result dtype by the scan
    ("cumsum", "bool", "int64", 1, False),
    ("cumsum", "int8", "int32", 1, False),
    ("cumsum", "uint8", "int32", 0, False),
    ("cumsum", "float8_e4m3fn", "float32", 1, False),
]


def _module() -> Any:
    """One function: each form of FORMS on ``x`` (int32, cast to the form's input dtype),
    every result cast to float64."""
    tvm = hk.tvm()
    from tvm import relax

    op = relax.op
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(SHAPE), "int32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = []
            for name, in_dtype, dtype, axis, exclusive in FORMS:
                data = x if in_dtype == "int32" else bb.emit(op.astype(x, in_dtype))
                scanned = bb.emit(getattr(op, name)(data, axis, dtype, exclusive))
                outs.append(bb.emit(op.astype(scanned, "float64")))
            gv = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(gv)
    mod = bb.get()
    return ingest.load_module(tvm.ir.save_json(mod), "tvm-json", hk.settings())


def _expected(a: np.ndarray) -> list[np.ndarray]:
    out = []
    for name, in_dtype, _dtype, axis, exclusive in FORMS:
        data = a.astype(bool) if in_dtype == "bool" else a
        flat = data.reshape(-1) if axis is None else data
        ax = 0 if axis is None else axis
        fn = np.cumsum if name == "cumsum" else np.cumprod
        got = fn(flat.astype(np.float64), axis=ax)
        if exclusive:  # shift by one along the axis, the identity first
            first = np.zeros_like if name == "cumsum" else np.ones_like
            head = first(np.take(got, [0], axis=ax))
            got = np.concatenate([head, np.delete(got, -1, axis=ax)], axis=ax)
        out.append(got)
    return out


def test_every_accepted_scan_runs_on_llvm() -> None:
    tvm = hk.tvm()
    from tvm import relax

    mod = _module()
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    a = np.array([[1, 2, 1, 1, 2], [2, 1, 1, 2, 1]], "int32")
    got = vm["main"](tvm.runtime.tensor(a))
    for i, (form, want) in enumerate(zip(FORMS, _expected(a), strict=True)):
        np.testing.assert_allclose(got[i].numpy(), want, err_msg=str(form))


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_every_accepted_scan_builds_for_cuda(arch: str) -> None:
    """TVM's own kernels only, through the worker's CUDA pipeline (its scans are dispatched
    to TVM's GPU scan kernels): nvcc compiles them, nothing runs."""
    tvm = hk.tvm()
    from worker.build import relax_pipeline

    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host="llvm")
    with target:
        tvm.compile(_module(), target=target, relax_pipeline=relax_pipeline(target))
