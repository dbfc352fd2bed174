"""Run a built library once on the GPU against a reference, in a separate process.

The reference is the same module compiled by TVM alone (no offload): an independent code path
for attention (TVM's legalized softmax(QK^T)V) built from the same input. The pipeline builds
it (with :func:`reference_options`) and hands it to :func:`compare`; this module compiles
nothing. The child process gets no secrets (clean environment), a CPU-time and file-size limit
and a wall-clock timeout; it loads both libraries, feeds both the same random inputs (weights
through ``main_transform_params`` where the library lifted them), and reports the largest error
and each library's time. Without a GPU the report says so: nothing was validated.

:func:`validate_job` is the RQ task for a pair built on another host (a build host with the
full compiler, a GPU worker with only TVM's runtime): it needs no TVM compiler, only this
module's child.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from service.settings import Settings, get_settings
from service.spec import CompileOptions
from worker import sandbox
from worker.report import Validation
from worker.toolchain import has_gpu

#: relative error ||out - ref|| / ||ref|| allowed per dtype
TOLERANCE = {"float16": 2e-2, "bfloat16": 4e-2, "float32": 1e-3}
#: float32 outputs of a library whose float32 matmuls ran as TF32 (options.allow_tf32): inputs
#: rounded to a 10-bit mantissa, so ~1e-3 per GEMM, compounding over a model's layers
TF32_TOLERANCE = 5e-3


def tolerances(options: CompileOptions) -> dict[str, float]:
    """The relative error allowed per output dtype for a library built with ``options``."""
    if options.allow_tf32 and options.offload_gemm:
        return {**TOLERANCE, "float32": TF32_TOLERANCE}
    return dict(TOLERANCE)


#: integer inputs (token ids) are drawn from [0, INT_HIGH), inside any vocabulary: a float
#: N(0, 0.25) cast to int64 gave ids of -1 and -2, gathers out of the embedding's range
INT_HIGH = 16
#: standard deviation of float inputs; weights of rank >= 2 get 1 / sqrt(fan-in) instead (an
#: initialized layer's scale; in PyTorch, a 2-layer GPT-2 at batch 2 x 128 in float16 then
#: differs from float64 by 5.2e-4 relative, 9.8e-4 with 0.5 everywhere)
INPUT_STD = 0.5


def signature(func: Any) -> list[dict[str, Any]]:
    """Shapes ("?" for symbolic dims) and dtypes of a Relax function's tensor parameters."""
    from worker.partition import dim_value, dtype_of, shape_of

    out = []
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    for i, p in enumerate(func.params):
        shape = shape_of(p)
        if shape is None:
            raise ValueError("validation needs tensor parameters with known shapes")
        weight = num_input is not None and i >= int(num_input)
        out.append({"shape": [dim_value(d) for d in shape], "dtype": dtype_of(p), "weight": weight})
    return out


def reference_options(options: CompileOptions) -> CompileOptions:
    """The options the reference is compiled with: ``options`` with nothing offloaded (TVM
    alone) and no validation of its own."""
    return options.model_copy(
        update={
            "fuse_stacked": False,
            "offload_plain": False,
            "offload_gemm": False,
            "validate_on_gpu": "never",
        }
    )


def not_run(options: CompileOptions, settings: Settings) -> Validation | None:
    """The report's validation when none will run here (disabled, or no GPU); None when it
    will: the caller then builds the reference and calls :func:`compare`."""
    if options.validate_on_gpu == "never" or not settings.validate_on_gpu:
        return Validation(status="not_run", reason="validation disabled")
    if not has_gpu():
        return Validation(
            status="not_run",
            reason="no GPU on this worker: the library was built but not run",
        )
    return None


