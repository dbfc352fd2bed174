"""The compiler core as one call: TVM JSON in, a shared library and a fusion report out.

The CLI (`stackfuse compile`) and the RQ task both call :func:`compile_module`; nothing else
orchestrates the stages. Stages run in a fixed order and report progress through ``progress``:

    ingest -> normalize -> partition -> codegen (k of n kernels) -> build -> link -> validate

On a failure after partitioning ran, ``report.json`` is still written to ``out_dir`` with
``error`` set, then the error is raised: clients can see what matched even when a build fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.settings import Settings
from service.spec import CompileOptions, Target
from worker.report import Report

#: progress(stage, fraction_done_overall 0..1, detail) -- detail is e.g. "kernel 2 of 3".
ProgressFn = Callable[[str, float, str], None]

LIBRARY_NAME = "model.so"
REPORT_NAME = "report.json"


@dataclass(frozen=True)
class CompileResult:
    library: Path
    report_path: Path
    report: Report


def compile_module(
    module: bytes | str,
    *,
    target: Target,
    options: CompileOptions,
    out_dir: Path,
    settings: Settings | None = None,
    progress: ProgressFn | None = None,
) -> CompileResult:
    """Compile one serialized Relax module (TVM JSON) into ``out_dir/model.so`` + report.

    Raises only :class:`service.errors.StackfuseError` subclasses: ``InputError`` for a bad or
    hostile module, ``CompileError`` for a deterministic failure, ``InfrastructureError`` when
    the toolchain or machine failed.
    """
    from worker import _pipeline_impl

    return _pipeline_impl.run(
        module,
        target=target,
        options=options,
        out_dir=out_dir,
        settings=settings,
        progress=progress,
    )
