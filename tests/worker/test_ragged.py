"""Ragged batches (``R.nn.attention_var_len``) on the SM80-class fMHA's seqstart path.

The forms a ragged batch comes in (one packed stacked tensor or separate q/k/v; seqstart given
or computed from the lengths; keys with offsets of their own; causal or not) are partitioned
into one site each, their spec and generated source checked; what the kernel refuses takes the
masked rewrite with the kernel's reason, or fails the job before codegen where no rewrite
applies. The CPU cannot run the kernel: nvcc compiles its source for sm_80 and sm_90, and a
library with it loads in TVM. ``benchmarks/gpu_cases.py`` holds the GPU numerics (``ragged_*``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from service.errors import CompileError
from service.settings import Settings
from service.spec import CompileOptions, Target
from tests.models import ragged_attention_module, to_json
from worker import selection
from worker.attention import AttentionSpec
from worker.normalize import normalize
from worker.partition import PartitionResult, partition
from worker.pipeline import compile_module

OPTS = CompileOptions()
N, H = 8, 32


def _normalized(mod: Any, arch: str = "sm_90", opts: CompileOptions = OPTS) -> Any:
    out, rewrites = normalize(mod, opts, arch)
    return out, {r.rewrite: r for r in rewrites}


def _site(result: PartitionResult) -> tuple[Any, AttentionSpec]:
    assert len(result.sites) == 1 and not result.unbuildable, result.failures
    (m,) = result.match_entries()
    (ff,) = result.functions
    assert ff.analysis.spec is not None
    return m, ff.analysis.spec


def _source(spec: AttentionSpec, arch: str) -> str:
    ks, reason = selection.select_kernel(spec, arch, OPTS.kernel)
    assert ks.family == "cutlass_fmha_sm80", reason
    return ks.source


def assign(src: str, field: str) -> str:
    m = re.search(rf"p\.{re.escape(field)} = ([^;]+);", src)
    assert m, f"{field} not set"
    return m.group(1).strip()


FORMS = {
    # name: (builder kwargs, pattern, kind)
    "stacked_split_cumsum": ({}, "cutlass.stacked_attention_var_len.split", "stacked"),
    "stacked_slice_cumsum_topleft": (
        {"layout": "strided_slice", "causal": "TopLeft"},
        "cutlass.stacked_attention_var_len.strided_slice",
        "stacked",
    ),
    "stacked_split_input_bottomright": (
        {"seqstart": "input", "causal": "BottomRight"},
        "cutlass.stacked_attention_var_len.split",
        "stacked",
    ),
    "stacked_split_input_seqstart_k": (
        {"seqstart": "input", "seqstart_k": True, "causal": "TopLeft"},
        "cutlass.stacked_attention_var_len.split",
        "stacked",
    ),
    "separate_input": (
        {"layout": "separate", "seqstart": "input"},
        "cutlass.attention_var_len",
        "plain",
    ),
    "separate_cumsum_seqstart_k_bottomright": (
        {"layout": "separate", "seqstart_k": True, "causal": "BottomRight"},
        "cutlass.attention_var_len",
        "plain",
    ),
    "separate_static_tokens_bf16": (
        {"layout": "separate", "tokens": 48, "dtype": "bfloat16", "causal": "TopLeft"},
        "cutlass.attention_var_len",
        "plain",
    ),
}


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_is_one_ragged_site(form: str, arch: str) -> None:
    kwargs, pattern, kind = FORMS[form]
    out, rewrites = _normalized(ragged_attention_module(N, H, **kwargs), arch)
    assert "var_len" not in rewrites  # no tokens x tokens mask
    assert "R.nn.attention_var_len" in out.script()
    result = partition(out, OPTS, arch)
    m, spec = _site(result)
    assert (m.pattern, m.kind, m.bias) == (pattern, kind, False)
    assert m.causal == kwargs.get("causal", "none") == spec.causal
    assert m.where.site == "main/attention#0"
    ragged = m.layout.ragged
    given = kwargs.get("seqstart") == "input"
    assert ragged is not None and ragged.sequences == ("starts - 1" if given else "batch")
    assert (ragged.seqstart_q == ragged.seqstart_k) == (not kwargs.get("seqstart_k"))
    if given:
        assert ragged.seqstart_q == "seqstart"
    assert len(m.shapes["seqstart_q"]) == len(m.shapes["seqstart_k"]) == 1
    # the spec: a batch of one, every token of every sequence, seqstart operands of rank 1
    assert spec.ragged is not None and spec.batch == 1
    assert spec.seq_q == kwargs.get("tokens", "?")
    shapes = spec.operand_shapes
    for i in (spec.ragged.seqstart_q, spec.ragged.seqstart_k):
        assert shapes[i] is not None and len(shapes[i]) == 1  # type: ignore[arg-type]
    assert (spec.ragged.seqstart_q == spec.ragged.seqstart_k) == (not kwargs.get("seqstart_k"))
    assert spec.num_q_heads == spec.num_kv_heads == N
    # no reason for a stacked site; a plain one says why it is not stacked
    if kind == "stacked":
        assert result.reasons == []
    else:
        (r,) = result.reasons
        assert r.outcome == "fused_plain" and "separate tensors" in r.reason
    ks, reason = selection.select_kernel(spec, arch, OPTS.kernel)
    assert ks.family == "cutlass_fmha_sm80"
    assert ("a ragged batch (seqstart)" in reason) == (arch == "sm_90")


def test_the_source_reads_seqstart_and_bounds_the_grid_by_the_tokens() -> None:
    out, _ = _normalized(ragged_attention_module(N, H, causal="BottomRight"))
    _, spec = _site(partition(out, OPTS))
    assert spec.ragged is not None
    src = _source(spec, "sm_90")
    sq = spec.ragged.seqstart_q
    assert f'seqstart_of(a{sq}, "seqstart_q", -1)' in src
    assert f'seqstart_of(a{sq}, "seqstart_k", -1)' in src
    assert "seqstart_k counts other sequences" not in src  # one tensor for both
    assert assign(src, "seqstart_q_ptr") == "seqstart_q"
    assert assign(src, "seqstart_k_ptr") == "seqstart_k"
    assert assign(src, "num_batches") == "static_cast<int32_t>(sequences)"
    assert f"const int64_t sequences = a{sq}->shape[0] - 1;" in src
    # the grid: T query rows per sequence; blocks past a sequence's end exit in the kernel
    assert assign(src, "num_queries") == "static_cast<int32_t>(seq_q)"
    assert assign(src, "custom_mask_type") == "2"
    assert 'TVM_FFI_ICHECK_EQ(batch, 1) << "packed tokens must be one batch entry";' in src
    # the seqstart tensor is int32, not the attention's dtype; max_seqlen is not read
    assert f"expect(a{sq}, " not in src
    assert () not in spec.operand_shapes
    assert "kDLInt && t->dtype.bits == 32" in src
    row = 3 * N * H
    assert assign(src, "q_strideM") == str(row) and assign(src, "key_ptr").endswith(f"+ {N * H}")


def test_separate_key_offsets_are_their_own_operand() -> None:
    mod = ragged_attention_module(N, H, layout="separate", seqstart="input", seqstart_k=True)
    out, _ = _normalized(mod)
    _, spec = _site(partition(out, OPTS))
    assert spec.ragged is not None and spec.ragged.seqstart_q != spec.ragged.seqstart_k
    src = _source(spec, "sm_80")
    sk = spec.ragged.seqstart_k
    assert f'seqstart_of(a{sk}, "seqstart_k", -1)' in src
    assert f"TVM_FFI_ICHECK_EQ(a{sk}->shape[0], sequences + 1)" in src
    # the max_seqlen tensors are passed (as TVM's symbolic shapes are) but not read
    assert () not in spec.operand_shapes
    assert src.count("tvm::ffi::AnyView /*shape*/") == spec.operand_shapes.count(None) >= 2


def test_grouped_heads_are_repeated_for_the_kernel() -> None:
    """GQA: the SM80-class kernel reads equal head counts, so K/V are repeated in the graph
    (``ragged_operands``), and the site is fused plain with the repeated heads."""
    out, rewrites = _normalized(ragged_attention_module(N, H, n_kv=2, causal="TopLeft"))
    assert "var_len" not in rewrites
    assert "K and V repeated from 2 to 8 heads" in rewrites["ragged_operands"].message
    result = partition(out, OPTS)
    m, spec = _site(result)
    assert m.pattern == "cutlass.attention_var_len" and spec.num_kv_heads == N
    (r,) = result.reasons
    assert "takes equal head counts only" in r.reason


def test_integer_offsets_are_cast_to_int32() -> None:
    from tests.models import IRBuilder, R, rb, tvm

    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        t = tvm.tirx.Var("tokens", "int64")
        q = R.arg("q", R.Tensor((1, t, N, H), "float16"))
        start = R.arg("seqstart", R.Tensor((5,), "int64"))
        longest = R.arg("max_seqlen", R.Tensor((), "int32"))
        with R.dataflow() as frame:
            o = R.emit(R.nn.attention_var_len(q, q, q, start, longest))
            R.output(o)
        R.func_ret_value(frame.output_vars[0])
    out, rewrites = _normalized(tvm.IRModule({"main": builder.get()}))
    assert "seqstart cast from int64 to int32" in rewrites["ragged_operands"].message
    m, spec = _site(partition(out, OPTS))
    assert m.layout.ragged is not None and m.layout.ragged.sequences == 4
    assert spec.ragged is not None
    assert f'seqstart_of(a{spec.ragged.seqstart_q}, "seqstart_q", 5)' in _source(spec, "sm_90")


@pytest.mark.parametrize(
    ("kwargs", "opts", "why"),
    [
        ({"window": 4, "causal": "BottomRight"}, {}, "sliding-window attention is not supported"),
        ({"dtype": "float64"}, {}, "attention in float64"),
        ({"layout": "separate"}, {"offload_plain": False}, "options.offload_plain is off"),
    ],
    ids=["window", "float64", "offload_plain_off"],
)
def test_what_the_kernel_refuses_becomes_one_masked_attention(
    kwargs: dict[str, Any], opts: dict[str, Any], why: str
) -> None:
    options = CompileOptions(**opts)
    out, rewrites = _normalized(ragged_attention_module(N, H, **kwargs), opts=options)
    rw = rewrites["var_len"]
    assert "block-diagonal mask" in rw.message and why in rw.message, rw.message
    assert rw.where is not None and rw.where.site == "main/attention#0"
    assert "R.nn.attention_var_len" not in out.script()
    result = partition(out, options)
    assert not result.unbuildable
    assert all(m.layout.ragged is None for m in result.match_entries())


def test_unaligned_head_dims_are_refused_with_a_reason() -> None:
    out, rewrites = _normalized(ragged_attention_module(N, 6, layout="separate"))
    assert "multiples of 4 elements" in rewrites["var_len"].message
    result = partition(out, OPTS)
    assert not result.unbuildable and not result.fused  # the masked attention: TVM's


def _compile(
    mod: Any, tmp_path: Path, settings: Settings | None = None, arch: str = "sm_90"
) -> Any:
    settings = settings or Settings(
        data_dir=tmp_path / "d", kernel_cache_dir=tmp_path / "k", nvcc_timeout_s=0
    )
    return compile_module(
        to_json(mod),
        target=Target.model_validate({"arch": arch}),
        options=CompileOptions(validate_on_gpu="never"),
        out_dir=tmp_path / "out",
        settings=settings,
    )


def test_separate_key_offsets_with_a_window_fail_the_job_before_codegen(tmp_path: Path) -> None:
    """A window (no kernel takes it) with key offsets of their own (the masked rewrite reads
    one seqstart): nothing can build it, and the job says so before codegen."""
    mod = ragged_attention_module(
        N, H, layout="separate", seqstart_k=True, window=4, causal="BottomRight"
    )
    with pytest.raises(CompileError) as err:
        _compile(mod, tmp_path)
    msg = err.value.message
    assert "TVM cannot build it" in msg and "the ragged kernel refused it" in msg
    assert "main/attention#0" in msg


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_ragged_source_compiles(arch: str) -> None:
    """The packed stacked form, causal BottomRight, through the service's cached nvcc."""
    from worker.nvcc import compile_object

    out, _ = _normalized(ragged_attention_module(4, 16, causal="BottomRight"), arch)
    _, spec = _site(partition(out, OPTS, arch))
    ks, _ = selection.select_kernel(spec, arch, OPTS.kernel)
    compiled = compile_object(ks)
    assert compiled.object_path.stat().st_size > 10_000


