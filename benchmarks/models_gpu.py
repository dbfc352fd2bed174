"""Whole models on the GPU: Hugging Face architectures -> `stackfuse import` -> one library,
checked against PyTorch eager and timed against eager and torch.compile.

Two halves, like :mod:`benchmarks.gpu_cases`:

    python -m benchmarks.models_gpu build .gpu/models     # here: torch CPU + TVM + nvcc
    python -m benchmarks.models_gpu check .gpu/models OUT # there: torch CUDA + runtime TVM

Weights do not travel: :mod:`tests.hf_models` draws every parameter from a seeded generator, so
the GPU side rebuilds the identical model; a sha256 of the state dict, taken on both sides,
proves it. The library is called as ``main(ids, *params)`` with ``params`` taken from that state
dict by the manifest's ``origin`` (state-dict key or ONNX initializer name).

Reference and tolerance: outputs are compared with the same model in PyTorch eager in float32
(TF32 off). The float16 libraries are judged against what PyTorch's own float16 eager run gets
wrong on the same inputs: ``rel_err(ours) <= max(2 * rel_err(eager fp16), 5e-3)``, with
``rel_err = ||out - ref|| / ||ref||``; the float32 (ONNX) library must reach ``1e-3``, and its
TF32 build (``allow_tf32``) is judged like a float16 one, against PyTorch eager with TF32 on.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

#: (case, model, route, dtype, batch, seq, arch): 2-layer models, then whole models at real
#: sizes. An sm_80 library runs on the H200 through the PTX it carries: a numerics check of the
#: Ampere-class kernels, not a measure of their speed, so those cases are not timed.
CASES: list[tuple[str, str, str, str, int, int, str]] = [
    ("gpt2_fp16", "gpt2", "torch", "float16", 4, 256, "sm_90"),
    ("bert_fp16", "bert", "torch", "float16", 4, 256, "sm_90"),
    ("neox_fp16", "neox", "torch", "float16", 4, 256, "sm_90"),
    ("gpt2_onnx_fp32", "gpt2", "onnx", "float32", 4, 256, "sm_90"),
    # one per family (tests/worker/test_families.py): numerics of each family's sites and
    # outcomes on the GPU; ViT's "seq" is its 256 patches (257 tokens with the class token)
    ("neox_rotary_fp16", "neox_rotary", "torch", "float16", 2, 256, "sm_90"),
    ("mistral_fp16", "mistral", "torch", "float16", 2, 256, "sm_90"),
    ("mistral_window_fp16", "mistral_window", "torch", "float16", 2, 256, "sm_90"),
    ("qwen2_fp16", "qwen2", "torch", "float16", 2, 256, "sm_90"),
    ("phi3_fp16", "phi3", "torch", "float16", 2, 256, "sm_90"),
    ("bloom_fp16", "bloom", "torch", "float16", 2, 256, "sm_90"),
    ("gpt_bigcode_fp16", "gpt_bigcode", "torch", "float16", 2, 256, "sm_90"),
    ("vit_fp16", "vit", "torch", "float16", 2, 256, "sm_90"),
    ("gpt2_small_b8_s1024", "gpt2_small", "torch", "float16", 8, 1024, "sm_90"),
    ("bert_base_b32_s128", "bert_base", "torch", "float16", 32, 128, "sm_90"),
    ("llama_b1_s2048", "llama", "torch", "float16", 1, 2048, "sm_90"),
    ("bert_base_b32_s128_sm80", "bert_base", "torch", "float16", 32, 128, "sm_80"),
    ("llama_small_b2_s512_sm80", "llama_small", "torch", "float16", 2, 512, "sm_80"),
    ("bert_base_b32_s128_tf32", "bert_base", "torch", "float32", 32, 128, "sm_90"),
    # static references for the dynamic case below, at the sizes it runs at
    ("gpt2_small_b8_s256", "gpt2_small", "torch", "float16", 8, 256, "sm_90"),
    ("gpt2_small_b8_s512", "gpt2_small", "torch", "float16", 8, 512, "sm_90"),
    # one library for every size up to its bounds (DYNAMIC); batch and seq are the example's
    ("gpt2_small_dynamic", "gpt2_small", "torch", "float16", 8, 1024, "sm_90"),
]
#: compile options of a case beyond the defaults
CASE_OPTIONS: dict[str, dict[str, Any]] = {"bert_base_b32_s128_tf32": {"allow_tf32": True}}
#: dynamic cases: imported with ``--dynamic`` at these bounds, built once, then checked and
#: timed at each (batch, seq) as row ``<case>@b<B>_s<S>`` beside the static case of that size
#: (its ``vs_static``: the static library's time over the dynamic one's; >= 0.97 is within 3%)
DYNAMIC: dict[str, tuple[dict[str, int], list[tuple[int, int]]]] = {
    "gpt2_small_dynamic": ({"batch": 8, "seq": 1024}, [(8, 256), (8, 512), (8, 1024)]),
}
WARMUP, ITERS = 10, 50
PROFILED_CALLS = 5

#: kernel-name pieces that classify GPU time (first match wins; lower-case)
_GEMM_NAMES = ("gemm", "nvjet", "xmma", "cublas", "matmul", "_mm_", "tem_fused")
_ATTENTION_NAMES = ("fmha", "flash", "attention", "sdpa", "hopper", "cudnn")


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(k in low for k in _ATTENTION_NAMES):
        return "attention"
    if any(k in low for k in _GEMM_NAMES):
        return "gemm"
    return "other"


def gpu_breakdown(fn: Any, torch: Any, top: int = 8) -> dict[str, Any]:
    """GPU microseconds per call by kernel class (torch.profiler over PROFILED_CALLS calls),
    and the ``top`` kernels of the rest by time (what a fusion could still take)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    out: dict[str, Any] = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    rest: dict[str, list[float]] = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            cls = kernel_class(ev.name)
            out[cls] += ev.device_time / PROFILED_CALLS
            if cls == "other":
                rest.setdefault(ev.name[:120], []).append(ev.device_time / PROFILED_CALLS)
    out["total"] = sum(out.values())
    out = {k: round(v, 1) for k, v in out.items()}
    out["top_other"] = [
        {"kernel": name, "us": round(sum(ts), 1), "calls": len(ts) // PROFILED_CALLS}
        for name, ts in sorted(rest.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]
    return out


def state_digest(model: Any) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# build (here)
# --------------------------------------------------------------------------------------------
def build(out_dir: Path, names: list[str] | None = None) -> None:
    import numpy as np
    import torch

    from service.spec import CompileOptions, Target
    from tests.hf_models import build as build_model
    from tests.hf_models import example_ids
    from worker.importers import import_model
    from worker.pipeline import compile_module

    out_dir.mkdir(parents=True, exist_ok=True)
    for case, name, route, dtype, batch, seq, arch in CASES:
        if names and case not in names:
            continue
        t0 = time.monotonic()
        work = out_dir / case
        work.mkdir(parents=True, exist_ok=True)
        model = build_model(name)
        digest = state_digest(model)
        ids = example_ids(name, batch, seq)
        tmp = Path("/tmp/stackfuse-models") / case
        tmp.mkdir(parents=True, exist_ok=True)
        if route == "onnx":
            onnx_path = tmp / "model.onnx"
            torch.onnx.export(model, (ids,), str(onnx_path), dynamo=True, input_names=["ids"])
            src: Any = onnx_path
            module_json = import_model(src, out=tmp / "model.json")
        else:
            module_json = import_model(
                model,
                example_inputs=(ids,),
                out=tmp / "model.json",
                dtype=dtype,
                dynamic=DYNAMIC[case][0] if case in DYNAMIC else None,
            )
        res = compile_module(
            module_json.read_bytes(),
            target=Target.model_validate({"arch": arch}),
            options=CompileOptions(validate_on_gpu="never", **CASE_OPTIONS.get(case, {})),
            out_dir=tmp / "build",
        )
        manifest = json.loads((tmp / "model.inputs.json").read_text())
        state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        extra: dict[str, Any] = {}
        with np.load(tmp / "model.params.npz") as data:
            for p in manifest["params"]:
                arr = data[p["name"]]
                ref = state.get(p["origin"])
                if ref is None or ref.shape != arr.shape or not np.allclose(ref, arr, atol=1e-3):
                    extra[p["name"]] = arr
        if extra:
            np.savez(work / "extra_params.npz", **extra)
        (work / "model.so").write_bytes((tmp / "build" / "model.so").read_bytes())
        (work / "report.json").write_text(res.report.model_dump_json(indent=2))
        s = res.report.summary
        case_doc = {
            "case": case,
            "model": name,
            "route": route,
            "dtype": dtype,
            "batch": batch,
            "seq": seq,
            "arch": arch,
            "options": CASE_OPTIONS.get(case, {}),
            "state_sha256": digest,
            "manifest": manifest,
            "sites": s.attention_sites,
            "fused_stacked": s.fused_stacked,
            "fused_plain": s.fused_plain,
            "not_attention": s.not_attention,
            "gemm_sites": s.gemm_sites,
            "gemm_offloaded": s.gemm_offloaded,
            "gemm_configurations": s.gemm_configurations,
            "calling_convention": res.report.library.calling_convention
            if res.report.library
            else "",
            "rewrites": sorted({r.rewrite for r in res.report.normalizations}),
            "variants": [m.variant for m in res.report.matches],
            "dynamic": [d.model_dump() for d in res.report.dynamic],
            "runs": [list(r) for r in DYNAMIC[case][1]] if case in DYNAMIC else [],
            "build_seconds": round(time.monotonic() - t0, 1),
        }
        (work / "case.json").write_text(json.dumps(case_doc, indent=2))
        print(
            f"built {case}: {s.fused_stacked}/{s.attention_sites} stacked, "
            f"{s.fused_plain} plain, {len(extra)} extra params, {time.monotonic() - t0:.1f}s",
            flush=True,
        )


# --------------------------------------------------------------------------------------------
# check (GPU)
# --------------------------------------------------------------------------------------------
def _time_cuda(fn: Any, torch: Any) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ITERS):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)  # us
    return statistics.median(times)


