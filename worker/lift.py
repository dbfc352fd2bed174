"""Weights transformed once, never per call.

Computations that depend only on the weights (a transpose TVM would otherwise run at every
call, the ``concat`` of ``combine_qkv``, casts, embedding lookups of constant ids) are lifted out
of ``main`` into ``main_transform_params`` (TVM's ``LiftTransformParams``). A client runs it once
at load and keeps its outputs:

    params = vm["main_transform_params"](params)      # once
    out = vm["main"](*inputs, *params)                # every call

Transposes that a GEMM reads in place are already inside the GEMM's fused function by now and
are never lifted: they cost nothing at any call. Only functions that say which parameters are
weights (the ``num_input`` attribute ``stackfuse import`` sets) are lifted.
"""

from __future__ import annotations

from typing import Any

from worker.report import Rewrite
from worker.toolchain import import_tvm

import_tvm()

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

TRANSFORM = "main_transform_params"
CONVENTION_LIFTED = (
    f"params = {TRANSFORM}(params) once at load, then main(*inputs, *params); "
    "params in the order of the import manifest"
)
CONVENTION_PLAIN = "main(*inputs, *params)"


def _work(func: Any) -> int:
    """Operator calls in ``func`` (tuple plumbing does not count)."""
    n = [0]

    def visit(e: Any) -> None:
        if isinstance(e, relax.Call):
            n[0] += 1

    relax.analysis.post_order_visit(func.body, visit)
    return n[0]


def lift_params(mod: tvm.IRModule) -> tuple[tvm.IRModule, Rewrite | None, str]:
    """(module, the report's entry, the calling convention)."""
    main = mod["main"] if "main" in [gv.name_hint for gv in mod.get_global_vars()] else None
    if main is None or main.attrs is None or "num_input" not in main.attrs:
        return mod, None, CONVENTION_PLAIN
    lifted = relax.transform.LiftTransformParams()(mod)
    n = _work(lifted[TRANSFORM])
    rewrite = Rewrite(
        rewrite="lift_transform_params",
        message=(
            f"{n} computation(s) on weights alone (transposes, concatenations, casts, "
            f"lookups) moved into {TRANSFORM}: run it once at load, not at every call"
        ),
    )
    return lifted, rewrite, CONVENTION_LIFTED