@pytest.mark.nvcc
@pytest.mark.slow
def test_a_library_with_a_ragged_site_loads(kernel_settings: Settings, tmp_path: Path) -> None:
    """Separate q/k/v and seqstart_k given: the whole pipeline on sm_90, the library loads in
    TVM and exports the kernel's symbol; the report names the ragged layout."""
    from tests.models import tvm

    mod = ragged_attention_module(
        N, H, layout="separate", seqstart="input", seqstart_k=True, causal="TopLeft"
    )
    res = _compile(mod, tmp_path, kernel_settings)
    (m,) = res.report.matches
    assert m.kernel is not None and m.kernel.family == "cutlass_fmha_sm80"
    assert m.layout.ragged is not None
    assert (m.layout.ragged.seqstart_q, m.layout.ragged.seqstart_k) == ("seqstart", "seqstart_k")
    assert "each packed sequence attending to its own keys" in m.verdict
    assert res.report.normalizations == []
    lib = tvm.runtime.load_module(str(res.library))
    assert lib.get_function(m.kernel.symbol, query_imports=True) is not None


@pytest.mark.parametrize(
    "name",
    [
        "ragged_fp16_split_causal_bottomright",
        "ragged_bf16_split_seqstart_input_causal_topleft",
        "ragged_fp16_separate_gqa_q16_kv4_causal",
    ],
)
def test_the_gpu_cases_reference_agrees_with_the_masked_form(name: str) -> None:
    """``benchmarks/gpu_cases.py``'s ragged inputs and per-sequence reference, checked on the
    CPU against the module's masked form (the validation reference's, built with LLVM)."""
    torch = pytest.importorskip("torch")
    from benchmarks.gpu_cases import CASES, TOLERANCE, _inputs, module_for, reference
    from tests.models import tvm
    from worker.build import expand_kv_heads
    from worker.validate import reference_options

    (case,) = [c for c in CASES if c.name == name]
    out, rewrites = _normalized(module_for(case), opts=reference_options(OPTS))
    assert "var_len" in rewrites
    vm = tvm.relax.VirtualMachine(tvm.compile(expand_kv_heads(out), target="llvm"), tvm.cpu())
    inputs = _inputs(case, torch, "cpu")
    got = torch.from_dlpack(vm["main"](*[tvm.runtime.from_dlpack(t) for t in inputs])).float()
    (want,) = reference(case, inputs)
    assert got.shape == want.shape == (1, case.s, case.n, case.h)
    rel = float((got - want.float()).norm() / want.float().norm())
    assert rel <= TOLERANCE[case.module.get("dtype", "float16")], rel