def _rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def static_case(model: str, batch: int, seq: int) -> str | None:
    """The static case of ``model`` at one size (a dynamic row's reference), if there is one."""
    return next(
        (
            c
            for c, m, route, _, b, s, arch in CASES
            if (m, b, s, route, arch) == (model, batch, seq, "torch", "sm_90") and c not in DYNAMIC
        ),
        None,
    )


def check_one(
    case_dir: Path, deadline: float, size: tuple[int, int] | None = None
) -> dict[str, Any]:
    """One case's row; ``size`` (batch, seq) runs a dynamic case's library at that size."""
    import numpy as np
    import torch

    from tests.hf_models import build as build_model
    from tests.hf_models import example_ids
    from worker.toolchain import import_tvm

    tvm = import_tvm()
    import tvm_ffi
    from tvm.runtime.vm import VirtualMachine

    doc = json.loads((case_dir / "case.json").read_text())
    row: dict[str, Any] = {k: doc[k] for k in ("case", "model", "route", "dtype", "batch", "seq")}
    if size is not None:
        row.update(batch=size[0], seq=size[1], case=f"{doc['case']}@b{size[0]}_s{size[1]}")
        row["dynamic"] = doc["dynamic"]
        row["static_case"] = static_case(doc["model"], *size)
    row["arch"] = doc.get("arch", "sm_90")
    row.update(sites=doc["sites"], fused_stacked=doc["fused_stacked"], variants=doc["variants"])
    row.update({k: doc[k] for k in ("fused_plain", "not_attention") if k in doc})
    row.update(
        {k: doc[k] for k in ("gemm_sites", "gemm_offloaded", "gemm_configurations") if k in doc}
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_model(doc["model"])
    row["weights_identical"] = state_digest(model) == doc["state_sha256"]
    ids = example_ids(doc["model"], row["batch"], row["seq"]).cuda()
    # the float32 reference reads the input as it is; the library and PyTorch's run in the
    # case's dtype read pixels (ViT) in that dtype, as the import cast them
    run_ids = ids.to(getattr(torch, doc["dtype"])) if ids.is_floating_point() else ids
    state = {k: v for k, v in model.state_dict().items()}
    extra = {}
    if (case_dir / "extra_params.npz").exists():
        with np.load(case_dir / "extra_params.npz") as data:
            extra = {k: torch.from_numpy(data[k]) for k in data.files}
    dt = getattr(torch, doc["dtype"])
    params = []
    for p in doc["manifest"]["params"]:
        t = extra[p["name"]] if p["name"] in extra else state[p["origin"]]
        params.append(t.to(getattr(torch, p["dtype"])).cuda().contiguous())
    ref_model = model.float().cuda().eval()
    with torch.no_grad():
        ref = ref_model(ids)
        # a TF32 library's peer is PyTorch with TF32 matmuls too (the reference stays float32)
        torch.backends.cuda.matmul.allow_tf32 = bool(doc.get("options", {}).get("allow_tf32"))
        run_model = build_model(doc["model"]).to(dt).cuda().eval()
        eager_out = run_model(run_ids)
    vm = VirtualMachine(tvm.runtime.load_module(str(case_dir / "model.so")), tvm.cuda(0))
    weights = [tvm.runtime.from_dlpack(t) for t in params]
    if "main_transform_params" in doc.get("calling_convention", ""):
        t0 = time.monotonic()
        with tvm_ffi.use_torch_stream():
            weights = list(vm["main_transform_params"](weights))
        torch.cuda.synchronize()
        row["transform_params_ms"] = round((time.monotonic() - t0) * 1000, 2)
    args = [tvm.runtime.from_dlpack(run_ids), *weights]
    main = vm["main"]

    def ours() -> Any:
        with tvm_ffi.use_torch_stream():
            return main(*args)

    got = torch.from_dlpack(ours())
    torch.cuda.synchronize()
    row["finite"] = bool(torch.isfinite(got.float()).all())
    row["max_abs_error"] = float((got.float() - ref).abs().max())
    row["rel_error"] = _rel(got, ref)
    row["eager_rel_error"] = _rel(eager_out, ref)
    row["eager_max_abs_error"] = float((eager_out.float() - ref).abs().max())
    tol = (
        1e-3
        if doc["dtype"] == "float32" and not torch.backends.cuda.matmul.allow_tf32
        else max(2 * row["eager_rel_error"], 5e-3)
    )
    row["tolerance"] = tol
    row["passed"] = row["finite"] and row["rel_error"] <= tol
    breakdown = row["gpu_us_by_class"] = {}
    if row["arch"] != "sm_90":
        return row  # numerics only: another arch's kernels, JIT-compiled from PTX
    with torch.no_grad():
        row["eager_us"] = _time_cuda(lambda: run_model(run_ids), torch)
        row["stackfuse_us"] = _time_cuda(ours, torch)
        if row["batch"] * row["seq"] >= 2048:  # whole models at real sizes
            breakdown["stackfuse"] = gpu_breakdown(ours, torch)
            breakdown["eager"] = gpu_breakdown(lambda: run_model(run_ids), torch)
        if size is not None:  # the peers were timed at this size in the static row
            return row
        way, mode = COMPILE_MODES[0]
        _time_compiled(row, way, mode, run_model, run_ids, deadline, torch)
    _speedups(row)
    return row


def _time_compiled(
    row: dict[str, Any], way: str, mode: str | None, run_model: Any, ids: Any, deadline: float,
    torch: Any,
) -> None:  # fmt: skip
    """torch.compile(mode) of ``run_model``: compile seconds, steady time, GPU breakdown."""
    if time.monotonic() >= deadline:
        row[f"{way}_error"] = "skipped: time budget"
        return
    try:
        t0 = time.monotonic()
        compiled = torch.compile(run_model, mode=mode)
        with torch.no_grad():
            compiled(ids)
            torch.cuda.synchronize()
            row[f"{way}_seconds"] = round(time.monotonic() - t0, 1)
            row[f"{way}_us"] = _time_cuda(lambda: compiled(ids), torch)
            if row["batch"] * row["seq"] >= 2048:
                row["gpu_us_by_class"][way] = gpu_breakdown(lambda: compiled(ids), torch)
    except Exception as exc:  # recorded, not fatal: the device may lack a compiler
        row[f"{way}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    torch._dynamo.reset()


def autotune_one(case_dir: Path, row: dict[str, Any], deadline: float) -> None:
    """The second pass: the other torch.compile modes, for the cases that passed, while the
    budget lasts (max-autotune compiles for minutes; every case gets the default mode first)."""
    import torch

    from tests.hf_models import build as build_model
    from tests.hf_models import example_ids

    doc = json.loads((case_dir / "case.json").read_text())
    dt = getattr(torch, doc["dtype"])
    ids = example_ids(doc["model"], doc["batch"], doc["seq"]).cuda()
    ids = ids.to(dt) if ids.is_floating_point() else ids
    run_model = build_model(doc["model"]).to(dt).cuda().eval()
    for way, mode in COMPILE_MODES[1:]:
        _time_compiled(row, way, mode, run_model, ids, deadline, torch)
    _speedups(row)


def _speedups(row: dict[str, Any]) -> None:
    for way in ("eager", "torch_compile", "torch_compile_max_autotune"):
        if row.get(f"{way}_us") and row.get("stackfuse_us"):
            row[f"speedup_vs_{way}"] = round(row[f"{way}_us"] / row["stackfuse_us"], 3)


#: (result key, torch.compile mode); STACKFUSE_COMPILE_MODES=default limits it to the first
COMPILE_MODES: list[tuple[str, str | None]] = [
    ("torch_compile", None),
    ("torch_compile_max_autotune", "max-autotune-no-cudagraphs"),
]


def check(root: Path, out: Path, budget_s: float = 200.0, cases: list[str] | None = None) -> int:
    import os

    import torch

    if os.environ.get("STACKFUSE_COMPILE_MODES") == "default":
        del COMPILE_MODES[1:]
    budget_s = float(os.environ.get("STACKFUSE_MODELS_BUDGET_S", budget_s))
    deadline = time.monotonic() + budget_s
    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python -m benchmarks.models_gpu check .gpu/models $OUT",
        "timing": f"CUDA events, {WARMUP} warm-up calls, median of {ITERS}, microseconds",
        "reference": "same model, PyTorch eager float32, TF32 off",
        "results": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    for case_dir in sorted(p for p in root.iterdir() if (p / "case.json").exists()):
        if cases and case_dir.name not in cases:
            continue
        runs = json.loads((case_dir / "case.json").read_text()).get("runs") or [None]
        for size in runs:
            name = case_dir.name if size is None else f"{case_dir.name}@b{size[0]}_s{size[1]}"
            try:
                row = check_one(case_dir, deadline, None if size is None else tuple(size))
            except Exception as exc:  # every case reported, crashes included
                row = {"case": name, "passed": False, "error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            # written after every case: a run cut short keeps the cases it finished
            vs_static(rows)
            doc["passed"] = sum(bool(r.get("passed")) for r in rows)
            doc["total"] = len(rows)
            (out / "models_gpu.json").write_text(json.dumps(doc, indent=2))
            (out / "models_gpu.md").write_text(to_markdown(doc))
    for row in rows:
        case_dir = root / row["case"]
        if (
            row.get("passed")
            and "@" not in row["case"]  # a dynamic run's peers are its static case's
            and row.get("arch", "sm_90") == "sm_90"
            and len(COMPILE_MODES) > 1
            and time.monotonic() < deadline
        ):
            try:
                autotune_one(case_dir, row, deadline)
            except Exception as exc:
                row["torch_compile_max_autotune_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps({k: v for k, v in row.items() if "autotune" in k}), flush=True)
            (out / "models_gpu.json").write_text(json.dumps(doc, indent=2))
            (out / "models_gpu.md").write_text(to_markdown(doc))
    print(f"{doc['passed']}/{doc['total']} passed")
    return 0 if doc["passed"] == doc["total"] else 1


def vs_static(rows: list[dict[str, Any]]) -> None:
    """Each dynamic row's ``vs_static``: its static case's library time over its own."""
    by_case = {r["case"]: r for r in rows}
    for r in rows:
        ref = by_case.get(r.get("static_case") or "")
        if ref and ref.get("stackfuse_us") and r.get("stackfuse_us"):
            r["vs_static"] = round(ref["stackfuse_us"] / r["stackfuse_us"], 3)


#: the ways timed, in table order: (result key prefix, column title)
WAYS = [
    ("eager", "eager"),
    ("torch_compile", "torch.compile"),
    ("torch_compile_max_autotune", "max-autotune-no-cudagraphs"),
    ("stackfuse", "stackfuse"),
]


def to_markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Whole models on {doc['device']} ({doc['date']})",
        "",
        f"Command: `{doc['command']}` (libraries built with `python -m benchmarks.models_gpu "
        "build .gpu/models CASE...`). Torch " + doc.get("torch", "?") + ". " + doc["timing"] + ".",
        f"Reference: {doc['reference']}. Speed-ups are the peer's time over ours (> 1: faster).",
        *([doc["note"]] if doc.get("note") else []),
        "",
        "| case | arch | attention fused | GEMMs offloaded | GEMM configs | rel err (ours) | "
        "rel err (eager fp16) | passed | " + " | ".join(f"{t} ms" for _, t in WAYS) + " | "
        "vs eager | vs torch.compile | vs max-autotune |",
        "|" + "---|" * (11 + len(WAYS)),
    ]
    for r in doc["results"]:

        def f(key: str, fmt: str = "{:.3g}", r: dict[str, Any] = r, scale: float = 1.0) -> str:
            v = r.get(key)
            return fmt.format(v * scale) if isinstance(v, int | float) else "-"

        lines.append(
            f"| {r['case']} | {r.get('arch', 'sm_90')} | "
            f"{r.get('fused_stacked', '-')}/{r.get('sites', '-')}"
            + (f" (+{r['fused_plain']} plain)" if r.get("fused_plain") else "")
            + (f" ({r['not_attention']} not attention)" if r.get("not_attention") else "")
            + " | "
            f"{r.get('gemm_offloaded', '-')}/{r.get('gemm_sites', '-')} | "
            f"{r.get('gemm_configurations', '-')} | {f('rel_error')} | {f('eager_rel_error')} | "
            f"{r.get('passed')} | "
            + " | ".join(f(f"{k}_us", "{:.2f}", scale=1e-3) for k, _ in WAYS)
            + " | "
            + " | ".join(f(f"speedup_vs_{k}", "{:.2f}x") for k, _ in WAYS[:3])
            + " |"
        )
    broken = [r for r in doc["results"] if r.get("gpu_us_by_class")]
    if broken:
        lines += [
            "",
            "GPU time per call by kernel class (torch.profiler; ms: GEMMs / attention / the rest "
            "= total):",
            "",
            "| case | " + " | ".join(t for _, t in WAYS) + " |",
            "|" + "---|" * (1 + len(WAYS)),
        ]
        for r in broken:
            cells = []
            for k, _ in WAYS:
                b = r["gpu_us_by_class"].get(k)
                cells.append(
                    f"{b['gemm'] / 1e3:.2f} / {b['attention'] / 1e3:.2f} / {b['other'] / 1e3:.2f}"
                    f" = {b['total'] / 1e3:.2f}"
                    if b
                    else "-"
                )
            lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    for r in broken:
        top = r["gpu_us_by_class"].get("stackfuse", {}).get("top_other")
        if top:
            lines += [
                "",
                f"Largest kernels of the rest in {r['case']}'s library (us per call):",
                "",
            ]
            lines += [f"- {t['us']:.1f} ({t['calls']} calls): `{t['kernel']}`" for t in top]
    dynamic = [r for r in doc["results"] if "static_case" in r]
    if dynamic:
        lines += [
            "",
            "Dynamic shapes: one library per model, built for the bounds, run at each size, "
            "against the static library built for that size (vs static: static time over "
            "dynamic; >= 0.97 is within 3%):",
            "",
            "| run | bounds | static case | rel err | passed | dynamic ms | static ms | "
            "vs static |",
            "|" + "---|" * 8,
        ]
        by_case = {r["case"]: r for r in doc["results"]}
        for r in dynamic:
            bounds = ", ".join(f"{d['name']} <= {d['upper_bound']}" for d in r.get("dynamic", []))
            ref = by_case.get(r.get("static_case") or "", {})
            cells = [
                r["case"],
                bounds or "-",
                r.get("static_case") or "-",
                f"{r['rel_error']:.3g}" if "rel_error" in r else "-",
                str(r.get("passed")),
                f"{r['stackfuse_us'] / 1e3:.2f}" if r.get("stackfuse_us") else "-",
                f"{ref['stackfuse_us'] / 1e3:.2f}" if ref.get("stackfuse_us") else "-",
                f"{r['vs_static']:.3f}" if r.get("vs_static") else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    for r in doc["results"]:
        for key in ("error", "torch_compile_error", "torch_compile_max_autotune_error"):
            if r.get(key):
                lines += ["", f"- {r['case']} ({key}): {r[key]}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "build":
        build(Path(argv[1]), argv[2:] or None)
        return 0
    if cmd == "check":
        return check(Path(argv[1]), Path(argv[2]), cases=argv[3:] or None)
    if cmd == "markdown":
        doc = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(to_markdown(doc))
        return 0
    raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