def compare(
    library: Path,
    reference: Path,
    params: list[dict[str, Any]],
    settings: Settings,
    work_dir: Path,
    tolerance: dict[str, float] | None = None,
) -> Validation:
    """Run ``library`` and the TVM-only ``reference`` (built with :func:`reference_options`)
    on the same random inputs in a sandboxed child; ``params`` is :func:`signature` of the
    module as the client holds it; ``tolerance`` (:func:`tolerances`) defaults to TOLERANCE.
    The child's input and result files go to ``work_dir``."""
    out = work_dir / "validation.json"
    inputs = work_dir / "inputs.json"
    inputs.write_text(json.dumps(params))
    result = sandbox.run(
        [
            sys.executable,
            "-m",
            "worker.validate",
            str(library),
            str(reference),
            str(inputs),
            str(out),
            json.dumps(tolerance or TOLERANCE),
        ],
        limits=sandbox.Limits(
            timeout_s=settings.validate_timeout_s,
            cpu_s=settings.validate_cpu_s,
            # CUDA reserves far more address space than it uses: limit data, not address space
            memory_bytes=settings.validate_memory_bytes,
            memory_kind="data",
            file_bytes=64 * 1024 * 1024,
        ),
        env=sandbox.clean_env({"PYTHONPATH": ":".join(p for p in sys.path if p)}),
        what="validation",
    )
    if result.returncode != 0 or not out.exists():
        tail = result.output.strip().splitlines()[-1:] or ["no output"]
        return Validation(
            status="error",
            reason=f"validation process failed (exit {result.returncode}): {tail[0][:300]}",
        )
    return Validation(**json.loads(out.read_text()))


def _child(
    fused_path: str, ref_path: str, inputs_path: str, out_path: str, tolerance: str = "{}"
) -> None:
    import time

    import numpy as np

    from worker.toolchain import import_tvm

    tvm = import_tvm()
    from tvm.runtime.vm import VirtualMachine

    dev = tvm.cuda(0)
    fused = VirtualMachine(tvm.runtime.load_module(fused_path), dev)
    ref = VirtualMachine(tvm.runtime.load_module(ref_path), dev)
    rng = np.random.default_rng()
    args = [
        tvm.runtime.tensor(_random_input(p, rng), dev)
        for p in json.loads(Path(inputs_path).read_text())
    ]

    num_input = sum(1 for p in json.loads(Path(inputs_path).read_text()) if not p.get("weight"))

    def run(vm: Any) -> tuple[Any, float]:
        try:
            transform = vm["main_transform_params"]
        except Exception:  # no weights lifted: main takes them as given
            transform = None
        call = args
        if transform is not None:
            call = args[:num_input] + list(transform(args[num_input:]))
        res = vm["main"](*call)
        dev.sync()
        t0 = time.perf_counter()
        for _ in range(5):
            res = vm["main"](*call)
        dev.sync()
        return res, (time.perf_counter() - t0) / 5

    got, t_fused = run(fused)
    want, t_ref = run(ref)
    worst_rel, worst_abs, dtype = 0.0, 0.0, "float32"
    for g, w in zip(_flatten(got), _flatten(want), strict=True):
        g_np, w_np = g.numpy().astype("float64"), w.numpy().astype("float64")
        dtype = str(g.dtype)
        if not np.all(np.isfinite(g_np)):
            worst_rel = float("inf")
            continue
        worst_abs = max(worst_abs, float(np.max(np.abs(g_np - w_np))) if g_np.size else 0.0)
        denom = float(np.linalg.norm(w_np)) or 1.0
        worst_rel = max(worst_rel, float(np.linalg.norm(g_np - w_np)) / denom)
    tol = {**TOLERANCE, **json.loads(tolerance)}.get(dtype, 2e-2)
    Path(out_path).write_text(
        json.dumps(
            {
                "status": "passed" if worst_rel <= tol else "failed",
                "reason": f"relative error {worst_rel:.2e} vs TVM-only reference "
                f"(tolerance {tol:.0e})",
                "device": _device_text(dev),
                "max_abs_error": worst_abs,
                "tolerance": tol,
                "seconds_fused": t_fused,
                "seconds_reference": t_ref,
            }
        )
    )


