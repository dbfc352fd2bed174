"""The whole pipeline on the CPU machine: real nvcc, a real .so that TVM loads, the report."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from service.errors import StackfuseError, TimeLimitExceeded
from service.settings import Settings
from service.spec import CompileOptions, Target
from tests.models import stacked_attention_module, to_json, tvm, two_layer_module
from tests.worker.fatbin import KIND_ELF, entries
from worker.pipeline import LIBRARY_NAME, REPORT_NAME, compile_module

pytestmark = pytest.mark.nvcc


def build(mod: object, settings: Settings, out: Path, **opts: object) -> object:
    return compile_module(
        to_json(mod),
        target=Target(arch="sm_90"),
        options=CompileOptions(**opts),
        out_dir=out,
        settings=settings,
    )


def test_library_loads_in_tvm_with_sm90_machine_code(
    kernel_settings: Settings, tmp_path: Path
) -> None:
    stages: list[str] = []
    res = compile_module(
        to_json(stacked_attention_module(4, 8, 32, 64, 32, epilogue=True)),
        target=Target(arch="sm_90"),
        options=CompileOptions(),
        out_dir=tmp_path,
        settings=kernel_settings,
        progress=lambda stage, frac, detail: stages.append(stage),
    )
    assert res.library == tmp_path / LIBRARY_NAME and res.report_path == tmp_path / REPORT_NAME
    assert stages[0] == "ingest" and "codegen" in stages and "link" in stages
    assert stages[-1] == "done"
    data = res.library.read_bytes()
    # both the CUTLASS kernel and TVM's own (the epilogue add) are sm_90 machine code
    elves = [sm for kind, sm in entries(data) if kind == KIND_ELF]
    assert elves.count(90) == 2
    assert b"__global__" not in data  # no CUDA source left to JIT at load time
    lib = tvm.runtime.load_module(str(res.library))
    from tvm.runtime.vm import VirtualMachine

    vm = VirtualMachine(lib, tvm.cpu())
    assert vm["main"] is not None
    (match,) = res.report.matches
    assert match.kernel is not None
    assert lib.get_function(match.kernel.symbol, query_imports=True) is not None


def test_report_contents(kernel_settings: Settings, tmp_path: Path) -> None:
    res = build(stacked_attention_module(4, 8, 32, 64, 32), kernel_settings, tmp_path)
    doc = json.loads(res.report_path.read_text())
    assert doc["schema_version"] == 2
    assert doc["target"] == {"arch": "sm_90"}
    assert set(doc["toolchain"]) >= {"apache-tvm", "apache-tvm-ffi", "nvidia-cutlass"}
    assert doc["summary"] == {
        "attention_sites": 1,
        "fused_stacked": 1,
        "fused_plain": 0,
        "not_offloaded": 0,
        "not_attention": 0,
        "gemm_sites": 0,
        "gemm_offloaded": 0,
        "gemm_configurations": 0,
    }
    assert set(doc["timings"]) >= {"ingest_s", "partition_s", "codegen_s", "build_s"}
    assert all(k.endswith("_s") for k in doc["timings"]) and doc["compile_s"] > 0
    assert doc["cached"] is False and doc["original_compile_s"] is None
    (site,) = doc["sites"]
    assert site["kind"] == "attention" and site["offloaded"] is True
    assert site["verdict"] == doc["matches"][0]["verdict"]
    assert site["verdict"].startswith("Fused stacked-QKV attention: runs as one CUTLASS FMHA")
    lib = (tmp_path / LIBRARY_NAME).read_bytes()
    assert doc["library"] == {
        "sha256": hashlib.sha256(lib).hexdigest(),
        "size_bytes": len(lib),
        "file": "model.so",
        "calling_convention": "main(*inputs, *params)",  # no weights to lift
    }
    assert doc["validation"]["status"] == "not_run"
    assert "no GPU" in doc["validation"]["reason"]
    kernel = doc["matches"][0]["kernel"]
    assert kernel["family"] == "cutlass_fmha_sm80" and kernel["reason"]
    assert (
        doc["input_sha256"]
        == hashlib.sha256(to_json(stacked_attention_module(4, 8, 32, 64, 32)).encode()).hexdigest()
    )


def test_identical_sites_share_one_kernel_and_the_cache_hits(
    kernel_settings: Settings, tmp_path: Path
) -> None:
    """Also the one end-to-end build of the Hopper kernel (the default on sm_90)."""
    res = build(two_layer_module(2, 16, 4, 64), kernel_settings, tmp_path / "a")
    assert res.report.summary.fused_stacked == 2
    symbols = {m.kernel.symbol for m in res.report.matches if m.kernel}
    assert len(symbols) == 1
    kernel = res.report.matches[0].kernel
    assert kernel is not None and kernel.family == "cutlass_fmha_hopper"
    assert "Hopper FMHA" in kernel.reason
    assert 90 in {sm for kind, sm in entries(res.library.read_bytes()) if kind == KIND_ELF}
    again = build(two_layer_module(2, 16, 4, 64), kernel_settings, tmp_path / "b")
    for m in again.report.matches:
        assert m.kernel is not None and m.kernel.cached
        assert "from the kernel cache" in m.verdict


def test_symbolic_batch_builds(kernel_settings: Settings, tmp_path: Path) -> None:
    res = build(stacked_attention_module("batch", 16, 4, 64, 32), kernel_settings, tmp_path)
    (m,) = res.report.matches
    assert m.layout.batch_stride["q"] == 640 * 16  # only the batch is symbolic
    assert isinstance(m.shapes["qkv"][0], str)
    assert res.library.exists()


def test_a_bias_of_odd_length_builds_on_the_sm80_class_kernel(
    kernel_settings: Settings, tmp_path: Path
) -> None:
    """A bias row of 300 halves (not a whole number of the kernel's 16-byte bias loads): the
    launcher pads it into a workspace, and that C++ compiles and links (its numerics: the
    window cases of benchmarks/gpu_cases.py, masks of S 300 and 500, on an H100)."""
    mod = stacked_attention_module(1, 300, 4, 64, bias_shape=(1, 4, 300, 300))
    res = build(mod, kernel_settings, tmp_path, validate_on_gpu="never")
    (m,) = res.report.matches
    assert m.kernel is not None and m.kernel.family == "cutlass_fmha_sm80"
    assert m.kernel.config["aligned"] is True
    assert res.library.exists()
    tvm.runtime.load_module(str(res.library))


def test_failure_after_partition_still_writes_the_report(tmp_path: Path) -> None:
    # a fresh kernel cache and no time for nvcc: codegen fails after partitioning ran
    settings = Settings(data_dir=tmp_path / "d", kernel_cache_dir=tmp_path / "k", nvcc_timeout_s=0)
    with pytest.raises(TimeLimitExceeded) as err:
        build(stacked_attention_module(2, 8, 4, 64), settings, tmp_path / "out")
    assert "nvcc" in err.value.message
    doc = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert doc["summary"]["fused_stacked"] == 1
    assert doc["error"]["type"] == "time-limit-exceeded"
    assert not (tmp_path / "out" / LIBRARY_NAME).exists()


def test_bad_input_fails_before_partition_without_a_report(
    kernel_settings: Settings, tmp_path: Path
) -> None:
    with pytest.raises(StackfuseError) as err:
        compile_module(
            b"{not json",
            target=Target(),
            options=CompileOptions(),
            out_dir=tmp_path,
            settings=kernel_settings,
        )
    assert err.value.status < 500 and not err.value.retryable
    assert not (tmp_path / REPORT_NAME).exists()


def test_only_stackfuse_errors_escape(kernel_settings: Settings, tmp_path: Path) -> None:
    bogus = json.dumps({"root_index": 0, "nodes": [{"type": "relax.Function"}], "b64ndarrays": []})
    with pytest.raises(StackfuseError):
        compile_module(
            bogus,
            target=Target(),
            options=CompileOptions(),
            out_dir=tmp_path,
            settings=kernel_settings,
        )


def test_only_entry_points_are_exported(kernel_settings: Settings, tmp_path: Path) -> None:
    """Template statics and kernel stubs stay inside the library: with default visibility the
    loader unified them across two models in one process, and the second one's Hopper kernel
    failed to launch (its shared-memory attribute was 'already set' by the first)."""
    import subprocess

    res = build(stacked_attention_module(2, 8, 4, 64, 32), kernel_settings, tmp_path)
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", "-C", str(res.library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"__tvm_ffi_{res.report.matches[0].kernel.symbol}" in nm  # type: ignore[union-attr]
    for leaked in ("cutlass", "AttentionKernel", "device_kernel", "attention_kernel_batched"):
        assert leaked not in nm


def test_validation_compares_with_a_tvm_only_reference_the_pipeline_builds(
    kernel_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a GPU, the pipeline compiles the same input again with validate.reference_options
    (nothing offloaded) and hands both libraries and the input signature to validate.compare."""
    from worker import validate
    from worker.report import Validation

    seen: list[dict[str, Any]] = []

    def compare(
        library: Path,
        reference: Path,
        params: list[dict[str, object]],
        settings: Settings,
        work: Path,
        tolerance: dict[str, float] | None = None,
    ) -> Validation:
        seen.append(
            {
                "tolerance": tolerance,
                "library": library,
                "reference_exists": reference.exists(),
                "reference_report": json.loads((reference.parent / REPORT_NAME).read_text()),
                "params": params,
                "work": work,
            }
        )
        return Validation(status="passed", reason="checked by the test")

    monkeypatch.setattr(validate, "has_gpu", lambda: True)
    monkeypatch.setattr(validate, "compare", compare)
    mod = stacked_attention_module(4, 8, 32, 64, 32)
    res = build(mod, kernel_settings, tmp_path / "out")
    assert res.report.validation.status == "passed"
    (call,) = seen
    assert call["library"] == tmp_path / "out" / LIBRARY_NAME and call["reference_exists"]
    ref = call["reference_report"]
    assert ref["summary"]["attention_sites"] == 1 and ref["summary"]["not_offloaded"] == 1
    assert ref["validation"]["status"] == "not_run"
    assert call["params"] == validate.signature(mod["main"])
    assert call["params"] == [{"shape": [4, 8, 5120], "dtype": "float16", "weight": False}]
    assert not Path(call["work"]).exists()  # a temporary directory
    assert call["tolerance"] == validate.tolerances(CompileOptions())
    assert validate.reference_options(CompileOptions()).model_dump() == {
        **CompileOptions().model_dump(),
        "fuse_stacked": False,
        "offload_plain": False,
        "offload_gemm": False,
        "validate_on_gpu": "never",
    }

    # disabled by the worker's settings: no reference is built
    off = kernel_settings.model_copy(update={"validate_on_gpu": False})
    res = build(mod, off, tmp_path / "off")
    assert res.report.validation.status == "not_run" and len(seen) == 1


def test_builds_repeat_byte_for_byte(kernel_settings: Settings, tmp_path: Path) -> None:
    """The same module, target, options and toolchain give the same library bytes, wherever
    it is built. TVM's half cold (fresh kernel caches: its CUDA kernels go through nvcc each
    time); the CUTLASS half from the shared kernel cache, in other directories. nvcc's
    temporary host-file names (tmpxft_<pid>_...), which differ on every cold compile, are in
    the static symbol table only, which the link strips."""
    mod = stacked_attention_module(2, 8, 4, 64)
    tvm_only = {"fuse_stacked": False, "offload_plain": False, "offload_gemm": False}
    digests = set()
    for i in range(2):
        cold = Settings(data_dir=tmp_path / f"d{i}", kernel_cache_dir=tmp_path / f"k{i}")
        res = build(mod, cold, tmp_path / f"tvm{i}", **tvm_only)
        assert list((tmp_path / f"k{i}" / "fatbins").rglob("*.fatbin"))  # compiled, not cached
        digests.add(hashlib.sha256(res.library.read_bytes()).hexdigest())
    assert len(digests) == 1

    libs = [
        build(mod, kernel_settings.model_copy(update={"data_dir": tmp_path / f"e{i}"}), out)
        for i, out in enumerate((tmp_path / "a", tmp_path / "b" / "deeper"))
    ]
    data = [r.library.read_bytes() for r in libs]
    assert data[0] == data[1] and libs[0].report.matches[0].kernel is not None
    assert b"tmpxft_" not in data[0] and str(tmp_path).encode() not in data[0]
    assert (
        libs[0].report.library
        and libs[0].report.library.sha256 == hashlib.sha256(data[0]).hexdigest()
    )


@pytest.mark.parametrize(
    ("shape", "scheduled"),
    [
        ((1, 64, 2048), True),
        ((4, 16, 4096), True),
        ((1, 64, 5120), False),
        ((16, 8, 1024), True),
        ((64, 2048), False),
    ],
)
def test_rms_norm_takes_the_rmsnorm_rule_where_its_schedule_compiles(
    shape: tuple[int, ...], scheduled: bool, tmp_path: Path
) -> None:
    from tvm import relax
    from tvm.script import relax as R
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import relax as rb

    from worker import build as tvm_build

    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor(shape, "float16"))
        w = R.arg("w", R.Tensor((shape[-1],), "float16"))
        with R.dataflow() as frame:
            y = R.emit(R.nn.rms_norm(x, w, axes=[-1], epsilon=1e-6))
            R.output(y)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    legal = relax.transform.LegalizeOps()(mod)
    (func,) = [f for gv, f in legal.functions.items() if gv.name_hint == "rms_norm"]
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        sch = tvm_build.GuardedRMSNorm().apply(func, target, False)
    assert (sch is not None) == scheduled
    # either way the library builds: a declined kernel goes to the next rule
    out = tvm_build.build_library(mod, {}, arch="sm_90", out_path=tmp_path / "norm.so")
    assert out.stat().st_size > 0
