"""Compile-time and memory figures on this machine (no GPU needed).

    python -m benchmarks.compile_bench [--out benchmarks/results/compile_bench.json]
    python -m benchmarks.compile_bench --model MODEL.json [MODEL.json ...] \
        --out benchmarks/results/compile_models.json

The second form compiles whole imported models (``stackfuse import`` output) for sm_90 against
the kernel cache in ``STACKFUSE_KERNEL_CACHE_DIR`` as it is (e.g. filled by ``stackfuse
prebuild`` or an earlier build), twice: ``first`` compiles whatever the cache lacks (the glue
of each site, at least), ``again`` is the same job with everything cached.

Goals (DEVELOPERS.md): cold compile of one SM80-class attention config <= 15 s on 2 cores; a
kernel-cache hit <= 0.5 s; worker peak memory per job <= 2 GiB.

Each measurement runs one whole job (``compile_module``) in a fresh child process, as a worker's
work-horse would, and reads the peak resident memory of that process and of its largest child
(nvcc's front end) from ``getrusage``. The *cold* run starts from an empty kernel cache; the
*warm* run repeats the same job with the cache filled. ``kernel_seconds`` is the codegen stage
alone (nvcc, or the cache lookup), the figure the goals name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CHILD = """
import json, sys, time, resource
from pathlib import Path
t0 = time.monotonic()
from service.settings import Settings
from service.spec import CompileOptions, Target
from tests.models import stacked_attention_module, to_json
from worker.pipeline import compile_module
imported = time.monotonic() - t0
settings = Settings(data_dir=Path(sys.argv[1]), kernel_cache_dir=Path(sys.argv[2]))
mod = to_json(stacked_attention_module(*json.loads(sys.argv[5])))
t1 = time.monotonic()
res = compile_module(mod, target=Target(arch="sm_90"),
                     options=CompileOptions(kernel=sys.argv[4], validate_on_gpu="never"),
                     out_dir=Path(sys.argv[3]), settings=settings)
job = time.monotonic() - t1
print(json.dumps({"import_seconds": imported, "job_seconds": job,
                  "timings": res.report.timings,
                  "cache_hit": res.report.matches[0].kernel.cached,
                  "kernel": res.report.matches[0].kernel.family,
                  "self_max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  # this job's nvcc, cicc, ptxas ... (reaped children of this process only)
                  "descendants_max_rss_kib":
                      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""

#: (B, S, N, H) of the benchmarked model; NEW_SHAPE has other numbers but the same Hopper
#: configuration (fp16, ping-pong 128x128, head dim 128, no mask): a second model that only
#: compiles its glue
SHAPE = (8, 2048, 16, 128)
NEW_SHAPE = (4, 1024, 32, 128)


def _job(
    data: Path, cache: Path, out: Path, kernel: str, shape: tuple[int, ...] = SHAPE
) -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(data), str(cache), str(out), kernel, json.dumps(shape)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    wall = time.monotonic() - t0
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["wall_seconds"] = wall
    doc["kernel_seconds"] = doc["timings"].get("codegen_s")
    # max RSS over every descendant reaped so far (the job process, nvcc, cicc, ptxas ...)
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    doc["children_max_rss_kib"] = max(before, after)
    doc["shape_bsnh"] = list(shape)
    # peak of this job alone: its own process or its largest compiler child
    doc["job_peak_rss_kib"] = max(doc["self_max_rss_kib"], doc["descendants_max_rss_kib"])
    return doc


_MODEL_CHILD = """
import json, sys, time, resource
from pathlib import Path
from service.settings import get_settings
from service.spec import CompileOptions, Target
from worker.pipeline import compile_module
body = Path(sys.argv[1]).read_bytes()
t0 = time.monotonic()
res = compile_module(body, target=Target(arch="sm_90"),
                     options=CompileOptions(validate_on_gpu="never"),
                     out_dir=Path(sys.argv[2]), settings=get_settings())
s = res.report.summary
print(json.dumps({"job_seconds": time.monotonic() - t0, "timings": res.report.timings,
                  "attention_sites": s.attention_sites, "gemm_sites": s.gemm_sites,
                  "gemm_offloaded": s.gemm_offloaded,
                  "gemm_configurations": s.gemm_configurations,
                  "self_max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "descendants_max_rss_kib":
                      resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def _model_job(model: Path, out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _MODEL_CHILD, str(model), str(out)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["wall_seconds"] = round(time.monotonic() - t0, 1)
    return doc


def models(paths: list[Path], out: Path) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="stackfuse-bench-") as tmp:
        for i, path in enumerate(paths):
            first = _model_job(path, Path(tmp) / f"{i}a")
            again = _model_job(path, Path(tmp) / f"{i}b")
            rows.append({"model": str(path), "bytes": path.stat().st_size, "first": first,
                         "again": again})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m benchmarks.compile_bench --model " + " ".join(map(str, paths)),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "kernel_cache": "configurations cached beforehand (first: each site's glue compiles)",
        "models": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", nargs="+", type=Path, default=None, help="imported model JSONs")
    args = ap.parse_args()
    if args.model:
        return models(args.model, Path(args.out or "benchmarks/results/compile_models.json"))
    args.out = args.out or "benchmarks/results/compile_bench.json"
    with tempfile.TemporaryDirectory(prefix="stackfuse-bench-") as tmp:
        root = Path(tmp)
        cold = _job(root / "data", root / "kernels", root / "out1", "sm80")
        warm = _job(root / "data", root / "kernels", root / "out2", "sm80")
        hopper_cold = _job(root / "data", root / "kernels", root / "out3", "hopper")
        hopper_warm = _job(root / "data", root / "kernels", root / "out4", "hopper")
        # another model, the same Hopper configuration: only its glue is compiled
        hopper_new = _job(root / "data", root / "kernels", root / "out5", "hopper", NEW_SHAPE)
    load = os.getloadavg()
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m benchmarks.compile_bench",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_after": load},
        "config": "stacked split, fp16, B8 S2048 N16 H128, sm_90; SM80-class and Hopper kernels; "
        "then B4 S1024 N32 H128 (another model, the same Hopper configuration)",
        "sm80_cold": cold,
        "sm80_warm": warm,
        "hopper_cold": hopper_cold,
        "hopper_warm": hopper_warm,
        "hopper_new_shape_same_config": hopper_new,
        "goals": {
            "sm80_cold_kernel_compile_s<=15": cold["kernel_seconds"] <= 15,
            "cache_hit_s<=0.5": max(warm["kernel_seconds"], hopper_warm["kernel_seconds"]) <= 0.5,
            "sm80_peak_memory_per_job<=2GiB": cold["children_max_rss_kib"] <= 2 * 1024 * 1024,
            "hopper_cold_kernel_compile_s<=60": hopper_cold["kernel_seconds"] <= 60,
            "hopper_peak_memory_per_job<=2GiB": hopper_cold["job_peak_rss_kib"] <= 2 * 1024 * 1024,
            "hopper_new_shape_cached_config_compile_s<=15": hopper_new["kernel_seconds"] <= 15,
            "hopper_new_shape_cached_config_peak_memory<=2GiB": hopper_new["job_peak_rss_kib"]
            <= 2 * 1024 * 1024,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
