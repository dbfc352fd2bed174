"""GEMM offload: patterns and their checks, the transposed-weight layout, the report's GEMM
entries, the glue's numbers, and lifted weight transforms (CPU: the lifted library against the
unlifted one, both built by TVM for llvm). One nvcc test builds a configuration."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.spec import CompileOptions
from worker import (
    gemm_families,
    gemm_partition,
    gemm_selection,
    gemm_sm80,
    gemm_sm90,
    lift,
    normalize,
)
from worker.gemm import weight_spec
from worker.toolchain import import_tvm

tvm = import_tvm()

from tvm import relax  # noqa: E402
from tvm.script import relax as R  # noqa: E402
from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import relax as rb  # noqa: E402

OPTS = CompileOptions()


def linear_module(
    m: int = 128,
    k: int = 64,
    n: int = 96,
    *,
    dtype: str = "float16",
    transposed: bool = True,
    cast: bool = True,
    bias: str | None = "col",
    act: str | None = None,
    residual: bool = False,
    reshape: bool = False,
    num_input: int | None = None,
    leak: bool = False,
) -> Any:
    """``x[M, K] @ W (stored [N, K] and permuted, or [K, N]) -> astype -> + bias -> reshape ->
    act | + residual``, as TVM's importers write a linear layer."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((m, k), dtype))
        w = R.arg("w", R.Tensor((n, k) if transposed else (k, n), dtype))
        bshape = {"col": (n,), "full": (m, n)}.get(bias or "")
        b = R.arg("b", R.Tensor(bshape, dtype)) if bshape else None
        out_shape = (2, m // 2, n) if reshape else (m, n)
        r = R.arg("r", R.Tensor(out_shape, dtype)) if residual else None
        if num_input is not None:
            R.func_attr({"num_input": num_input})
        with R.dataflow() as frame:
            wt = R.emit(R.permute_dims(w, [1, 0])) if transposed else w
            y = R.emit(R.matmul(x, wt, out_dtype="float32" if cast else dtype))
            if cast:
                y = R.emit(R.astype(y, dtype))
            pre_bias = y
            if b is not None:
                y = R.emit(R.add(b, y))
            if reshape:
                y = R.emit(R.reshape(y, out_shape))
            if act is not None:
                y = R.emit(getattr(R.nn, act)(y))
            if r is not None:
                y = R.emit(R.add(y, r))
            if leak:
                y = R.emit(R.add(y, R.reshape(pre_bias, out_shape) if reshape else pre_bias))
            R.output(y)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


def _gemms(mod: Any, arch: str = "sm_90", options: CompileOptions = OPTS) -> Any:
    return gemm_partition.partition_gemms(mod, options, arch)


# --------------------------------------------------------------------------------------------
# patterns and checks
# --------------------------------------------------------------------------------------------
def test_pattern_order_tries_longer_epilogues_first() -> None:
    order = list(gemm_partition.GEMM_PATTERN_ORDER)
    assert order.index("cutlass.gemm.t_cast_bias_reshape_residual") < order.index(
        "cutlass.gemm.t_cast_bias"
    )
    assert order.index("cutlass.gemm.t_cast_bias_gelu") < order.index("cutlass.gemm.t_cast_bias")
    assert order.index("cutlass.gemm.t_cast_bias") < order.index("cutlass.gemm.t")
    assert order[-1] == "cutlass.gemm.n"


@pytest.mark.parametrize(
    ("kwargs", "pattern", "epilogue", "layout"),
    [
        ({}, "cutlass.gemm.t_cast_bias", ["bias"], "k_major"),
        ({"transposed": False}, "cutlass.gemm.n_cast_bias", ["bias"], "n_major"),
        ({"cast": False, "bias": None}, "cutlass.gemm.t", [], "k_major"),
        ({"act": "gelu"}, "cutlass.gemm.t_cast_bias_gelu", ["bias", "gelu"], "k_major"),
        (
            {"act": "gelu_tanh"},
            "cutlass.gemm.t_cast_bias_gelu_tanh",
            ["bias", "gelu_tanh"],
            "k_major",
        ),
        ({"act": "relu"}, "cutlass.gemm.t_cast_bias_relu", ["bias", "relu"], "k_major"),
        ({"act": "silu", "bias": None}, "cutlass.gemm.t_cast_silu", ["silu"], "k_major"),
        (
            {"residual": True, "reshape": True},
            "cutlass.gemm.t_cast_bias_reshape_residual",
            ["bias", "residual"],
            "k_major",
        ),
        ({"residual": True, "bias": None}, "cutlass.gemm.t_cast_residual", ["residual"], "k_major"),
    ],
)
def test_linear_layers_offload_with_their_epilogue(
    kwargs: dict[str, Any], pattern: str, epilogue: list[str], layout: str
) -> None:
    res = _gemms(linear_module(**kwargs))
    (entry,) = res.entries
    assert entry.offloaded, entry.reason
    assert entry.pattern == pattern
    assert entry.epilogue == epilogue
    assert entry.b_layout == layout
    (ff,) = res.functions
    spec = ff.spec
    assert (spec.n, spec.k, spec.m) == (96, 64, 128)
    assert spec.b_kmajor == (layout == "k_major")
    # no matmul is left in main: the kernel replaced it (and the permute_dims: no copy)
    text = res.mod["main"].script()
    assert "R.matmul(" not in text and "R.permute_dims(" not in text


def test_transposed_weight_is_read_in_place_by_its_operand_index() -> None:
    res = _gemms(linear_module(residual=True, reshape=True))
    (ff,) = res.functions
    spec = ff.spec
    # the fused function's parameters: x, w (as stored, [N, K]), b, r -- in some order
    shapes = spec.operand_shapes
    assert shapes[spec.a] == (128, 64)
    assert shapes[spec.b] == (96, 64)  # [N, K]: the permute_dims is folded into the layout
    assert shapes[spec.bias] == (96,)
    assert shapes[spec.residual] == (2, 64, 96)
    assert spec.out_shape == (2, 64, 96)


@pytest.mark.parametrize(
    ("kwargs", "check", "words"),
    [
        ({"k": 37}, "alignment", "K = 37 is not a multiple of 8"),
        ({"n": 90}, "alignment", "N = 90 is not a multiple of 8"),
        ({"dtype": "float32", "cast": False}, "dtype", "set options.allow_tf32"),
        ({"dtype": "float32", "cast": False, "k": 66}, "dtype", "full float32 precision"),
    ],
)
def test_gemms_that_stay_in_tvm_say_why(kwargs: dict[str, Any], check: str, words: str) -> None:
    res = _gemms(linear_module(**kwargs))
    (entry,) = res.entries
    assert not entry.offloaded
    assert words in entry.reason
    assert check in {f.check for f in entry.check_failures}
    assert "R.matmul(" in res.mod["main"].script()


TF32 = CompileOptions(allow_tf32=True)


def test_tf32_leaves_float32_weights_stored_k_by_n_to_tvm() -> None:
    res = _gemms(linear_module(dtype="float32", cast=False, transposed=False), options=TF32)
    (entry,) = res.entries
    assert not entry.offloaded
    assert "tf32_layout" in {f.check for f in entry.check_failures}
    assert "stored [K, N]" in entry.reason


@pytest.mark.parametrize("transposed", [True])
def test_float32_matmuls_run_as_tf32_when_the_client_opts_in(transposed: bool) -> None:
    res = _gemms(
        linear_module(dtype="float32", cast=False, act="gelu", transposed=transposed), options=TF32
    )
    (entry,) = res.entries
    assert entry.offloaded, entry.reason
    assert entry.epilogue == ["bias", "gelu"]
    (ff,) = res.functions
    ks, reason = gemm_families.select_kernel(ff.spec, "sm_90")
    assert "TF32 (options.allow_tf32)" in reason
    (cfg,) = ks.needs
    # float operands (the builder's TF32 MMA), half the 16-bit tile's K: the same stage bytes
    assert cfg.config["dtype"] == "float32"
    tile = gemm_sm90.TILES[cfg.config["tile"]]
    assert (
        f"Config<float, {'true' if transposed else 'false'}, {tile.m}, {tile.n}, {tile.k // 2}, "
        in cfg.source
    )
    assert "/*dtype_bits=*/32" in ks.source
    # ... and it is not the float16 configuration of the same tile
    half, _ = gemm_families.select_kernel(
        weight_spec(
            dtype="float16", m=128, n=96, k=64, b_kmajor=transposed, bias=True, activation="gelu"
        ),
        "sm_90",
    )
    assert half.needs[0].symbol != cfg.symbol


def test_tf32_takes_float32_alignment_and_stays_on_hopper() -> None:
    # 16-byte rows hold 4 float32s: K = 36 is aligned for TF32, not K = 38
    assert (
        _gemms(linear_module(dtype="float32", cast=False, k=36), options=TF32).entries[0].offloaded
    )
    entry = _gemms(linear_module(dtype="float32", cast=False, k=38), options=TF32).entries[0]
    assert not entry.offloaded and "K = 38 is not a multiple of 4" in entry.reason
    entry = _gemms(linear_module(dtype="float32", cast=False), "sm_80", TF32).entries[0]
    assert not entry.offloaded and "TF32 GEMMs are built for sm_90 only" in entry.reason
    # float16 sites of the same job still offload there
    assert _gemms(linear_module(), "sm_80", TF32).entries[0].offloaded


def test_tf32_libraries_are_validated_with_a_tf32_tolerance() -> None:
    from worker import validate

    assert validate.tolerances(OPTS)["float32"] == validate.TOLERANCE["float32"]
    assert validate.tolerances(TF32)["float32"] == validate.TF32_TOLERANCE
    assert validate.tolerances(TF32)["float16"] == validate.TOLERANCE["float16"]


def test_a_full_size_added_term_is_not_a_bias_but_a_residual() -> None:
    res = _gemms(linear_module(bias="full"))
    (entry,) = res.entries
    assert entry.offloaded
    assert entry.epilogue == ["residual"]


def test_an_intermediate_read_elsewhere_stays_out_of_the_epilogue() -> None:
    res = _gemms(linear_module(leak=True))
    (entry,) = res.entries
    assert entry.offloaded
    # the bias add could not absorb the matmul's result (read by the leak), so only the
    # matmul and its cast fused
    assert entry.epilogue == []
    assert "R.add(" in res.mod["main"].script()


@pytest.mark.parametrize(
    ("arch", "options", "words"),
    [
        ("sm_75", OPTS, "on other archs every matmul stays in TVM"),
        ("sm_90", CompileOptions(offload_gemm=False), "offload_gemm is false"),
    ],
)
def test_gemm_offload_off_or_elsewhere_is_reported(
    arch: str, options: CompileOptions, words: str
) -> None:
    res = _gemms(linear_module(), arch, options)
    (entry,) = res.entries
    assert not entry.offloaded and words in entry.reason
    assert not res.functions


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89"])
def test_ampere_class_archs_offload_to_the_cutlass_2_family(
    arch: str,
) -> None:
    res = _gemms(linear_module(act="gelu"), arch)
    (entry,) = res.entries
    assert entry.offloaded, entry.reason
    (ff,) = res.functions
    ks, reason = gemm_families.select_kernel(ff.spec, arch)
    assert ks.family == gemm_sm80.FAMILY
    assert f"CUTLASS 2 tensor-op GEMM for {arch}" in reason and "bias + gelu" in reason
    (cfg,) = ks.needs
    # one sm_80 object (with its PTX) serves every Ampere-class arch
    assert cfg.flags[0] == gemm_sm80.GENCODE
    assert "GELU>" not in cfg.source and "cutlass::epilogue::thread::GELU, false>" in cfg.source
    # the glue is the Hopper family's, calling another configuration
    hopper, _ = gemm_families.select_kernel(ff.spec, "sm_90")
    assert hopper.family == gemm_sm90.FAMILY and hopper.symbol != ks.symbol
    assert hopper.needs[0].symbol != cfg.symbol


def test_ampere_tiles_shrink_for_small_outputs() -> None:
    big = weight_spec(dtype="float16", m=8192, n=3072, k=768, b_kmajor=True)
    small = weight_spec(dtype="float16", m=256, n=768, k=768, b_kmajor=True)
    assert gemm_sm80.select(big)[0].name == "tb128x256_w64x64_s3"
    tile, why = gemm_sm80.select(small)
    assert (tile.m, tile.n) == (64, 64) and "not measured on sm_80-class hardware" in why
    gate = weight_spec(dtype="bfloat16", m=2048, n=1408, k=512, b_kmajor=True, gate=True)
    ks, _ = gemm_sm80.select_kernel(gate, "sm_80")
    assert "stackfuse::gemm::SiLuGate, true>" in ks.needs[0].source
    assert ks.needs[0].symbol in {c.symbol for c in gemm_sm80.selected_configs(("bfloat16",))}


def test_tanh_gelu_chain_becomes_one_operator() -> None:
    m = 64
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((m, 32), "float16"))
        with R.dataflow() as frame:
            cube = R.emit(R.multiply(R.multiply(x, x), x))
            inner = R.emit(R.add(x, R.multiply(cube, R.const(0.044715, "float16"))))
            t = R.emit(R.tanh(R.multiply(inner, R.const(0.7978845608, "float16"))))
            out = R.emit(
                R.multiply(
                    R.multiply(x, R.const(0.5, "float16")), R.add(t, R.const(1.0, "float16"))
                )
            )
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    new, rewrites = normalize.normalize(mod, OPTS)
    assert "gelu_tanh" in {r.rewrite for r in rewrites}
    assert "R.nn.gelu_tanh" in new["main"].script()
    assert "R.tanh" not in new["main"].script()
    x_np = np.random.default_rng(0).standard_normal((m, 32)).astype("float16")
    dev = tvm.cpu()

    def run(mod: Any) -> np.ndarray:
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), dev)
        return vm["main"](tvm.runtime.tensor(x_np, dev)).numpy().astype("float32")

    np.testing.assert_allclose(run(new), run(mod), atol=2e-3)


