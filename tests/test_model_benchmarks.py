"""The GEMM and whole-model benchmarks' pure parts: kernel classes, tables, the selector's
per-class summary. CPU only; the timed halves run on the GPU machine."""

from __future__ import annotations

from typing import Any

from benchmarks import gemm_bench, models_gpu


def test_kernel_names_fall_into_the_classes_the_breakdown_reports() -> None:
    assert models_gpu.kernel_class("sm90_xmma_gemm_f16f16_f32") == "gemm"
    assert models_gpu.kernel_class("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT") == "gemm"
    assert models_gpu.kernel_class("stackfuse_hopper_fmha_fwd") == "attention"
    assert models_gpu.kernel_class("cudnn_generated_fort_native_sdpa_sm90") == "attention"
    assert models_gpu.kernel_class("fused_layer_norm_kernel") == "other"


def _model_row(**over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "case": "gpt2_small_b8_s1024",
        "sites": 12,
        "fused_stacked": 12,
        "gemm_sites": 48,
        "gemm_offloaded": 48,
        "gemm_configurations": 3,
        "rel_error": 1.5e-3,
        "eager_rel_error": 1.4e-3,
        "passed": True,
        "eager_us": 6700.0,
        "torch_compile_us": 4800.0,
        "stackfuse_us": 4000.0,
        "speedup_vs_eager": 1.675,
        "speedup_vs_torch_compile": 1.2,
        "gpu_us_by_class": {
            "stackfuse": {"gemm": 2500.0, "attention": 500.0, "other": 1000.0, "total": 4000.0}
        },
    }
    row.update(over)
    return row


def test_the_model_table_shows_milliseconds_ratios_and_the_breakdown() -> None:
    doc = {
        "device": "NVIDIA H200",
        "date": "2026-12-03",
        "torch": "2.11",
        "command": "python -m benchmarks.models_gpu check .gpu/models $OUT",
        "timing": "CUDA events",
        "reference": "fp32 eager",
        "results": [
            _model_row(),
            _model_row(case="llama_b1_s2048", torch_compile_max_autotune_error="skipped: time"),
        ],
    }
    md = models_gpu.to_markdown(doc)
    row = next(
        line for line in md.splitlines() if line.startswith("| gpt2_small_b8_s1024 | sm_90 | 12/12")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:5] == ["48/48", "3"]
    assert cells[8:12] == ["6.70", "4.80", "-", "4.00"]
    assert cells[12:15] == ["1.68x", "1.20x", "-"]
    assert "| gpt2_small_b8_s1024 | - | - | - | 2.50 / 0.50 / 1.00 = 4.00 |" in md
    assert "- llama_b1_s2048 (torch_compile_max_autotune_error): skipped: time" in md


def _gemm_row(shape: str, m: int, n: int, k: int, ours: dict[str, float]) -> dict[str, Any]:
    t_peer = 1e-4
    timed = {
        t: {"s": t_peer / r, "vs_cublas": r, "tflops": 2 * m * n * k / (t_peer / r) / 1e12}
        for t, r in ours.items()
    }
    best = max(timed, key=lambda t: timed[t]["vs_cublas"])
    return {
        "shape": shape, "m": m, "n": n, "k": k, "dtype": "float16", "b_layout": "k_major",
        "epilogue": "bias", "cublas_s": t_peer, "cublas_tflops": 2 * m * n * k / t_peer / 1e12,
        "ours": timed, "best_tile": best, "best_vs_cublas": timed[best]["vs_cublas"],
    }  # fmt: skip


def test_the_gemm_summary_takes_each_class_geomean_per_tile() -> None:
    doc = {
        "rows": [
            _gemm_row("a", 8192, 768, 768, {"t1": 1.0, "t2": 0.5}),
            _gemm_row("b", 8192, 1024, 3072, {"t1": 0.25, "t2": 2.0}),
            _gemm_row("c", 512, 4096, 1024, {"t1": 0.9}),
        ]
    }
    per = gemm_bench.suggest(doc)
    assert per["large/narrow/shallow"] == {"t1": 1.0, "t2": 0.5}
    assert per["large/narrow/deep"] == {"t1": 0.25, "t2": 2.0}
    assert per["small/wide/shallow"] == {"t1": 0.9}


def test_the_gemm_table_names_the_best_tile_and_the_geomean() -> None:
    doc = {
        "device": "NVIDIA H200",
        "torch": "2.11",
        "date": "2026-12-03",
        "rounds": 3,
        "calls_per_round": 20,
        "rows": [
            _gemm_row("a", 8192, 768, 768, {"t1": 1.0, "t2": 0.5}),
            _gemm_row("b", 8192, 1024, 3072, {"t1": 0.25, "t2": 4.0}),
        ],
    }
    md = gemm_bench.to_markdown(doc)
    assert "1.000x (t1)" in md and "4.000x (t2)" in md
    assert "geometric mean 2.000x, minimum 1.000x over 2 rows" in md


def test_dynamic_runs_sit_beside_their_static_case_with_the_ratio() -> None:
    assert models_gpu.static_case("gpt2_small", 8, 512) == "gpt2_small_b8_s512"
    bounds, runs = models_gpu.DYNAMIC["gpt2_small_dynamic"]
    assert bounds == {"batch": 8, "seq": 1024}
    assert all(models_gpu.static_case("gpt2_small", b, s) for b, s in runs)
    dims = [{"name": "batch", "upper_bound": 8}, {"name": "seq", "upper_bound": 1024}]
    rows = [
        _model_row(case="gpt2_small_b8_s512", stackfuse_us=2000.0),
        _model_row(
            case="gpt2_small_dynamic@b8_s512",
            static_case="gpt2_small_b8_s512",
            dynamic=dims,
            stackfuse_us=2050.0,
        ),
    ]
    models_gpu.vs_static(rows)
    assert rows[1]["vs_static"] == round(2000 / 2050, 3)
    doc = {
        "device": "NVIDIA H200",
        "date": "2026-12-04",
        "command": "c",
        "timing": "t",
        "reference": "r",
        "results": rows,
    }
    md = models_gpu.to_markdown(doc)
    assert (
        "| gpt2_small_dynamic@b8_s512 | batch <= 8, seq <= 1024 | gpt2_small_b8_s512 | 0.0015 "
        "| True | 2.05 | 2.00 | 0.976 |"
    ) in md
