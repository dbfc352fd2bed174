"""CUTLASS source generation, nvcc, and the kernel-object cache.

Generated sources are built from an :class:`~worker.attention.AttentionSpec` only: numbers,
enum tokens we choose, and a symbol made of hex digits. No string from the client's module can
reach them. Objects are cached by the sha256 of (source, flags, nvcc version, CUTLASS version):
a second compile of the same attention config runs no nvcc. Writes are atomic (temp + rename)
and a per-key file lock stops concurrent workers from compiling the same object twice.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from service.errors import CompileError
from service.settings import Settings, get_settings
from service.spec import CODEGEN_REVISION
from worker import sandbox
from worker.attention import AttentionSpec
from worker.toolchain import Toolchain, find_toolchain

FAMILY_SM80 = "cutlass_fmha_sm80"
FAMILY_HOPPER = "cutlass_fmha_hopper"

_CTYPE = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t", "float32": "float"}
_DL = {"float16": ("kDLFloat", 16), "bfloat16": ("kDLBfloat", 16), "float32": ("kDLFloat", 32)}
_MASK = {"none": 0, "TopLeft": 1, "BottomRight": 2}

COMMON_FLAGS: tuple[str, ...] = (
    "-c",
    "-O3",
    "-std=c++17",
    "-Xcompiler=-fPIC",
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1",
    "-w",
    # Only the TVM-FFI entry points (explicitly default visibility) leave the library. Without
    # this, template statics and kernel stubs are unified across every library in a process
    # (STB_GNU_UNIQUE / interposition): a second model with the same Hopper kernel then skipped
    # its cudaFuncSetAttribute and failed to launch (seen on the H200).
    "-Xcompiler=-fvisibility=hidden",
    "-Xcompiler=-fvisibility-inlines-hidden",
)


@dataclass(frozen=True)
class KernelSource:
    """One generated translation unit exporting ``symbol`` through the TVM-FFI ABI:

    ``symbol(operand_0, ..., operand_{n-1}, out)``, every argument a ``DLTensor*``; the stream is
    ``TVMFFIEnvGetStream(kDLCUDA, device_id)``; scratch memory comes from
    ``TVMBackendAllocWorkspace``; every launch is checked with ``cudaGetLastError``.
    """

    symbol: str
    source: str
    family: str
    #: extra nvcc flags beyond the common ones (arch flags included: -gencode ...)
    flags: tuple[str, ...] = ()
    config: dict[str, int | bool | str] = field(default_factory=dict)
    workspace_bytes: int | str = 0
    #: units this one calls into, compiled (and cached) apart and linked with it: the Hopper
    #: glue of one site needs its configuration's CUTLASS kernel, which other sites share
    needs: tuple[KernelSource, ...] = ()


@dataclass(frozen=True)
class CompiledKernel:
    symbol: str
    object_path: Path
    cache_key: str
    #: True when this object and every one it needs came from the cache
    cache_hit: bool
    #: wall seconds for this object and the ones it needs
    seconds: float
    #: the objects of ``KernelSource.needs`` (to link along), in order, without repeats
    needs: tuple[Path, ...] = ()

    @property
    def objects(self) -> tuple[Path, ...]:
        """Every object the link needs for this kernel: its own, then what it calls."""
        return (self.object_path, *self.needs)


def arch_number(arch: str) -> int:
    return int(arch.removeprefix("sm_").rstrip("a"))


def gencode(arch: str) -> tuple[str, ...]:
    n = arch_number(arch)
    return ("-gencode", f"arch=compute_{n},code=[sm_{n},compute_{n}]")


def kernel_symbol(family: str, spec: AttentionSpec, arch: str, variant: str = "") -> str:
    digest = hashlib.sha256(f"{family}|{arch}|{variant}|{spec.fingerprint()}".encode()).hexdigest()
    return f"stackfuse_{'h' if family == FAMILY_HOPPER else 'a'}{digest[:24]}"


# --------------------------------------------------------------------------------------------
# SM80-class fMHA (examples/41_fused_multi_head_attention/kernel_forward.h)
# --------------------------------------------------------------------------------------------
def sm80_config(spec: AttentionSpec, aligned: bool) -> dict[str, int | bool | str]:
    """Tile shape as upstream TVM chooses it: wide key tiles once head_dim_v exceeds 64."""
    max_k = max(spec.head_dim, spec.head_dim_v)
    qpb, kpb = (32, 128) if spec.head_dim_v > 64 else (64, 64)
    return {
        "aligned": aligned,
        "queries_per_block": qpb,
        "keys_per_block": kpb,
        "max_k": max_k,
        "single_value_iteration": max_k <= kpb,
        # CUTLASS produces NaN for a negative scale unless the bias path is compiled in
        "supports_bias": spec.bias is not None or spec.scale < 0,
    }


def _is_aligned(spec: AttentionSpec) -> bool:
    full = 128 // spec.elem_bits
    vals = [spec.head_dim, spec.head_dim_v]
    for acc in (spec.q, spec.k, spec.v):
        vals += [acc.offset, acc.row_stride, acc.head_stride]
    if spec.bias is not None and isinstance(spec.bias.shape[3], int):
        vals.append(spec.bias.shape[3])
    return all(v % full == 0 for v in vals)


def _dims_literal(shape: tuple[int | str, ...]) -> str:
    """C++ initializer of static extents; -1 for a dim read at run time."""
    return "{" + ", ".join(str(d) if isinstance(d, int) else "-1" for d in shape) + "}"


def workspace_bytes(spec: AttentionSpec, cfg: dict[str, int | bool | str]) -> int | str:
    """The fp32 output accumulator the kernel needs when head_dim_v spans several key tiles.

    Upstream TVM sized this as out_elems x 2 bytes, too small for the float accumulator, which
    made the kernel cudaMalloc on every call; here it is out_elems x 4.
    """
    if cfg["single_value_iteration"] or spec.dtype == "float32":
        return 0
    per_row = spec.num_q_heads * spec.head_dim_v * 4
    if isinstance(spec.batch, int) and isinstance(spec.seq_q, int):
        return spec.batch * spec.seq_q * per_row
    return f"batch*seq_q*{per_row}"


def render_sm80(spec: AttentionSpec, symbol: str, arch: str) -> KernelSource:
    """C++ for one attention site on the SM80-class CUTLASS fMHA, reading Q/K/V by offsets."""
    aligned = _is_aligned(spec)
    cfg = sm80_config(spec, aligned)
    code, bits = _DL[spec.dtype]
    args = ", ".join(
        f"DLTensor* a{i}" if shape is not None else f"tvm::ffi::AnyView /*shape*/ a{i}"
        for i, shape in enumerate(spec.operand_shapes)
    )
    checks = "\n".join(
        f'  expect(a{i}, "input {i}", {len(shape)}, {_dims_literal(shape)});'
        for i, shape in enumerate(spec.operand_shapes)
        if shape is not None
    )
    q, k, v = spec.q, spec.k, spec.v
    bias_lines = ""
    if spec.bias is not None:
        b = spec.bias.operand
        bias_lines = f"""
  // bias [B|1, N|1, S|1, S_kv]; a broadcast dim gets stride 0
  p.attn_bias_ptr = data_of(a{b});
  TVM_FFI_ICHECK_EQ(a{b}->shape[3], seq_kv) << "bias last dim must be seq_kv";
  p.bias_strideM = a{b}->shape[2] == 1 ? 0 : a{b}->shape[3];
  p.bias_strideH = a{b}->shape[1] == 1 ? 0 : a{b}->shape[2] * a{b}->shape[3];
  p.bias_strideB = a{b}->shape[0] == 1 ? 0 : a{b}->shape[1] * a{b}->shape[2] * a{b}->shape[3];"""
    ws = workspace_bytes(spec, cfg)
    source = f"""// Generated by Stackfuse (codegen rev {CODEGEN_REVISION}): {FAMILY_SM80}, {arch}.