def _random_input(param: dict[str, Any], rng: Any) -> Any:
    """One random input of ``param`` (a :func:`signature` entry); symbolic dims are 2."""
    import numpy as np

    shape = [d if isinstance(d, int) else 2 for d in param["shape"]]
    dtype = np.dtype(param["dtype"]) if param["dtype"] != "bfloat16" else None
    if dtype is not None and dtype.kind in "iub":
        return rng.integers(0, 2 if dtype.kind == "b" else INT_HIGH, size=shape).astype(dtype)
    std = INPUT_STD
    if param.get("weight") and len(shape) >= 2:
        std = 1.0 / np.sqrt(max(1, min(shape[-2:])))
    return (rng.standard_normal(shape) * std).astype(param["dtype"])


def _device_text(dev: Any) -> str:
    """Which GPU ran it: the process sees ``cuda:0``, CUDA_VISIBLE_DEVICES says which one."""
    try:
        name = str(dev.device_name)
    except Exception:  # an older runtime without the attribute
        name = "GPU"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    return f"cuda:0 ({name}; CUDA_VISIBLE_DEVICES={visible})"


def _flatten(x: Any) -> list[Any]:
    if hasattr(x, "numpy"):
        return [x]
    return [y for item in x for y in _flatten(item)]


# --- the RQ task for a library built elsewhere --------------------------------------------------
def validate_job(
    job_id: str, input_sha256: str, spec: dict[str, Any], built: dict[str, str]
) -> dict[str, Any]:
    """Validate a library another host built, as the job ``job_id``'s whole work.

    ``built`` names stored objects by sha256: ``artifact`` (the fused library), ``reference``
    (:func:`worker.pipeline.build_reference` of the same input), ``report`` (the build's
    report, validation not run) and ``signature`` (:func:`signature` of the input's ``main``).
    The stored report gets this worker's ``validation`` and becomes the job's report, as in
    :func:`worker.tasks.compile_job`; a failed comparison fails the job the same way.
    """
    from rq import get_current_job

    from service.errors import CompileError, StackfuseError
    from service.jobs import JobRecords
    from service.storage import LocalStore
    from worker.report import Report

    settings = get_settings()
    rq_job = get_current_job()
    assert rq_job is not None, "validate_job runs inside an RQ work-horse"
    records = JobRecords(rq_job.connection, settings)
    attempt = records.start(
        job_id,
        worker=os.environ.get("RQ_WORKER_ID") or str(getattr(rq_job, "worker_name", "") or ""),
        pid=os.getpid(),
        worker_pid=os.getppid(),
    )
    if attempt == 0:
        return {"status": "already-finished"}
    store = LocalStore.for_data_dir(settings.data_dir, fsync=settings.store_fsync)
    work = settings.data_dir / "work" / f"{job_id}.{attempt}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        records.progress(job_id, "validate", 0.92, f"CUDA_VISIBLE_DEVICES={visible}")
        options = CompileOptions.model_validate(spec["options"])
        with store.open(built["report"]) as f:
            report = Report.model_validate_json(f.read())
        with store.open(built["signature"]) as f:
            params = json.loads(f.read())
        library, reference = work / "model.so", work / "reference.so"
        for sha, path in ((built["artifact"], library), (built["reference"], reference)):
            with store.open(sha) as src, path.open("wb") as dst:
                shutil.copyfileobj(src, dst)
        t0 = time.monotonic()
        report.validation = not_run(options, settings) or compare(
            library, reference, params, settings, work
        )
        report.timings["validate"] = round(time.monotonic() - t0, 4)
        report_sha = store.put_bytes(report.model_dump_json(indent=2).encode())
        if report.validation.status == "failed":
            records.fail(
                job_id,
                CompileError(
                    f"the built library disagrees with the reference: {report.validation.reason}"
                ),
                report_sha256=report_sha,
            )
            rq_job.retries_left = 0
            return {"status": "failed", "validation": "failed"}
        records.succeed(job_id, artifact_sha256=built["artifact"], report_sha256=report_sha)
        return {"status": "succeeded", "validation": report.validation.status}
    except Exception as exc:  # nothing here is worth a retry: the inputs are fixed
        err = (
            exc
            if isinstance(exc, StackfuseError)
            else StackfuseError(f"validation job failed ({type(exc).__name__}: {exc})"[:500])
        )
        records.fail(job_id, err)
        rq_job.retries_left = 0
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    _child(*sys.argv[1:6])
