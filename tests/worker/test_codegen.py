"""Codegen: what the generated CUTLASS source says, and the kernel-object cache."""

from __future__ import annotations

import dataclasses
import re
import uuid
from pathlib import Path

import pytest

from service.settings import Settings
from service.spec import CompileOptions
from tests.models import IRBuilder, R, rb, stacked_attention_module, tvm
from worker import codegen
from worker.attention import AttentionSpec
from worker.partition import partition

OPTS = CompileOptions()


def spec_of(mod: object) -> AttentionSpec:
    (fs,) = partition(mod, OPTS).fused
    assert fs.analysis.spec is not None
    return fs.analysis.spec


def source_of(spec: AttentionSpec, arch: str = "sm_90") -> str:
    ks, _ = codegen.select_kernel(spec, arch, "sm80")
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
    assert "p.attn_bias_ptr = data_of(a1);" in src
    assert "/*supports_bias=*/true" in src


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
    assert codegen.sm80_config(small, True)["queries_per_block"] == 64
    big = spec_of(stacked_attention_module(2, 16, 4, 128, 256))
    cfg = codegen.sm80_config(big, True)
    assert (cfg["queries_per_block"], cfg["keys_per_block"], cfg["max_k"]) == (32, 128, 256)
    assert cfg["single_value_iteration"] is False
    # fp32 accumulator per output element (upstream sized it at 2 bytes per element)
    assert codegen.workspace_bytes(big, cfg) == 2 * 16 * 4 * 256 * 4
    assert codegen.workspace_bytes(small, codegen.sm80_config(small, True)) == 0
    ks, _ = codegen.select_kernel(big, "sm_90", "sm80")
    assert "TVMBackendAllocWorkspace(kDLCUDA, device, bytes" in ks.source
    assert "cudaMalloc" not in ks.source


def test_unaligned_head_dim_picks_the_unaligned_kernel() -> None:
    assert "/*is_aligned=*/false" in source_of(spec_of(stacked_attention_module(2, 8, 4, 36)))
    assert "/*is_aligned=*/true" in source_of(spec_of(stacked_attention_module(2, 8, 4, 64)))


def test_arch_flags() -> None:
    spec = spec_of(stacked_attention_module(2, 8, 4, 64))
    ks, _ = codegen.select_kernel(spec, "sm_80", "sm80")
    assert ks.flags == ("-gencode", "arch=compute_80,code=[sm_80,compute_80]")
    assert "cutlass::arch::Sm80" in ks.source


def test_identical_sites_share_a_symbol_different_ones_do_not() -> None:
    a = spec_of(stacked_attention_module(2, 8, 4, 64))
    b = spec_of(stacked_attention_module(2, 8, 4, 64))
    c = spec_of(stacked_attention_module(2, 8, 4, 64, causal="TopLeft"))
    sym = codegen.kernel_symbol(codegen.FAMILY_SM80, a, "sm_90")
    assert sym == codegen.kernel_symbol(codegen.FAMILY_SM80, b, "sm_90")
    assert sym != codegen.kernel_symbol(codegen.FAMILY_SM80, c, "sm_90")
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


# --------------------------------------------------------------------------------------------
# nvcc + cache (real nvcc; shares the session kernel cache)
# --------------------------------------------------------------------------------------------
@pytest.mark.nvcc
def test_cache_key_follows_the_headers_we_ship(
    kernel_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an edit to worker/kernels/*.cuh must not be answered with an object built before it
    root = tmp_path / "kernels"
    root.mkdir()
    (root / "a.cuh").write_text("int x;")
    before = codegen.headers_digest.__wrapped__(root)
    (root / "a.cuh").write_text("int y;")
    assert codegen.headers_digest.__wrapped__(root) != before
    assert codegen.headers_digest() == codegen.headers_digest.__wrapped__(codegen._OUR_HEADERS)

    from worker.toolchain import find_toolchain

    chain = find_toolchain(kernel_settings)
    spec = spec_of(stacked_attention_module(4, 8, 32, 64, 32))
    ks, _ = codegen.select_kernel(spec, "sm_90", "auto")
    keys = set()
    for digest in ("one", "two"):
        monkeypatch.setattr(codegen, "headers_digest", lambda d=digest: d)
        keys.add(codegen.cache_key(ks, chain))
    assert len(keys) == 2


def test_compile_then_cache_hit_runs_no_nvcc(kernel_settings: Settings, tmp_path: Path) -> None:
    spec = spec_of(stacked_attention_module(4, 8, 32, 64, 32))
    ks, _ = codegen.select_kernel(spec, "sm_90", "auto")
    first = codegen.compile_object(ks, settings=kernel_settings)
    assert first.object_path.exists() and first.object_path.stat().st_size > 10_000
    data = first.object_path.read_bytes()
    assert f"__tvm_ffi_{ks.symbol}".encode() in data
    # a toolchain whose nvcc does not exist: a cache hit must not need it
    from worker.toolchain import find_toolchain

    broken = dataclasses.replace(find_toolchain(kernel_settings), nvcc=tmp_path / "no-such-nvcc")
    again = codegen.compile_object(ks, settings=kernel_settings, chain=broken)
    assert again.cache_hit and again.object_path == first.object_path
    # what the unit needs (a Hopper site's configuration; nothing here: head_dim_v differs, so
    # the SM80-class kernel) comes back with it, from the cache as well
    assert len(first.needs) == len(ks.needs) and all(p.exists() for p in first.needs)
    assert again.objects == (first.object_path, *first.needs)


@pytest.mark.nvcc
def test_needs_compile_apart_are_cached_and_listed_once(kernel_settings: Settings) -> None:
    """What a unit needs is its own cached object: listed once however often it is needed,
    and a hit only when every part is one."""
    token = uuid.uuid4().hex  # a cold cache for this run's sources
    lib = codegen.KernelSource(
        symbol="stackfuse_lib",
        family=codegen.FAMILY_SM80,
        source=f'// {token}\nextern "C" int stackfuse_lib(int a) {{ return a + 1; }}\n',
    )

    def user(name: str, needs: tuple[codegen.KernelSource, ...]) -> codegen.KernelSource:
        return codegen.KernelSource(
            symbol=name,
            family=codegen.FAMILY_SM80,
            source=f'// {token}\nextern "C" int stackfuse_lib(int);\n'
            f'extern "C" int {name}(int v) {{ return stackfuse_lib(v); }}\n',
            needs=needs,
        )

    a = codegen.compile_object(user("use_a", (lib,)), settings=kernel_settings)
    assert not a.cache_hit and len(a.needs) == 1
    b = codegen.compile_object(user("use_b", (lib, lib)), settings=kernel_settings)
    assert b.needs == a.needs  # the same object, once
    assert not b.cache_hit  # its own unit was compiled, though its need was cached
    again = codegen.compile_object(user("use_a", (lib,)), settings=kernel_settings)
    assert again.cache_hit and again.objects == a.objects


@pytest.mark.nvcc
def test_nvcc_failure_is_a_compile_error_with_a_trimmed_excerpt(kernel_settings: Settings) -> None:
    from service.errors import CompileError

    bad = codegen.KernelSource(
        symbol="stackfuse_broken",
        family=codegen.FAMILY_SM80,
        source="#include <tvm/ffi/function.h>\nthis is not c++;\n",
        flags=codegen.gencode("sm_90"),
    )
    with pytest.raises(CompileError) as err:
        codegen.compile_object(bad, settings=kernel_settings)
    excerpt = err.value.detail["excerpt"]
    assert "error" in excerpt and ".cu:" in excerpt
    assert "/usr/" not in excerpt and "site-packages" not in excerpt
