"""Small real modules for service tests: ``x[2, n] -> reshape -> [n, 2]`` as TVM JSON. They
need no CUTLASS kernel (TVM's one small fatbin comes from the session's kernel cache), so a job
takes seconds, and each ``n`` gives a distinct module with a distinct library."""

from __future__ import annotations

import itertools
from functools import cache

_sizes = itertools.count(8, 8)


@cache
def reshape_module(n: int) -> str:
    from worker.toolchain import import_tvm

    tvm = import_tvm()
    from tvm.script import relax as R
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import relax as rb

    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((2, n), "float16"))
        with R.dataflow() as frame:
            y = R.emit(R.reshape(x, (n, 2)))
            R.output(y)
        R.func_ret_value(frame.output_vars[0])
    return str(tvm.ir.save_json(tvm.IRModule({"main": builder.get()})))


def fresh_reshape() -> str:
    """A reshape module that no earlier test of the session submitted."""
    return reshape_module(next(_sizes))
