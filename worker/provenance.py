"""Which of the module's weights feed a site: how the report finds the user's names for it.

An attention site's weights are those of the projections whose outputs reach its Q, K and V
(through reshapes, splits, slices, bias adds, rotary embedding, ...); a GEMM site's are its own
weight operand (through a transpose, a cast, or the concatenation ``combine_projections``
builds) and its epilogue's. The walk stops at every matmul: the activation side of a projection
leads back into the previous layers, whose weights are not this site's. The weights' names,
mapped through the import manifest, become the report's ``names`` (:mod:`worker.report`).
"""

from __future__ import annotations

from typing import Any

from worker.toolchain import import_tvm

tvm = import_tvm()
from tvm import relax  # noqa: E402

_MATMUL = {"relax.matmul", "relax.nn.linear"}
#: bindings walked back from a site before giving up (rotary tables and masks stay unvisited)
MAX_STEPS = 64


def _weights(func: relax.Function) -> set[Any]:
    """``main``'s parameters after ``num_input`` (all of them when it is not set)."""
    params = list(func.params)
    attrs = dict(func.attrs.items()) if func.attrs is not None else {}
    n = attrs.get("num_input")
    return set(params[int(n) :] if n is not None else params)


class _Walker:
    def __init__(self, func: relax.Function) -> None:
        self.weights = _weights(func)
        self.params = set(func.params)
        self.values: dict[Any, Any] = {}
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b, relax.VarBinding):
                    self.values[b.var] = b.value

    def pure_weights(self, expr: Any, out: list[str], depth: int = 0) -> bool:
        """True when ``expr`` depends on weights and constants alone (then they join ``out``)."""
        if depth > MAX_STEPS:
            return False
        if isinstance(expr, tvm.ir.expr.Constant | relax.ShapeExpr) or not isinstance(
            expr, relax.Var | relax.Tuple | relax.TupleGetItem | relax.Call
        ):
            return True
        if isinstance(expr, relax.Var):
            if expr in self.weights:
                if expr.name not in out:
                    out.append(expr.name)
                return True
            if expr in self.params:
                return False
            value = self.values.get(expr)
            return value is not None and self.pure_weights(value, out, depth + 1)
        if isinstance(expr, relax.Tuple):
            found: list[str] = []
            ok = all(self.pure_weights(f, found, depth + 1) for f in expr.fields)
            if ok:
                out.extend(n for n in found if n not in out)
            return ok
        if isinstance(expr, relax.TupleGetItem):
            return self.pure_weights(expr.tuple_value, out, depth + 1)
        if isinstance(expr, relax.Call) and not self._is_matmul(expr):
            found = []
            ok = all(self.pure_weights(a, found, depth + 1) for a in expr.args)
            if ok:
                out.extend(n for n in found if n not in out)
            return ok
        return False

    @staticmethod
    def _is_matmul(expr: Any) -> bool:
        op = getattr(expr, "op", None)
        return isinstance(op, tvm.ir.Op) and op.name in _MATMUL

    def feeding(self, expr: Any, out: list[str], budget: list[int]) -> None:
        """Weights of the projections that produce ``expr``."""
        budget[0] -= 1
        if budget[0] < 0:
            return
        if isinstance(expr, relax.Var):
            value = self.values.get(expr)
            if value is not None:
                self.feeding(value, out, budget)
            return
        if isinstance(expr, relax.Tuple):
            for f in expr.fields:
                self.feeding(f, out, budget)
            return
        if isinstance(expr, relax.TupleGetItem):
            self.feeding(expr.tuple_value, out, budget)
            return
        if not isinstance(expr, relax.Call):
            return
        if self._is_matmul(expr):
            for a in expr.args:  # the weight side only; the activation side is other layers'
                self.pure_weights(a, out)
            return
        for a in expr.args:
            found: list[str] = []
            if self.pure_weights(a, found):
                if self._after_matmul(expr):  # a projection's bias
                    out.extend(n for n in found if n not in out)
            else:
                self.feeding(a, out, budget)

    def _after_matmul(self, call: Any) -> bool:
        for a in call.args:
            value = self.values.get(a) if isinstance(a, relax.Var) else a
            if value is not None and self._is_matmul(value):
                return True
        return False


def weights_by_site(mod: Any, *, gemm: bool = False) -> dict[str, list[str]]:
    """Site id -> names of the weights feeding it, for every attention site of ``mod`` (the
    module :func:`worker.partition.partition` is given) or, with ``gemm``, every matmul site
    (of the module :func:`worker.gemm_partition.partition_gemms` is given). Sites are tagged
    exactly as the partitioners tag them, so the ids agree with theirs."""
    from worker import gemm_partition, partition

    if gemm:
        tagged, _ = partition.tag_sites(
            mod, gemm_partition._is_matmul, gemm_partition.GEMM_PREFIX, "matmul"
        )
        prefix = gemm_partition.GEMM_PREFIX
    else:
        tagged, _ = partition.tag_sites(mod)
        prefix = partition.SITE_PREFIX
    out: dict[str, list[str]] = {}
    for _, func in tagged.functions.items():
        if not isinstance(func, relax.Function):
            continue
        walker = _Walker(func)
        for value in walker.values.values():
            if not isinstance(value, relax.Call):
                continue
            sid = partition.site_of(value, prefix)
            if sid is None:
                continue
            found: list[str] = []
            args = list(value.args) if gemm else list(value.args)[:3]  # q, k, v; not the mask
            for a in args:
                if gemm:
                    walker.pure_weights(a, found)
                else:
                    walker.feeding(a, found, [MAX_STEPS])
            out[sid] = found
    return out
