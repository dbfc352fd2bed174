"""Graph normalization before partitioning, so that exported forms reach the patterns.

Each rewrite that changes the module is reported as a :class:`~worker.report.Rewrite`.
"""

from __future__ import annotations

from service.spec import CompileOptions
from worker.report import Rewrite
from worker.toolchain import import_tvm

import_tvm()

import tvm  # noqa: E402
import tvm_ffi  # noqa: E402
from tvm import relax  # noqa: E402


def normalize(mod: tvm.IRModule, options: CompileOptions) -> tuple[tvm.IRModule, list[Rewrite]]:
    """Put bindings into dataflow blocks (the leak check needs DataflowVars) and canonicalize."""
    rewrites: list[Rewrite] = []
    before = mod
    mod = relax.transform.ConvertToDataflow(min_size=1)(mod)
    mod = relax.transform.CanonicalizeBindings()(mod)
    if not tvm_ffi.structural_equal(before, mod):
        rewrites.append(Rewrite(rewrite="dataflow", message="bindings moved into dataflow blocks"))
    return mod, rewrites