def test_x_times_sigmoid_x_becomes_silu_and_fuses_into_its_gemm() -> None:
    """torch.export writes SiLU (SwiGLU's gate) as x * sigmoid(x); as silu it is an epilogue."""
    m, k, n = 64, 32, 48
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((m, k), "float16"))
        w = R.arg("w", R.Tensor((n, k), "float16"))
        with R.dataflow() as frame:
            y = R.emit(R.matmul(x, R.permute_dims(w, [1, 0])))
            out = R.emit(R.multiply(y, R.sigmoid(y)))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    new, rewrites = normalize.normalize(mod, OPTS)
    assert "silu" in {r.rewrite for r in rewrites}
    assert "R.nn.silu" in new["main"].script() and "R.sigmoid" not in new["main"].script()
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((m, k)).astype("float16")
    w_np = (rng.standard_normal((n, k)) / k**0.5).astype("float16")
    dev = tvm.cpu()

    def run(mod: Any) -> np.ndarray:
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), dev)
        args = [tvm.runtime.tensor(a, dev) for a in (x_np, w_np)]
        return vm["main"](*args).numpy().astype("float32")

    np.testing.assert_allclose(run(new), run(mod), atol=2e-3)
    (entry,) = _gemms(new).entries
    assert entry.offloaded and entry.epilogue == ["silu"], entry