// Built from numbers only; no text from the input module appears here.
#include <cstdint>
#include <initializer_list>
#include <cuda_runtime.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include "kernel_forward.h"

extern "C" void* TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes,
                                          int dtype_code_hint, int dtype_bits_hint);
extern "C" int TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr);

namespace {{

using Element = {_CTYPE[spec.dtype]};
using Attention = AttentionKernel<Element, cutlass::arch::Sm80,
                                  /*is_aligned=*/{str(aligned).lower()},
                                  /*queries_per_block=*/{cfg["queries_per_block"]},
                                  /*keys_per_block=*/{cfg["keys_per_block"]},
                                  /*kMaxK=*/{cfg["max_k"]},
                                  /*supports_dropout=*/false,
                                  /*supports_bias=*/{str(cfg["supports_bias"]).lower()}>;

Element* data_of(DLTensor* t) {{
  return reinterpret_cast<Element*>(static_cast<char*>(t->data) + t->byte_offset);
}}

// Rank, dtype, static extents (-1 = read at run time) and a compact layout.
void expect(DLTensor* t, const char* what, int ndim, std::initializer_list<int64_t> dims) {{
  TVM_FFI_ICHECK(t->device.device_type == kDLCUDA) << what << " must be on a CUDA device";
  TVM_FFI_ICHECK_EQ(t->ndim, ndim) << what << " has the wrong rank";
  TVM_FFI_ICHECK(t->dtype.code == {code} && t->dtype.bits == {bits} && t->dtype.lanes == 1)
      << what << " has the wrong dtype";
  int i = 0;
  for (int64_t d : dims) {{
    if (d >= 0) TVM_FFI_ICHECK_EQ(t->shape[i], d) << what << " dim " << i;
    ++i;
  }}
  if (t->strides != nullptr) {{
    int64_t s = 1;
    for (int j = t->ndim - 1; j >= 0; --j) {{
      TVM_FFI_ICHECK(t->shape[j] == 1 || t->strides[j] == s) << what << " must be compact";
      s *= t->shape[j];
    }}
  }}
}}

void run({args}, DLTensor* out) {{
{checks}
  const int64_t batch = a{q.operand}->shape[0];
  const int64_t seq_q = a{q.operand}->shape[1];
  const int64_t seq_kv = a{k.operand}->shape[1];
  TVM_FFI_ICHECK_EQ(a{k.operand}->shape[0], batch) << "k batch differs from q batch";
  TVM_FFI_ICHECK_EQ(a{v.operand}->shape[0], batch) << "v batch differs from q batch";
  TVM_FFI_ICHECK_EQ(a{v.operand}->shape[1], seq_kv) << "v sequence differs from k sequence";
  expect(out, "output", 4, {{batch, seq_q, {spec.num_q_heads}, {spec.head_dim_v}}});

  typename Attention::Params p;
  p.query_ptr = data_of(a{q.operand}) + {q.offset};
  p.key_ptr = data_of(a{k.operand}) + {k.offset};
  p.value_ptr = data_of(a{v.operand}) + {v.offset};
  p.output_ptr = data_of(out);
  p.output_accum_ptr = nullptr;
  p.logsumexp_ptr = nullptr;
  p.scale = {spec.scale!r}f;
  p.num_heads = {spec.num_q_heads};
  p.num_batches = static_cast<int32_t>(batch);
  p.head_dim = {spec.head_dim};
  p.head_dim_value = {spec.head_dim_v};
  p.num_queries = static_cast<int32_t>(seq_q);
  p.num_keys = static_cast<int32_t>(seq_kv);
  p.custom_mask_type = {_MASK[spec.causal]};
  p.q_strideM = {q.row_stride};
  p.k_strideM = {k.row_stride};
  p.v_strideM = {v.row_stride};
  p.o_strideM = {spec.num_q_heads * spec.head_dim_v};
  p.q_strideH = {q.head_stride};
  p.k_strideH = {k.head_stride};
  p.v_strideH = {v.head_stride};
  p.q_strideB = int64_t({q.row_stride}) * seq_q;
  p.k_strideB = int64_t({k.row_stride}) * seq_kv;
  p.v_strideB = int64_t({v.row_stride}) * seq_kv;{bias_lines}

  const int device = out->device.device_id;
  void* workspace = nullptr;
  if (Attention::kNeedsOutputAccumulatorBuffer) {{
    const uint64_t bytes = uint64_t(batch) * seq_q * {spec.num_q_heads * spec.head_dim_v} *
                           sizeof(typename Attention::output_accum_t);
    workspace = TVMBackendAllocWorkspace(kDLCUDA, device, bytes, kDLFloat, 32);
    TVM_FFI_ICHECK(workspace != nullptr) << "could not allocate the attention accumulator";
    p.output_accum_ptr = static_cast<typename Attention::output_accum_t*>(workspace);
  }}
  TVM_FFI_ICHECK(Attention::check_supported(p))
      << "CUTLASS attention rejected the operands (alignment of pointers or strides)";

  constexpr auto kernel_fn = attention_kernel_batched_impl<Attention>;
  constexpr int smem_bytes = sizeof(typename Attention::SharedStorage);
  if (smem_bytes > 0xc000) {{
    static bool raised[64] = {{}};
    if (device < 64 && !raised[device]) {{
      cudaError_t e = cudaFuncSetAttribute(
          kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
      TVM_FFI_ICHECK(e == cudaSuccess) << "cudaFuncSetAttribute: " << cudaGetErrorString(e);
      raised[device] = true;
    }}
  }}
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  kernel_fn<<<p.getBlocksGrid(), p.getThreadsGrid(), smem_bytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (workspace != nullptr) TVMBackendFreeWorkspace(kDLCUDA, device, workspace);
  if (err != cudaSuccess) {{
    TVM_FFI_THROW(RuntimeError) << "CUTLASS attention launch failed: " << cudaGetErrorString(err);
  }}
}}

}}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC({symbol}, run);
"""
    return KernelSource(
        symbol=symbol,
        source=source,
        family=FAMILY_SM80,
        flags=gencode(arch),
        config=cfg,
        workspace_bytes=ws,
    )


# --------------------------------------------------------------------------------------------
# nvcc + cache
# --------------------------------------------------------------------------------------------
def run_nvcc(
    argv: list[str], src: Path, out: Path, *, settings: Settings, chain: Toolchain, what: str
) -> sandbox.Completed:
    """nvcc under the sandbox's limits; a failure becomes a CompileError whose excerpt holds
    only diagnostics about ``src`` (our own generated file)."""
    result = sandbox.run(
        argv,
        limits=sandbox.Limits(
            timeout_s=settings.nvcc_timeout_s,
            cpu_s=settings.nvcc_timeout_s * 2,
            memory_bytes=settings.nvcc_memory_bytes,
            file_bytes=settings.max_output_file_bytes,
        ),
        cwd=src.parent,
        env=sandbox.clean_env({"PATH": f"{chain.cuda_home / 'bin'}:{os.environ.get('PATH', '')}"}),
        what="nvcc",
    )
    if result.returncode != 0 or not out.exists():
        raise CompileError(
            f"nvcc could not compile {what} (exit {result.returncode})",
            excerpt=sandbox.excerpt(result.output, [src], limit=settings.error_excerpt_chars),
        )
    return result


def include_flags(chain: Toolchain) -> list[str]:
    dirs = [
        *chain.cutlass_includes,
        chain.fmha_sm80_dir,
        chain.curand_include,
        chain.tvm_ffi_include,
        chain.dlpack_include,
        chain.cuda_home / "include",
    ]
    out: list[str] = []
    for d in dirs:
        flag = f"-I{d}"
        if flag not in out:
            out.append(flag)
    return out


_OUR_HEADERS = Path(__file__).resolve().parent / "kernels"


@functools.cache
def headers_digest(root: Path = _OUR_HEADERS) -> str:
    """sha256 over the headers we ship (``worker/kernels``): the generated units include them,
    so an object built before an edit to them must not be served after it."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(ks: KernelSource, chain: Toolchain) -> str:
    from service.spec import toolchain_versions

