"""The compiler core as one call: TVM JSON in, a shared library and a fusion report out.

The CLI (`stackfuse compile`) and the RQ task both call :func:`compile_module`; nothing else
orchestrates the stages. Stages run in a fixed order and report progress through ``progress``:

    ingest -> normalize -> partition -> codegen (k of n kernels) -> build -> link -> validate

On a failure after partitioning ran, ``report.json`` is still written to ``out_dir`` with
``error`` set, then the error is raised: clients can see what matched even when a build fails.
This is also the one boundary where foreign errors (TVM's) become our own.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.errors import CompileError, StackfuseError
from service.settings import Settings, get_settings
from service.spec import CompileOptions, Target, toolchain_versions
from worker.kernel_source import CompiledKernel
from worker.report import (
    DynamicDim,
    KernelChoice,
    Library,
    Report,
    Summary,
    UserNames,
    Validation,
    fill_verdicts,
    layer_of,
    names_for,
)

#: progress(stage, fraction_done_overall 0..1, detail) -- detail is e.g. "kernel 2 of 3".
ProgressFn = Callable[[str, float, str], None]

LIBRARY_NAME = "model.so"
REPORT_NAME = "report.json"

# Where each stage starts on the 0..1 progress scale (codegen dominates a cold compile).
_STAGE_START = {
    "ingest": 0.0,
    "normalize": 0.05,
    "partition": 0.08,
    "codegen": 0.12,
    "build": 0.70,
    "link": 0.88,
    "validate": 0.92,
    "done": 1.0,
}


@dataclass(frozen=True)
class CompileResult:
    library: Path
    report_path: Path
    report: Report


def _write_report(report: Report, out_dir: Path) -> Path:
    path = out_dir / REPORT_NAME
    tmp = out_dir / f".{REPORT_NAME}.{os.getpid()}.tmp"
    tmp.write_text(report.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def _foreign(exc: BaseException, stage: str) -> StackfuseError:
    """TVM (or anything else) failed: keep the first lines, name the stage."""
    text = str(exc).strip().splitlines()
    head = next((ln for ln in reversed(text) if ln.strip()), type(exc).__name__)[:500]
    return CompileError(f"TVM failed during {stage}: {head}", stage=stage)


def compile_module(
    module: bytes | str,
    *,
    target: Target,
    options: CompileOptions,
    out_dir: Path,
    settings: Settings | None = None,
    progress: ProgressFn | None = None,
    fmt: str = "tvm-json",
    library_file: str = LIBRARY_NAME,
    origins: dict[str, str] | None = None,
) -> CompileResult:
    """Compile one serialized Relax module into ``out_dir/model.so`` + ``out_dir/report.json``.

    ``library_file`` is the name the report gives the library (the service's download name);
    ``origins`` (parameter -> state-dict key or ONNX name, from an import manifest) gives the
    report the user's names of each site.

    Raises only :class:`service.errors.StackfuseError` subclasses: ``InputError`` for a bad or
    hostile module, ``CompileError`` for a deterministic failure, ``InfrastructureError`` when
    the toolchain or machine failed.
    """
    settings = settings or get_settings()
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = module.encode() if isinstance(module, str) else module
    report = Report(
        input_sha256=hashlib.sha256(payload).hexdigest(),
        target=target.model_dump(mode="json"),
        toolchain=toolchain_versions(),
    )
    partitioned = False
    current = ["ingest"]
    started = time.monotonic()

    def say(stage: str, detail: str = "", within: float = 0.0) -> None:
        current[0] = stage
        if progress is None:
            return
        start = _STAGE_START[stage]
        nxt = min((v for v in _STAGE_START.values() if v > start), default=1.0)
        progress(stage, start + (nxt - start) * within, detail)

    @contextmanager
    def timed(stage: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            key = f"{stage}_s"
            report.timings[key] = round(report.timings.get(key, 0.0) + time.monotonic() - t0, 4)

    try:
        say("ingest")
        with timed("ingest"):
            from worker.ingest import load_module  # imports TVM (via toolchain) on first use

            mod = load_module(payload, fmt, settings)
        from worker import (
            build,
            dynamic,
            gemm_families,
            gemm_partition,
            lift,
            normalize,
            nvcc,
            selection,
            validate,
        )

        if "main" in [gv.name_hint for gv in mod.get_global_vars()]:
            report.dynamic = [DynamicDim(**d) for d in dynamic.describe(mod["main"])]
        say("normalize")
        with timed("normalize"):
            if options.normalize:
                mod, rewrites = normalize.normalize(mod, options, target.arch)
                report.normalizations.extend(rewrites)
        say("partition")
        with timed("partition"):
            attention_weights = _weights_by_site(mod, gemm=False)
            result = normalize.partition_sites(mod, options, target.arch)
            report.normalizations.extend(result.rewrites)
            gemm_weights = _weights_by_site(result.mod, gemm=True)
            gemms = gemm_partition.partition_gemms(result.mod, options, target.arch)
        partitioned = True
        report.gemms = gemms.entries
        report.matches = result.match_entries()
        report.check_failures = result.failures
        report.site_reasons = result.reasons
        names = {
            sid: _names(attention_weights.get(sid, []), origins, "attention")
            for sid in result.sites
        }
        for match, sm in zip(report.matches, result.fused, strict=True):
            match.names = names.get(sm.site, UserNames())
        for sid, site in gemms.sites.items():
            entry = next((e for e in gemms.entries if e.where == site.where), None)
            if entry is not None:
                entry.names = _names(gemm_weights.get(sid, []), origins, "gemm")
        attention_sites = [
            (result.sites[sid].where, names[sid]) for sid in sorted(result.sites, key=int)
        ]
        fill_verdicts(report, attention_sites)
        stacked = sum(1 for f in result.fused if f.pattern.kind == "stacked")
        report.summary = Summary(
            attention_sites=len(result.sites),
            fused_stacked=stacked,
            fused_plain=len(result.fused) - stacked,
            not_offloaded=len(result.sites) - len(result.fused),
            not_attention=sum(1 for r in result.reasons if r.outcome == "not_attention"),
            gemm_sites=len(gemms.entries),
            gemm_offloaded=sum(1 for e in gemms.entries if e.offloaded),
        )
        if result.unbuildable:
            raise CompileError(
                "attention TVM cannot build was left to it: "
                + "; ".join(f"{f.where.site}: {f.message}" for f in result.unbuildable)
            )

        say("codegen")
        with timed("codegen"):
            chosen = {
                ff.gvar.name_hint: selection.select_kernel(
                    ff.analysis.spec,  # type: ignore[arg-type]
                    target.arch,
                    options.kernel,
                )
                for ff in result.functions
            }
            chosen.update(
                {
                    ff.gvar.name_hint: gemm_families.select_kernel(ff.spec, target.arch)
                    for ff in gemms.functions
                }
            )
            unique = {ks.symbol: ks for ks, _ in chosen.values()}
            compiled: dict[str, CompiledKernel] = {}
            for i, ks in enumerate(unique.values()):
                say("codegen", f"compile {i + 1} of {len(unique)} kernels", i / max(1, len(unique)))
                compiled[ks.symbol] = nvcc.compile_object(ks, settings=settings)
        for match, sm in zip(report.matches, result.fused, strict=True):
            ks, reason = chosen[sm.gvar.name_hint]
            ck = compiled[ks.symbol]
            match.kernel = KernelChoice(
                family=ks.family,  # type: ignore[arg-type]
                symbol=ks.symbol,
                reason=reason,
                config=ks.config,
                workspace_bytes=ks.workspace_bytes,
                **_kernel_times(ck),
            )

        for sid, ff in gemms.fused.items():
            ks, reason = chosen[ff.gvar.name_hint]
            ck = compiled[ks.symbol]
            entry = next(e for e in gemms.entries if e.where == gemms.sites[sid].where)
            entry.kernel = KernelChoice(
                family=ks.family,  # type: ignore[arg-type]
                symbol=ks.symbol,
                reason=reason,
                config=ks.config,
                **_kernel_times(ck),
            )
        fill_verdicts(report, attention_sites)
        report.summary.gemm_configurations = len(
            {
                ks.needs[0].symbol
                for ks, _ in chosen.values()
                if ks.family in gemm_families.families()
            }
        )

        say("build")
        library = out_dir / LIBRARY_NAME
        with timed("build"):
            mod = build.share_kernels(
                gemms.mod, {name: ks.symbol for name, (ks, _) in chosen.items()}
            )
            # validation feeds the weights as the client holds them, before any lifting
            signature = validate.signature(mod["main"])
            convention = lift.CONVENTION_PLAIN
            if options.lift_params:
                mod, lifted, convention = lift.lift_params(mod)
                if lifted is not None:
                    report.normalizations.append(lifted)
            build.build_library(
                mod,
                {s: c.object_path for s, c in compiled.items()},
                needs=[p for c in compiled.values() for p in c.needs],
                arch=target.arch,
                out_path=library,
                settings=settings,
                on_stage=lambda s: say(s),
            )
        data = library.read_bytes()
        report.library = Library(
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            file=library_file,
            calling_convention=convention,
        )

        say("validate")
        with timed("validate"):
            report.validation = (
                _validate(library, payload, fmt, target, options, settings, signature)
                if options.validate_on_gpu != "never"
                else Validation(
                    status="not_run", reason="validation disabled by options.validate_on_gpu"
                )
            )
        if report.validation.status == "failed":
            raise CompileError(
                f"the built library disagrees with the reference: {report.validation.reason}"
            )
    except StackfuseError as exc:
        report.compile_s = round(time.monotonic() - started, 3)
        if partitioned:
            report.error = {k: str(v) for k, v in exc.to_dict().items()}
            _write_report(report, out_dir)
        raise
    except Exception as exc:  # TVM and friends: translated here, once
        err = _foreign(exc, current[0])
        report.compile_s = round(time.monotonic() - started, 3)
        if partitioned:
            report.error = {k: str(v) for k, v in err.to_dict().items()}
            _write_report(report, out_dir)
        raise err from exc
    say("done")
    report.compile_s = round(time.monotonic() - started, 3)
    return CompileResult(library=library, report_path=_write_report(report, out_dir), report=report)


def build_reference(
    module: bytes | str,
    *,
    target: Target,
    options: CompileOptions,
    out_dir: Path,
    settings: Settings | None = None,
    fmt: str = "tvm-json",
) -> CompileResult:
    """The validation reference of ``module``: the same input built by TVM alone (nothing
    offloaded, see :func:`worker.validate.reference_options`) into ``out_dir/model.so``.

    Needs the full compiler, not a GPU: a build host can make it beside the fused library, and a
    GPU worker with only TVM's runtime then validates the pair (``worker.validate.validate_job``).
    """
    from worker import validate

    return compile_module(
        module,
        target=target,
        options=validate.reference_options(options),
        out_dir=out_dir,
        settings=settings,
        fmt=fmt,
    )


def _weights_by_site(mod: Any, *, gemm: bool) -> dict[str, list[str]]:
    """Report text only: a walk that fails costs the names, never the compile."""
    from worker import provenance

    try:
        return provenance.weights_by_site(mod, gemm=gemm)
    except Exception:
        return {}


def _names(weights: list[str], origins: dict[str, str] | None, kind: str) -> UserNames:
    if origins:
        return names_for(weights, origins, kind)
    layer = next((n for n in map(layer_of, weights) if n is not None), None)
    return UserNames(layer=layer, weights=weights)


def _kernel_times(ck: CompiledKernel) -> dict[str, Any]:
    """``compile_s`` this compile spent; when cached, what the first compile took (the kernel
    cache keeps it beside the object)."""
    times: dict[str, Any] = {"compile_s": round(ck.seconds, 3), "cached": ck.cache_hit}
    if ck.cache_hit:
        meta = ck.object_path.with_suffix(".json")
        with suppress(OSError, ValueError, KeyError, TypeError):
            times["original_compile_s"] = round(float(json.loads(meta.read_text())["seconds"]), 3)
    return times


def _validate(
    library: Path,
    payload: bytes,
    fmt: str,
    target: Target,
    options: CompileOptions,
    settings: Settings,
    params: list[dict[str, Any]],
) -> Validation:
    """Build the TVM-only reference of the same input and run it against ``library``, when
    validation runs on this worker at all."""
    from worker import validate

    skipped = validate.not_run(options, settings)
    if skipped is not None:
        return skipped
    with tempfile.TemporaryDirectory(prefix="stackfuse-ref-") as tmp:
        ref_dir = Path(tmp)
        ref = build_reference(
            payload, target=target, options=options, out_dir=ref_dir, settings=settings, fmt=fmt
        )
        return validate.compare(
            library, ref.library, params, settings, ref_dir, validate.tolerances(options)
        )