def swiglu_module(
    m: int = 64,
    k: int = 32,
    n: int = 48,
    *,
    casts: bool = True,
    gate_first: bool = True,
    gate_shape: tuple[int, ...] | None = None,
    dtype: str = "float16",
    transposed: bool = True,
    leak: bool = False,
    num_input: int | None = None,
) -> Any:
    """SwiGLU as transformers' Llama exports it: ``act(gate_proj(x)) * up_proj(x)``, the
    projections reshaped to ``[1, M, N]`` and, with ``casts``, the SiLU in float32 between two
    casts. ``gate_shape`` replaces the gate projection by an argument of that shape; weights are
    ``[N, K]`` read through ``permute_dims`` (``transposed``) or ``[K, N]``; ``leak`` adds the
    gate projection's output to the result (another reader of it)."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((m, k), dtype))
        wshape = (n, k) if transposed else (k, n)
        wg = R.arg("wg", R.Tensor(wshape, dtype))
        wu = R.arg("wu", R.Tensor(wshape, dtype))
        other = R.arg("g", R.Tensor(gate_shape, dtype)) if gate_shape else None
        if num_input is not None:
            R.func_attr({"num_input": num_input})
        with R.dataflow() as frame:
            acc = "float32" if dtype != "float32" else dtype

            def proj(w: Any) -> Any:
                wt = R.permute_dims(w, [1, 0]) if transposed else w
                y = R.emit(R.matmul(x, wt, out_dtype=acc))
                return R.emit(R.reshape(R.astype(y, dtype), (1, m, n)))

            gate = other if other is not None else proj(wg)
            if casts:
                act = R.emit(R.astype(R.nn.silu(R.astype(gate, "float32")), dtype))
            else:
                act = R.emit(R.nn.silu(gate))
            up = proj(wu)
            out = R.emit(R.multiply(act, up) if gate_first else R.multiply(up, act))
            if leak:
                out = R.emit(R.add(out, gate))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    return tvm.IRModule({"main": builder.get()})


@pytest.mark.parametrize("casts", [True, False])
@pytest.mark.parametrize("gate_first", [True, False])
def test_swiglu_fuses_silu_and_product_into_the_up_projection(
    casts: bool, gate_first: bool
) -> None:
    """The up projection's epilogue reads the gate projection's output as C: silu(C) * acc."""
    part = _gemms(swiglu_module(casts=casts, gate_first=gate_first))
    gate, up = part.entries
    assert gate.offloaded and gate.epilogue == [], gate
    assert up.offloaded and up.epilogue == ["silu_gate"], up
    script = part.mod["main"].script()
    assert "R.nn.silu" not in script and "R.multiply" not in script, script
    (ff,) = [f for f in part.functions if f.spec.has_gate]
    spec = ff.spec
    assert spec.c_operand == spec.gate >= 0 and not spec.has_residual
    assert spec.operand_shapes[spec.gate] == (64, 48)  # the gate as its GEMM wrote it
    ks, reason = gemm_sm90.select_kernel(spec, "sm_90")
    assert "silu_gate" in reason
    assert f"/*c=*/{spec.gate}," in ks.source
    assert "stackfuse::gemm::SiLuGate, true>" in ks.needs[0].source


def test_a_gate_that_is_not_the_outputs_shape_leaves_the_product_to_tvm() -> None:
    part = _gemms(swiglu_module(gate_shape=(48,)))
    (up,) = part.entries
    assert up.offloaded and up.epilogue == [], up
    assert "R.multiply" in part.mod["main"].script()


def test_the_gated_configuration_is_one_of_the_prebuilt_variants() -> None:
    ks = gemm_sm90.render_configuration(
        "float16", "pingpong_128x128_c1x2", True, gemm_sm90.SILU_GATE, True
    )
    assert ks.config["gate"] and ks.config["source_c"]
    assert (gemm_sm90.SILU_GATE, True) in gemm_sm90.EPILOGUE_VARIANTS
    assert ks.symbol in {c.symbol for c in gemm_sm90.selected_configs(("float16",))}


# --------------------------------------------------------------------------------------------
# the paired SwiGLU (sm_90): gate and up projections as one GEMM, columns paired in registers
# --------------------------------------------------------------------------------------------
def _interleaved(wg: np.ndarray, wu: np.ndarray, transposed: bool) -> np.ndarray:
    """Wgu: row 16j + i = Wg[8j + i] (i < 8), Wu[8j + i - 8] (8 <= i < 16); columns for [K, N]."""
    if not transposed:
        return _interleaved(wg.T, wu.T, True).T
    n, k = wg.shape
    return np.concatenate([wg.reshape(n // 8, 8, k), wu.reshape(n // 8, 8, k)], 1).reshape(-1, k)


@pytest.mark.parametrize("casts", [True, False])
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("transposed", [True, False])
def test_swiglu_becomes_one_paired_gemm_on_hopper(
    casts: bool, gate_first: bool, transposed: bool
) -> None:
    mod = swiglu_module(casts=casts, gate_first=gate_first, transposed=transposed)
    new, rewrites = normalize.normalize(mod, OPTS, "sm_90")
    (rw,) = [r for r in rewrites if r.rewrite == "combine_gate_up"]
    assert "1 SwiGLU MLP(s) (wg + wu)" in rw.message
    part = _gemms(new)
    (entry,) = part.entries  # one matmul site left: the paired GEMM
    assert entry.offloaded, entry.reason
    assert entry.epilogue == ["swiglu"]
    assert entry.b_layout == ("k_major" if transposed else "n_major")
    script = part.mod["main"].script()
    assert "R.nn.silu" not in script and "R.multiply" not in script, script
    (ff,) = part.functions
    spec = ff.spec
    assert spec.paired_glu and (spec.n, spec.k, spec.m) == (96, 32, 64)
    assert spec.out_shape == (1, 64, 48) and spec.out_n == 48
    assert not spec.has_gate and spec.c_operand == -1
    assert spec.operand_shapes[spec.b] == ((96, 32) if transposed else (32, 96))
    ks, reason = gemm_sm90.select_kernel(spec, "sm_90")
    assert "silu(gate) * up, gate and up projections as one GEMM" in reason
    assert "columns paired in registers" in reason and "gemm_bench_glu.md" in reason
    assert '#include "gemm_tvm_glu.cuh"' in ks.source and "run_paired_site(" in ks.source
    assert "/*n=*/96, /*k=*/32" in ks.source and "/*out_shape=*/{1, 64, 48," in ks.source
    (cfg,) = ks.needs
    assert '#include "gemm_sm90_glu.cuh"' in cfg.source
    assert "stackfuse::gemm::SwiGluPaired, false>" in cfg.source
    assert any(f.endswith("kernels_glu") for f in cfg.flags + ks.flags)


@pytest.mark.parametrize(
    ("kwargs", "arch"),
    [
        ({"leak": True}, "sm_90"),  # the gate projection's output is read elsewhere
        ({"dtype": "float32"}, "sm_90"),
        ({}, "sm_80"),
        ({}, "sm_86"),
        ({"n": 44}, "sm_90"),  # I not a multiple of 8
    ],
)
def test_combine_gate_up_only_where_the_paired_gemm_takes_it(
    kwargs: dict[str, Any], arch: str
) -> None:
    mod = swiglu_module(**kwargs)
    new, rewrites = normalize.normalize(mod, OPTS, arch)
    assert "combine_gate_up" not in {r.rewrite for r in rewrites}
    assert new["main"].script().count("R.matmul(") == 2
    if arch != "sm_90":  # Ampere-class archs keep the up projection's silu_gate epilogue
        gate, up = _gemms(new, arch).entries
        assert gate.offloaded and up.offloaded and up.epilogue == ["silu_gate"], up


def test_combine_gate_up_is_off_without_gemm_offload() -> None:
    opts = CompileOptions(offload_gemm=False)
    _, rewrites = normalize.normalize(swiglu_module(), opts, "sm_90")
    assert "combine_gate_up" not in {r.rewrite for r in rewrites}


def test_the_paired_pattern_stays_in_tvm_off_hopper() -> None:
    new, _ = normalize.normalize(swiglu_module(), OPTS, "sm_90")
    part = _gemms(new, "sm_80")
    (entry,) = part.entries  # the matmul alone runs on the sm_80 family; the pairing in TVM
    assert entry.offloaded and entry.epilogue == [], entry
    assert "R.multiply" in part.mod["main"].script()


@pytest.mark.parametrize("casts", [True, False])
@pytest.mark.parametrize("transposed", [True, False])
def test_combined_gate_up_computes_the_same_swiglu_lifted(casts: bool, transposed: bool) -> None:
    """The rewritten module (unpartitioned: what TVM runs if the GEMM is not offloaded), its
    weight interleave lifted into main_transform_params, against the original and numpy."""
    m, k, n = 32, 64, 48
    mod = swiglu_module(m, k, n, casts=casts, transposed=transposed, num_input=1)
    new, _ = normalize.normalize(mod, OPTS, "sm_90")
    lifted, rewrite, _ = lift.lift_params(new)
    assert rewrite is not None
    assert "R.concat(" in lifted[lift.TRANSFORM].script()
    main = lifted["main"].script()
    assert "R.concat(" not in main and main.count("R.matmul(") == 1
    rng = np.random.default_rng(3)
    x_np = (rng.standard_normal((m, k)) * 0.5).astype("float16")
    shape = (n, k) if transposed else (k, n)
    wg_np, wu_np = ((rng.standard_normal(shape) / k**0.5).astype("float16") for _ in range(2))
    dev = tvm.cpu()

    def tensors(*arrays: np.ndarray) -> list[Any]:
        return [tvm.runtime.tensor(a, dev) for a in arrays]

    ref_vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), dev)
    want = ref_vm["main"](*tensors(x_np, wg_np, wu_np)).numpy().astype("float32")
    vm = relax.VirtualMachine(tvm.compile(lifted, target="llvm"), dev)
    params = list(vm[lift.TRANSFORM](tensors(wg_np, wu_np)))
    # [K, 2I] either way here: unpartitioned, TVM's transpose of Wgu is lifted with it
    wgu = params[0].numpy()
    np.testing.assert_array_equal(
        wgu,
        _interleaved(wg_np, wu_np, transposed).reshape(-1, k).T
        if transposed
        else _interleaved(wg_np, wu_np, False),
    )
    got = vm["main"](*tensors(x_np), *params).numpy().astype("float32")
    assert got.shape == want.shape == (1, m, n)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-2)
    x32 = x_np.astype("float32")
    wg32, wu32 = (
        w.astype("float32") if transposed else w.astype("float32").T for w in (wg_np, wu_np)
    )
    g, u = x32 @ wg32.T, x32 @ wu32.T
    np.testing.assert_allclose(got[0], g / (1 + np.exp(-g)) * u, atol=1e-2, rtol=2e-2)


def test_paired_gemm_with_symbolic_rows() -> None:
    """Serving: the sequence is symbolic; the pairing reshapes keep it, the spec reads M at
    run time, and TVM computes the rewritten module exactly as the original."""
    k, n = 32, 48
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        s = tvm.tirx.Var("s", "int64")
        x = R.arg("x", R.Tensor((1, s, k), "float16"))
        wg = R.arg("wg", R.Tensor((n, k), "float16"))
        wu = R.arg("wu", R.Tensor((n, k), "float16"))
        with R.dataflow() as frame:
            g = R.emit(R.matmul(x, R.permute_dims(wg, [1, 0])))
            u = R.emit(R.matmul(x, R.permute_dims(wu, [1, 0])))
            out = R.emit(R.multiply(R.nn.silu(g), u))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    new, rewrites = normalize.normalize(mod, OPTS, "sm_90")
    assert "combine_gate_up" in {r.rewrite for r in rewrites}
    (ff,) = _gemms(new).functions
    assert ff.spec.paired_glu and ff.spec.m == "?" and ff.spec.out_shape == (1, "?", 48)
    assert "/*out_shape=*/{1, -1, 48," in gemm_sm90.select_kernel(ff.spec, "sm_90")[0].source
    rng = np.random.default_rng(4)
    args = [
        (rng.standard_normal(shape) * scale).astype("float16")
        for shape, scale in (((1, 40, k), 0.5), ((n, k), 0.2), ((n, k), 0.2))
    ]
    dev = tvm.cpu()
    outs = [
        relax.VirtualMachine(tvm.compile(m, target="llvm"), dev)["main"](
            *[tvm.runtime.tensor(a, dev) for a in args]
        ).numpy()
        for m in (mod, new)
    ]
    np.testing.assert_array_equal(outs[1], outs[0])


def test_partitioned_paired_gemm_reads_the_lifted_interleave_in_place() -> None:
    new, _ = normalize.normalize(swiglu_module(num_input=1), OPTS, "sm_90")
    part = _gemms(new)
    lifted, rewrite, _ = lift.lift_params(part.mod)
    assert rewrite is not None
    transform = lifted[lift.TRANSFORM].script()
    assert "R.concat(" in transform and "R.permute_dims(" not in transform
    assert "R.Tensor((96, 32)" in transform  # Wgu [2I, K], read K-major by the kernel
    main = lifted["main"].script()
    assert "R.concat(" not in main and "R.reshape(wg" not in main


def test_the_paired_configuration_is_prebuilt() -> None:
    ks = gemm_sm90.render_configuration(
        "bfloat16", "pingpong_128x128_c1x2", False, gemm_sm90.SWIGLU, False
    )
    assert ks.config["paired_glu"] and ks.config["activation"] == "swiglu"
    assert "cutlass::bfloat16_t, false, 128, 128, 64, 1, 2" in ks.source
    syms = {c.symbol for c in gemm_sm90.selected_configs()}
    assert ks.symbol in syms
    (tile,) = {t for t, _ in gemm_selection.PAIRED_PICKS.values()}
    paired = [c for c in gemm_sm90.selected_configs() if c.config.get("paired_glu")]
    assert len(paired) == 4 and {c.config["tile"] for c in paired} == {tile}
    # Ampere-class prebuilds have no paired configuration
    assert not [c for c in gemm_sm80.selected_configs() if "SwiGluPaired" in c.source]


def test_existing_configurations_keep_their_source() -> None:
    """The paired SwiGLU's epilogue lives in kernels_glu: every other configuration's generated
    source (its kernel-cache key, with worker/kernels' digest) includes only gemm_sm90.cuh."""
    for ks in gemm_sm90.selected_configs():
        paired = bool(ks.config.get("paired_glu"))
        assert ("gemm_sm90_glu.cuh" in ks.source) == paired
        assert ("kernels_glu" in " ".join(ks.flags)) == paired
        if not paired:
            assert ks.source.startswith(
                "// Generated by stackfuse worker.gemm_sm90 (cutlass_gemm_sm90 configuration). "
                'Type names only.\n#include "gemm_sm90.cuh"\n'
            )


# --------------------------------------------------------------------------------------------
# glue and selection
# --------------------------------------------------------------------------------------------
def test_glue_carries_the_sites_numbers_and_names_its_configuration() -> None:
    spec = weight_spec(dtype="bfloat16", m="?", n=3072, k=768, b_kmajor=False, bias=True)
    tile, _ = gemm_sm90.select(spec)
    ks = gemm_sm90.render(spec, tile)
    (cfg,) = ks.needs
    assert cfg.symbol in ks.source and cfg.symbol.startswith("stackfuse_gcfg_")
    assert "/*n=*/3072, /*k=*/768" in ks.source
    assert "/*dtype_code=*/4" in ks.source  # kDLBfloat
    assert "cutlass::bfloat16_t, false," in cfg.source  # B [K, N]
    # the problem size is not part of the configuration: every M shares it
    other = weight_spec(dtype="bfloat16", m=8192, n=768, k=3072, b_kmajor=False, bias=True)
    other_tile, _ = gemm_sm90.select(other)
    if other_tile == tile:
        assert gemm_sm90.render(other, other_tile).needs[0].source == cfg.source


def test_every_shape_class_has_a_tile_that_exists_and_names_measured_rows() -> None:
    from benchmarks.gemm_bench import GLU_SHAPES, GRID_SHAPES, MODEL_SHAPES

    shapes = {name: (m, n, k) for name, m, n, k in MODEL_SHAPES + GRID_SHAPES}
    bands = [(r, n, k) for r in ("small", "medium", "large") for n in ("narrow", "mid", "wide")
             for k in ("shallow", "deep")]  # fmt: skip
    assert sorted(gemm_selection.SELECTION) == sorted(bands)
    for key, (name, why) in gemm_selection.SELECTION.items():
        assert name in gemm_sm90.TILES
        rows = [w.strip() for w in why.split(",") if w.strip() in shapes]
        for row in rows:  # each named row lies in the class it justifies
            m, n, k = shapes[row]
            spec = weight_spec(dtype="float16", m=m, n=n, k=k, b_kmajor=True)
            assert gemm_selection.shape_class(spec) == key, (row, key)
        assert rows or why.startswith("no row"), why
    for (act, rows_band, depth), (name, why) in gemm_selection.EPILOGUE_PICKS.items():
        assert name in gemm_sm90.TILES
        m, n, k = shapes[why]
        spec = weight_spec(dtype="float16", m=m, n=n, k=k, b_kmajor=True, activation=act)  # type: ignore[arg-type]
        assert gemm_selection.shape_class(spec)[::2] == (rows_band, depth)
        assert gemm_selection.pick(spec)[0] == name
    glu = {name: (m, n, k) for name, m, n, k in GLU_SHAPES}
    assert sorted(gemm_selection.PAIRED_PICKS) == ["large", "medium", "small"]
    for rows_band, (name, why) in gemm_selection.PAIRED_PICKS.items():
        assert name in gemm_sm90.TILES
        if why.startswith("no row"):
            continue
        m, n, k = glu[why]
        spec = weight_spec(dtype="float16", m=m, n=n, k=k, b_kmajor=True, paired_glu=True)
        assert gemm_selection.shape_class(spec)[0] == rows_band
        assert gemm_selection.pick(spec)[0] == name


def test_shape_classes_of_the_models_layers() -> None:
    def cls(m: int | str, n: int, k: int) -> tuple[str, str, str]:
        spec = weight_spec(dtype="float16", m=m, n=n, k=k, b_kmajor=True)
        return gemm_selection.shape_class(spec)

    assert cls(4096, 768, 3072) == ("medium", "narrow", "deep")  # BERT-base B32 S128 fc2
    assert cls(2048, 2048, 5632) == ("medium", "mid", "deep")  # Llama-style B1 S2048 down
    assert cls(8192, 2304, 768) == ("large", "wide", "shallow")  # GPT-2 small B8 S1024 qkv
    assert cls("n", 768, 768) == ("large", "narrow", "shallow")  # a symbolic M: serving


# --------------------------------------------------------------------------------------------
# lifted weight transforms
# --------------------------------------------------------------------------------------------
def test_weight_transforms_run_once_and_outputs_match(tmp_path: Any) -> None:
    # a combined-QKV-like weight: concat of transposed weights, computed from weights alone
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        x = R.arg("x", R.Tensor((16, 32), "float32"))
        wq = R.arg("wq", R.Tensor((24, 32), "float32"))
        wk = R.arg("wk", R.Tensor((24, 32), "float32"))
        R.func_attr({"num_input": 1})
        with R.dataflow() as frame:
            w = R.emit(R.concat([R.permute_dims(wq, [1, 0]), R.permute_dims(wk, [1, 0])], axis=1))
            out = R.emit(R.matmul(x, w))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    mod = tvm.IRModule({"main": builder.get()})
    lifted, rewrite, convention = lift.lift_params(mod)
    assert rewrite is not None and "main_transform_params" in convention
    assert "concat" not in lifted["main"].script()
    assert "concat" in lifted[lift.TRANSFORM].script()
    rng = np.random.default_rng(1)
    x_np, wq_np, wk_np = (
        rng.standard_normal(s).astype("float32") for s in ((16, 32), (24, 32), (24, 32))
    )
    dev = tvm.cpu()
    ref = relax.VirtualMachine(tvm.compile(mod, target="llvm"), dev)
    want = ref["main"](*(tvm.runtime.tensor(a, dev) for a in (x_np, wq_np, wk_np))).numpy()
    vm = relax.VirtualMachine(tvm.compile(lifted, target="llvm"), dev)
    params = list(vm[lift.TRANSFORM]([tvm.runtime.tensor(a, dev) for a in (wq_np, wk_np)]))
    got = vm["main"](tvm.runtime.tensor(x_np, dev), *params).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, x_np @ np.concatenate([wq_np.T, wk_np.T], axis=1), rtol=1e-4)


