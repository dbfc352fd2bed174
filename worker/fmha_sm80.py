"""The SM80-class CUTLASS fMHA (``examples/41_fused_multi_head_attention/kernel_forward.h``):
one translation unit per attention site, reading Q/K/V in place by offsets and strides.

It runs on every arch we target; on sm_90 :mod:`worker.selection` prefers the Hopper kernel
wherever that one takes the shape. It is the kernel of ragged batches (``attention_var_len``) on
every arch: ``Params::advance_to_block`` reads each sequence's offset and length from the
int32 ``seqstart`` tensors, one grid z-slice per sequence, and applies causal masks per
sequence. The source is built from an
:class:`~worker.attention.AttentionSpec` only: numbers, enum tokens we choose, and a symbol made
of hex digits. No string from the client's module can reach it.
"""

from __future__ import annotations

from service.spec import CODEGEN_REVISION
from worker.attention import AttentionSpec
from worker.kernel_source import KernelSource
from worker.nvcc import gencode

FAMILY = "cutlass_fmha_sm80"

_CTYPE = {"float16": "cutlass::half_t", "bfloat16": "cutlass::bfloat16_t", "float32": "float"}
_DL = {"float16": ("kDLFloat", 16), "bfloat16": ("kDLBfloat", 16), "float32": ("kDLFloat", 32)}
_MASK = {"none": 0, "TopLeft": 1, "BottomRight": 2}
#: the C++ helper of a ragged batch's seqstart operands
_SEQSTART_OF = """

// The int32 [sequences + 1] offsets of a ragged batch (static extent, or -1 for any).
int32_t* seqstart_of(DLTensor* t, const char* what, int64_t extent) {
  TVM_FFI_ICHECK(t->device.device_type == kDLCUDA) << what << " must be on a CUDA device";
  TVM_FFI_ICHECK(t->ndim == 1 && t->shape[0] >= 1) << what << " must be [sequences + 1]";
  TVM_FFI_ICHECK(extent < 0 || t->shape[0] == extent) << what << " dim 0";
  TVM_FFI_ICHECK(t->dtype.code == kDLInt && t->dtype.bits == 32 && t->dtype.lanes == 1)
      << what << " must be int32";
  TVM_FFI_ICHECK(t->strides == nullptr || t->shape[0] == 1 || t->strides[0] == 1)
      << what << " must be compact";
  return reinterpret_cast<int32_t*>(static_cast<char*>(t->data) + t->byte_offset);
}"""


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
    ragged = spec.ragged
    starts = {ragged.seqstart_q, ragged.seqstart_k} if ragged is not None else set()
    checks = "\n".join(
        f'  expect(a{i}, "input {i}", {len(shape)}, {_dims_literal(shape)});'
        for i, shape in enumerate(spec.operand_shapes)
        if shape is not None and i not in starts
    )
    q, k, v = spec.q, spec.k, spec.v
    batches, ragged_lines, ragged_helper = "batch", "", ""
    if ragged is not None:
        sq, sk = ragged.seqstart_q, ragged.seqstart_k
        batches = "sequences"
        ragged_helper = _SEQSTART_OF
        extent = {i: _dims_literal(spec.operand_shapes[i] or (-1,))[1:-1] for i in starts}
        same_count = (
            f'\n  TVM_FFI_ICHECK_EQ(a{sk}->shape[0], sequences + 1) << "seqstart_k counts other '
            'sequences";'
            if sk != sq
            else ""
        )
        ragged_lines = f"""
  // a ragged batch: one batch entry of packed tokens, sequences delimited by seqstart
  TVM_FFI_ICHECK_EQ(batch, 1) << "packed tokens must be one batch entry";
  int32_t* seqstart_q = seqstart_of(a{sq}, "seqstart_q", {extent[sq]});
  int32_t* seqstart_k = seqstart_of(a{sk}, "seqstart_k", {extent[sk]});
  const int64_t sequences = a{sq}->shape[0] - 1;{same_count}
  TVM_FFI_ICHECK_LE(sequences, 65535) << "more sequences than the grid's z extent holds";
  if (sequences == 0 || seq_q == 0) return;"""
    bias_lines = ""
    if spec.bias is not None:
        b = spec.bias.operand
        bias_lines = f"""
  // bias [B|1, N|1, S|1, S_kv]; a broadcast dim gets stride 0. The kernel reads bias rows in
  // 16-byte vectors, aligned or not (kernel_forward.h's BiasLoader: "kv_len has to be a
  // multiple of this value"): rows of another length, or a bias not on a 16-byte boundary, are
  // copied into a workspace whose rows are padded to a multiple of 16 bytes (the kernel adds
  // no bias past S_kv, so the padding is never read into a score)
  TVM_FFI_ICHECK_EQ(a{b}->shape[3], seq_kv) << "bias last dim must be seq_kv";
  constexpr int64_t kBiasVector = 16 / sizeof(Element);
  Element* bias = data_of(a{b});
  int64_t bias_row = seq_kv;
  if (seq_kv % kBiasVector != 0 || reinterpret_cast<uintptr_t>(bias) % 16 != 0) {{
    bias_row = (seq_kv + kBiasVector - 1) / kBiasVector * kBiasVector;
    const int64_t rows = a{b}->shape[0] * a{b}->shape[1] * a{b}->shape[2];
    void* bias_copy = workspaces.take(uint64_t(rows) * bias_row * sizeof(Element), {code},
                                      {bits}, "the padded attention bias");
    cudaError_t e = cudaMemcpy2DAsync(bias_copy, bias_row * sizeof(Element), bias,
                                      seq_kv * sizeof(Element), seq_kv * sizeof(Element), rows,
                                      cudaMemcpyDeviceToDevice, stream);
    TVM_FFI_ICHECK(e == cudaSuccess) << "padding the attention bias: " << cudaGetErrorString(e);
    bias = static_cast<Element*>(bias_copy);
  }}
  p.attn_bias_ptr = bias;
  p.bias_strideM = a{b}->shape[2] == 1 ? 0 : bias_row;
  p.bias_strideH = a{b}->shape[1] == 1 ? 0 : a{b}->shape[2] * bias_row;
  p.bias_strideB = a{b}->shape[0] == 1 ? 0 : a{b}->shape[1] * a{b}->shape[2] * bias_row;"""
    seqstart_lines = ""
    if ragged is not None:
        seqstart_lines = """
  // each block reads its sequence's offsets; seq_q (all tokens) bounds the grid's query blocks
  p.seqstart_q_ptr = seqstart_q;
  p.seqstart_k_ptr = seqstart_k;"""
    ws = workspace_bytes(spec, cfg)
    source = f"""// Generated by Stackfuse (codegen rev {CODEGEN_REVISION}): {FAMILY}, {arch}.
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

// The workspaces one call takes from TVM's pool, given back when the call returns or throws
// (a failed check after an allocation must not leak it), in the reverse order of allocation,
// which is the order the pool frees in. Freed right after the launch: the pool's reuse is
// stream-ordered.
struct Workspaces {{
  int device;
  void* taken[2] = {{nullptr, nullptr}};
  int count = 0;
  void* take(uint64_t bytes, int code, int bits, const char* what) {{
    void* ptr = TVMBackendAllocWorkspace(kDLCUDA, device, bytes, code, bits);
    TVM_FFI_ICHECK(ptr != nullptr) << "could not allocate " << what;
    taken[count++] = ptr;
    return ptr;
  }}
  ~Workspaces() {{
    while (count > 0) TVMBackendFreeWorkspace(kDLCUDA, device, taken[--count]);
  }}
}};{ragged_helper}

void run({args}, DLTensor* out) {{
{checks}
  const int64_t batch = a{q.operand}->shape[0];
  const int64_t seq_q = a{q.operand}->shape[1];
  const int64_t seq_kv = a{k.operand}->shape[1];
  TVM_FFI_ICHECK_EQ(a{k.operand}->shape[0], batch) << "k batch differs from q batch";
  TVM_FFI_ICHECK_EQ(a{v.operand}->shape[0], batch) << "v batch differs from q batch";
  TVM_FFI_ICHECK_EQ(a{v.operand}->shape[1], seq_kv) << "v sequence differs from k sequence";
  expect(out, "output", 4, {{batch, seq_q, {spec.num_q_heads}, {spec.head_dim_v}}});{ragged_lines}

  typename Attention::Params p;
  p.query_ptr = data_of(a{q.operand}) + {q.offset};
  p.key_ptr = data_of(a{k.operand}) + {k.offset};
  p.value_ptr = data_of(a{v.operand}) + {v.offset};
  p.output_ptr = data_of(out);
  p.output_accum_ptr = nullptr;
  p.logsumexp_ptr = nullptr;
  p.scale = {spec.scale!r}f;
  p.num_heads = {spec.num_q_heads};
  p.num_batches = static_cast<int32_t>({batches});
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
  p.v_strideB = int64_t({v.row_stride}) * seq_kv;

  const int device = out->device.device_id;
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
  Workspaces workspaces{{device}};{bias_lines}{seqstart_lines}
  if (Attention::kNeedsOutputAccumulatorBuffer) {{
    const uint64_t bytes = uint64_t(batch) * seq_q * {spec.num_q_heads * spec.head_dim_v} *
                           sizeof(typename Attention::output_accum_t);
    p.output_accum_ptr = static_cast<typename Attention::output_accum_t*>(
        workspaces.take(bytes, kDLFloat, 32, "the attention accumulator"));
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
  kernel_fn<<<p.getBlocksGrid(), p.getThreadsGrid(), smem_bytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
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
        family=FAMILY,
        flags=gencode(arch),
        config=cfg,
        workspace_bytes=ws,
    )