    doc = json.dumps(
        {
            "source": ks.source,
            "flags": [*COMMON_FLAGS, *ks.flags],
            "headers": headers_digest(),
            "nvcc": chain.nvcc_version,
            "cutlass": toolchain_versions().get("nvidia-cutlass", "?"),
        },
        sort_keys=True,
    )
    return hashlib.sha256(doc.encode()).hexdigest()


def compile_object(
    ks: KernelSource,
    *,
    settings: Settings | None = None,
    chain: Toolchain | None = None,
) -> CompiledKernel:
    """The object file for ``ks`` and those of what it needs: each from the cache, or compiled
    by nvcc and then cached."""
    settings = settings or get_settings()
    chain = chain or find_toolchain(settings)
    started = time.monotonic()
    needs = [compile_object(dep, settings=settings, chain=chain) for dep in ks.needs]
    obj, key, hit = _compile_one(ks, settings, chain)
    paths: list[Path] = []
    for dep in needs:
        paths.extend(p for p in dep.objects if p not in paths)
    return CompiledKernel(
        ks.symbol,
        obj,
        key,
        hit and all(d.cache_hit for d in needs),
        time.monotonic() - started,
        tuple(paths),
    )


def _cached_path(ks: KernelSource, settings: Settings, chain: Toolchain) -> tuple[str, Path]:
    """(cache key, where the object of ``ks`` alone lives in the kernel cache)."""
    key = cache_key(ks, chain)
    return key, settings.resolved_kernel_cache_dir() / "objects" / key[:2] / f"{key}.o"


def is_cached(ks: KernelSource, settings: Settings, chain: Toolchain) -> bool:
    """Whether ``ks``'s object (not what it needs) is in the kernel cache already."""
    return _cached_path(ks, settings, chain)[1].exists()


def nvcc_argv(ks: KernelSource, chain: Toolchain, src: Path, out: Path, *extra: str) -> list[str]:
    """The command that compiles ``ks`` (in ``src``) to ``out``: what the kernel cache runs, and
    what tests that read nvcc's own output (``extra``: e.g. ``-Xptxas=-v``) must run too."""
    return [
        str(chain.nvcc),
        *COMMON_FLAGS,
        *ks.flags,
        *include_flags(chain),
        *extra,
        "-o",
        str(out),
        str(src),
    ]


def _compile_one(ks: KernelSource, settings: Settings, chain: Toolchain) -> tuple[Path, str, bool]:
    """(object path, cache key, cache hit) for ``ks`` alone."""
    key, obj = _cached_path(ks, settings, chain)
    shard = obj.parent
    shard.mkdir(parents=True, exist_ok=True)
    if obj.exists():
        return obj, key, True
    with open(shard / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if obj.exists():  # another worker finished it while we waited
            return obj, key, True
        src = shard / f"{key}.cu"
        tmp_src = shard / f"{key}.{os.getpid()}.cu.tmp"
        tmp_src.write_text(ks.source)
        os.replace(tmp_src, src)
        tmp_obj = shard / f"{key}.{os.getpid()}.o.tmp"
        argv = nvcc_argv(ks, chain, src, tmp_obj)
        try:
            result = run_nvcc(
                argv, src, tmp_obj, settings=settings, chain=chain, what=f"the {ks.family} kernel"
            )
        except CompileError:
            tmp_obj.unlink(missing_ok=True)
            raise
        os.replace(tmp_obj, obj)
        meta = {
            "symbol": ks.symbol,
            "family": ks.family,
            "seconds": result.seconds,
            "nvcc": chain.nvcc_version,
            "config": ks.config,
        }
        (shard / f"{key}.json").write_text(json.dumps(meta, sort_keys=True))
    return obj, key, False


# --------------------------------------------------------------------------------------------
# kernel selection
# --------------------------------------------------------------------------------------------
def select_kernel(
    spec: AttentionSpec, arch: str, preference: str = "auto"
) -> tuple[KernelSource, str]:
    """The kernel for one site and the reason it was chosen (shown in the report).

    On sm_90 the Hopper FMHA (TMA, warp-specialized, wgmma) wins every shape it can take
    (measured: ~3x the SM80 kernel at long sequences, 4x at BERT-base); the SM80-class kernel
    serves other archs and what the Hopper kernel refuses (bias, fp32, head_dim_v != head_dim).
    """
    from worker import hopper  # hopper imports KernelSource from here: keep this lazy

    why_not = hopper.supports(spec, arch) if preference != "sm80" else "options.kernel is sm80"
    if why_not is None:
        variant = hopper.variants(spec)[0]
        symbol = kernel_symbol(FAMILY_HOPPER, spec, arch, variant)
        tile, causal, size = hopper.shape_class(spec)
        grouped = (
            f", GQA {spec.num_q_heads}/{spec.num_kv_heads}"
            if spec.num_q_heads != spec.num_kv_heads
            else ""
        )
        reason = (
            f"Hopper FMHA {variant} ({hopper.VARIANTS[variant].words(causal)}, sm_90a): the "
            "H200-measured pick for "
            f"head dim {tile}, {'causal' if causal else 'non-causal'}, {size} launches{grouped}"
        )
        return hopper.render(spec, symbol, variant), reason
    if preference == "hopper":
        why_not = f"Hopper kernel requested but {why_not}"
    reason = f"SM80-class CUTLASS fMHA (kernel_forward.h) on {arch}: {why_not}"
    symbol = kernel_symbol(FAMILY_SM80, spec, arch)
    return render_sm80(spec, symbol, arch), reason


def kernel_gap(spec: AttentionSpec, arch: str, preference: str = "auto") -> str | None:
    """Why no kernel can run ``spec`` (GQA/MQA needs the Hopper kernel), or None."""
    if spec.num_q_heads == spec.num_kv_heads:
        return None
    from worker import hopper

    if preference == "sm80":
        return "options.kernel is sm80, which needs equal head counts"
    return hopper.supports(spec, arch)