def test_modules_without_weights_keep_their_calling_convention() -> None:
    mod = linear_module()
    same, rewrite, convention = lift.lift_params(mod)
    assert same is mod and rewrite is None and convention == lift.CONVENTION_PLAIN


# --------------------------------------------------------------------------------------------
# nvcc
# --------------------------------------------------------------------------------------------
@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            weight_spec(dtype="float16", m=128, n=96, k=64, b_kmajor=True, bias=True),
            ("CUTLASS 3 Hopper GEMM", "bias"),
        ),
        (
            weight_spec(dtype="float16", m="?", n=11264, k=2048, b_kmajor=True, paired_glu=True),
            ("columns paired in registers",),
        ),
    ],
    ids=["bias", "paired_swiglu"],
)
def test_a_gemm_configuration_and_its_glue_compile(spec: Any, words: tuple[str, ...]) -> None:
    from worker.nvcc import compile_object

    ks, reason = gemm_sm90.select_kernel(spec, "sm_90")
    assert all(w in reason for w in words), reason
    ck = compile_object(ks)
    assert ck.object_path.stat().st_size > 0
    (cfg_obj,) = ck.needs
    assert cfg_obj.stat().st_size > 100_000  # the CUTLASS kernel's machine code is in there


@pytest.mark.nvcc
@pytest.mark.slow
def test_the_paired_epilogue_pairs_every_gate_with_its_up_column(tmp_path: Any) -> None:
    """The epilogue's loop on the host (gemm_glu_layout_check.cu), over every thread of six
    tiled MMAs: each store's gate, gate + 1, up, up + 1 are columns n, n + 1, n + 8, n + 9 of
    one row, and the stores cover the tile's [TileM, TileN / 2] output exactly once."""
    import subprocess
    from pathlib import Path

    from worker.toolchain import find_toolchain

    chain = find_toolchain()
    here = Path(__file__).resolve().parent
    exe = tmp_path / "layout_check"
    includes = [gemm_sm90.GLU_KERNELS_DIR, *gemm_sm90.include_dirs()]
    subprocess.run(
        [
            str(chain.cuda_home / "bin" / "nvcc"),
            "-O1",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-DNDEBUG",
            "-w",
            gemm_sm90.GENCODE,
            *(f"-I{p}" for p in includes),
            "-o",
            str(exe),
            str(here / "gemm_glu_layout_check.cu"),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ALL OK"), out.stdout


@pytest.mark.nvcc
@pytest.mark.slow
def test_one_ampere_gemm_configuration_and_its_glue_compile() -> None:
    from worker.nvcc import compile_object

    spec = weight_spec(dtype="float16", m=128, n=96, k=64, b_kmajor=True, bias=True, residual=True)
    ks, _ = gemm_families.select_kernel(spec, "sm_80")
    ck = compile_object(ks)
    (cfg_obj,) = ck.needs
    # the configuration carries the CUTLASS kernel's device code (sm_80 SASS and its PTX)
    assert _fatbin_bytes(cfg_obj) > 20_000
    assert _fatbin_bytes(cfg_obj) > 10 * _fatbin_bytes(ck.object_path)


def _fatbin_bytes(obj: Any) -> int:
    """The size of an object's embedded device code (its ``.nv_fatbin`` section; 0: none)."""
    import subprocess

    out = subprocess.run(
        ["readelf", "-S", "-W", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    for line in out.splitlines():
        parts = line.replace("[ ", "[").split()
        if ".nv_fatbin" in parts:
            return int(parts[parts.index(".nv_fatbin") + 4], 16)
    return 0
