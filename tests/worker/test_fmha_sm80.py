"""The SM80-class fMHA: what its generated CUTLASS source says, and how sites get a symbol."""

from __future__ import annotations

import dataclasses
import re

from service.spec import CompileOptions
from tests.models import IRBuilder, R, rb, stacked_attention_module, tvm
from worker import fmha_sm80, selection
from worker.attention import AttentionSpec
from worker.partition import partition

OPTS = CompileOptions()


def spec_of(mod: object) -> AttentionSpec:
    (fs,) = partition(mod, OPTS).fused
    assert fs.analysis.spec is not None
    return fs.analysis.spec


def source_of(spec: AttentionSpec, arch: str = "sm_90") -> str:
    ks, _ = selection.select_kernel(spec, arch, "sm80")
    return ks.source


def assign(src: str, field: str) -> str:
    m = re.search(rf"p\.{re.escape(field)} = ([^;]+);", src)
    assert m, f"{field} not set"
    return m.group(1).strip()


def test_stacked_split_offsets_and_strides() -> None:
    b, s, n, h, hv = 4, 8, 32, 64, 32
    src = source_of(spec_of(stacked_attention_module(b, s, n, h, hv)))
    row = 2 * n * h + n * hv
    assert assign(src, "query_ptr") == "data_of(a0) + 0"
    assert assign(src, "key_ptr") == f"data_of(a0) + {n * h}"
    assert assign(src, "value_ptr") == f"data_of(a0) + {2 * n * h}"
    for t in "qkv":
        assert assign(src, f"{t}_strideM") == str(row)
    assert assign(src, "q_strideH") == str(h)
    assert assign(src, "v_strideH") == str(hv)
    assert assign(src, "q_strideB") == f"int64_t({row}) * seq_q"
    assert assign(src, "o_strideM") == str(n * hv)
    assert assign(src, "num_heads") == str(n)
    assert assign(src, "head_dim_value") == str(hv)
    assert assign(src, "scale") == f"{1 / h**0.5!r}f"
    assert 'expect(a0, "input 0", 3, {4, 8, 5120});' in src
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(stackfuse_a" in src
    assert "cudaGetLastError()" in src


def test_strided_slice_other_order_and_bias_broadcast() -> None:
    mod = stacked_attention_module(
        2, 16, 4, 64, op="strided_slice", slice_order="kvq", bias_shape=(1, 4, 16, 16)
    )
    spec = spec_of(mod)
    src = source_of(spec)
    assert assign(src, "key_ptr") == "data_of(a0) + 0"
    assert assign(src, "value_ptr") == "data_of(a0) + 256"
    assert assign(src, "query_ptr") == "data_of(a0) + 512"
    assert spec.bias is not None and spec.bias.operand == 1
    assert "Element* bias = data_of(a1);" in src
    assert assign(src, "attn_bias_ptr") == "bias"
    assert "/*supports_bias=*/true" in src


def test_bias_rows_reach_the_kernel_in_whole_vectors() -> None:
    """The kernel loads bias rows in 16-byte vectors even in its unaligned build, so a row of
    S_kv = 300 halves is copied into rows padded to 304 (a window written as a mask at S 300
    ran into a misaligned address on the H200). The bias no longer makes the kernel unaligned;
    broadcast dims keep stride 0 and the others step by the padded row."""
    src = source_of(spec_of(stacked_attention_module(2, 300, 4, 64, bias_shape=(1, 4, 300, 300))))
    assert "/*is_aligned=*/true" in src
    assert "constexpr int64_t kBiasVector = 16 / sizeof(Element);" in src
    assert "if (seq_kv % kBiasVector != 0 || reinterpret_cast<uintptr_t>(bias) % 16 != 0)" in src
    assert "cudaMemcpy2DAsync(bias_copy, bias_row * sizeof(Element), bias," in src
    assert assign(src, "bias_strideM") == "a1->shape[2] == 1 ? 0 : bias_row"
    assert assign(src, "bias_strideH") == "a1->shape[1] == 1 ? 0 : a1->shape[2] * bias_row"
    # both workspaces come from one owner that gives them back in reverse (the pool's order)
    # when the call returns or throws: a failed check after the copy must not leak it
    assert "workspaces.take(uint64_t(rows) * bias_row * sizeof(Element)" in src
    destructor = "~Workspaces() {\n    while (count > 0) TVMBackendFreeWorkspace(kDLCUDA, device, "
    assert destructor + "taken[--count]);" in src
    assert src.count("TVMBackendFreeWorkspace(") == 2  # the declaration and the destructor
    assert src.index("Workspaces workspaces{device};") < src.index("check_supported(p)")


def test_causal_mask_type_and_dtype() -> None:
    src = source_of(
        spec_of(stacked_attention_module(2, 16, 4, 64, causal="TopLeft", dtype="bfloat16"))
    )
    assert assign(src, "custom_mask_type") == "1"
    assert "using Element = cutlass::bfloat16_t;" in src
    assert "t->dtype.code == kDLBfloat && t->dtype.bits == 16" in src
    src = source_of(spec_of(stacked_attention_module(2, 16, 4, 64, causal="BottomRight")))
    assert assign(src, "custom_mask_type") == "2"


def test_symbolic_batch_is_read_at_run_time() -> None:
    spec = spec_of(stacked_attention_module("batch", 16, 4, 64))
    src = source_of(spec)
    assert 'expect(a0, "input 0", 3, {-1, 16, 768});' in src
    assert "const int64_t batch = a0->shape[0];" in src
    # TVM passes the symbolic reshape targets as shape arguments: accepted and ignored
    assert "tvm::ffi::AnyView /*shape*/" in src


def test_tile_config_and_workspace_for_large_value_head_dim() -> None:
    small = spec_of(stacked_attention_module(2, 16, 4, 64))
    assert fmha_sm80.sm80_config(small, True)["queries_per_block"] == 64
    big = spec_of(stacked_attention_module(2, 16, 4, 128, 256))
    cfg = fmha_sm80.sm80_config(big, True)
    assert (cfg["queries_per_block"], cfg["keys_per_block"], cfg["max_k"]) == (32, 128, 256)
    assert cfg["single_value_iteration"] is False
    # fp32 accumulator per output element (upstream sized it at 2 bytes per element)
    assert fmha_sm80.workspace_bytes(big, cfg) == 2 * 16 * 4 * 256 * 4
    assert fmha_sm80.workspace_bytes(small, fmha_sm80.sm80_config(small, True)) == 0
    ks, _ = selection.select_kernel(big, "sm_90", "sm80")
    assert 'workspaces.take(bytes, kDLFloat, 32, "the attention accumulator")' in ks.source
    assert "cudaMalloc" not in ks.source


def test_unaligned_head_dim_picks_the_unaligned_kernel() -> None:
    assert "/*is_aligned=*/false" in source_of(spec_of(stacked_attention_module(2, 8, 4, 36)))
    assert "/*is_aligned=*/true" in source_of(spec_of(stacked_attention_module(2, 8, 4, 64)))


def test_arch_flags() -> None:
    spec = spec_of(stacked_attention_module(2, 8, 4, 64))
    ks, _ = selection.select_kernel(spec, "sm_80", "sm80")
    assert ks.flags == ("-gencode", "arch=compute_80,code=[sm_80,compute_80]")
    assert "cutlass::arch::Sm80" in ks.source


def test_identical_sites_share_a_symbol_different_ones_do_not() -> None:
    a = spec_of(stacked_attention_module(2, 8, 4, 64))
    b = spec_of(stacked_attention_module(2, 8, 4, 64))
    c = spec_of(stacked_attention_module(2, 8, 4, 64, causal="TopLeft"))
    sym = selection.kernel_symbol(selection.FAMILY_SM80, a, "sm_90")
    assert sym == selection.kernel_symbol(selection.FAMILY_SM80, b, "sm_90")
    assert sym != selection.kernel_symbol(selection.FAMILY_SM80, c, "sm_90")
    assert re.fullmatch(r"stackfuse_a[0-9a-f]{24}", sym)


HOSTILE = 'x"; } #include "/etc/passwd" /* \n system("touch /tmp/pwned"); //'


def hostile_module() -> object:
    """Stacked attention whose every client-chosen name is hostile C++."""
    with IRBuilder() as builder, rb.function():
        R.func_name("main")
        qkv = R.arg(HOSTILE, R.Tensor((2, 8, 768), "float16"))
        with R.dataflow() as frame:
            parts = R.emit(R.split(qkv, [256, 512], axis=2))
            q = R.emit(R.reshape(parts[0], [2, 8, 4, 64]))
            k = R.emit(R.reshape(parts[1], [2, 8, 4, 64]))
            v = R.emit(R.reshape(parts[2], [2, 8, 4, 64]))
            out = R.emit(R.nn.attention(q, k, v))
            R.output(out)
        R.func_ret_value(frame.output_vars[0])
    func = builder.get().with_attr("global_symbol", HOSTILE)
    return tvm.IRModule({"main": func})


def test_hostile_names_never_reach_generated_source() -> None:
    res = partition(hostile_module(), OPTS)
    (m,) = res.match_entries()
    assert HOSTILE[:20] in "".join(m.bindings) or m.where.binding  # names stay in the report
    src = source_of(res.fused[0].analysis.spec)  # type: ignore[arg-type]
    for token in ("passwd", "system", "pwned", HOSTILE[:5]):
        assert token not in src
    # everything between quotes in the source is our own fixed text
    literals = set(re.findall(r'"([^"\n]*)"', src))
    assert all(re.fullmatch(r"[\w ./:,()\-']*", lit) for lit in literals), literals


def test_spec_holds_no_strings_but_dynamic_markers() -> None:
    spec = spec_of(stacked_attention_module("weird name\n", 16, 4, 64))
    strings = [v for v in dataclasses.astuple(spec) if isinstance(v, str)]
    assert set(strings) <= {"float16", "none", "?", "blocked"}
