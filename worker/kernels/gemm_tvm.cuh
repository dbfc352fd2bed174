// The TVM-FFI side of one GEMM site: checks the operands TVM hands over against the site's
// spec, fills a gemm::Problem and calls the configuration's LaunchFn on TVM's stream. No CUTLASS
// header is included here (see gemm_api.h).
#pragma once

#include <cstdint>

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include "gemm_api.h"

extern "C" void* TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes,
                                          int dtype_code_hint, int dtype_bits_hint);
extern "C" int TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr);

namespace stackfuse {
namespace gemm {

constexpr int kMaxOperands = 8;
constexpr int kMaxRank = 6;

// What the Python side knows of a site: which fused-function argument is which operand (-1:
// absent), B's layout, the static extents (-1: read at run time) and the element type.
struct SiteSpec {
  int num_operands;
  int a, b, bias, c;
  bool b_kmajor;
  int64_t n, k;
  int dtype_code, dtype_bits;
  int op_rank[kMaxOperands];  // -1: not a tensor (a shape TVM passes along)
  int64_t op_shape[kMaxOperands][kMaxRank];
  int out_rank;
  int64_t out_shape[kMaxRank];
  int swizzle;
};

inline const char* role(const SiteSpec& s, int i) {
  if (i == s.a) return "the activation (A)";
  if (i == s.b) return "the weight (B)";
  if (i == s.bias) return "the bias";
  if (i == s.c) return "C (the residual or the gate)";
  return "an operand";
}

inline void* data_of(DLTensor* t) { return static_cast<char*>(t->data) + t->byte_offset; }

inline int64_t numel(DLTensor* t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

inline void expect(const SiteSpec& s, DLTensor* t, const char* what, int rank,
                   const int64_t* dims) {
  TVM_FFI_ICHECK(t->device.device_type == kDLCUDA) << what << " must be on a CUDA device";
  TVM_FFI_ICHECK_EQ(t->ndim, rank) << what << " has the wrong rank";
  TVM_FFI_ICHECK(t->dtype.code == s.dtype_code && t->dtype.bits == s.dtype_bits &&
                 t->dtype.lanes == 1)
      << what << " has the wrong dtype";
  for (int i = 0; i < rank; ++i) {
    if (dims[i] >= 0) TVM_FFI_ICHECK_EQ(t->shape[i], dims[i]) << what << " dim " << i;
  }
  if (t->strides != nullptr) {
    int64_t st = 1;
    for (int j = t->ndim - 1; j >= 0; --j) {
      TVM_FFI_ICHECK(t->shape[j] == 1 || t->strides[j] == st) << what << " must be compact";
      st *= t->shape[j];
    }
  }
}

inline void* alloc_workspace(size_t bytes, int device, void*) {
  return TVMBackendAllocWorkspace(kDLCUDA, device, bytes, kDLUInt, 8);
}

inline void free_workspace(void* ptr, int device, void*) {
  TVMBackendFreeWorkspace(kDLCUDA, device, ptr);
}

inline void run_site(LaunchFn launch, const SiteSpec& s, DLTensor* const* ops, DLTensor* out) {
  for (int i = 0; i < s.num_operands; ++i) {
    if (s.op_rank[i] >= 0) expect(s, ops[i], role(s, i), s.op_rank[i], s.op_shape[i]);
  }
  expect(s, out, "the output", s.out_rank, s.out_shape);
  DLTensor* a = ops[s.a];
  DLTensor* b = ops[s.b];
  TVM_FFI_ICHECK_EQ(a->shape[a->ndim - 1], s.k) << "the activation's last dim must be K";
  Problem p{};
  p.n = static_cast<int>(s.n);
  p.k = static_cast<int>(s.k);
  int64_t m = 1, l = 1;
  if (b->ndim == 2) {
    for (int i = 0; i + 1 < a->ndim; ++i) m *= a->shape[i];
    p.batch_stride_b = 0;
  } else {
    TVM_FFI_ICHECK(a->ndim == 3 && a->shape[0] == b->shape[0])
        << "a batched matmul needs A [L, M, K] and B with the same L";
    l = a->shape[0];
    m = a->shape[1];
    p.batch_stride_b = s.n * s.k;
  }
  TVM_FFI_ICHECK(m > 0 && m < (int64_t(1) << 31) && l < (int64_t(1) << 31))
      << "the GEMM's M or batch is out of range: " << m << ", " << l;
  p.m = static_cast<int>(m);
  p.l = static_cast<int>(l);
  TVM_FFI_ICHECK_EQ(numel(out), l * m * s.n) << "the output has the wrong number of elements";
  p.a = data_of(a);
  p.b = data_of(b);
  p.d = data_of(out);
  if (s.bias >= 0) {
    TVM_FFI_ICHECK_EQ(numel(ops[s.bias]), s.n) << "the bias must hold N elements";
    p.bias = data_of(ops[s.bias]);
  }
  if (s.c >= 0) {
    TVM_FFI_ICHECK_EQ(numel(ops[s.c]), l * m * s.n) << "C (the residual or the gate) must match the output";
    p.c = data_of(ops[s.c]);
    p.beta = 1.0f;
  }
  p.device_id = out->device.device_id;
  p.swizzle = s.swizzle;
  p.alloc = &alloc_workspace;
  p.free = &free_workspace;
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, p.device_id));
  cudaError_t err = cudaSuccess;
  Status st = launch(p, stream, &err);
  if (st != Status::kOk) {
    TVM_FFI_THROW(RuntimeError) << "CUTLASS GEMM (M=" << m << " N=" << s.n << " K=" << s.k
                                << "): " << status_text(st)
                                << (err != cudaSuccess ? cudaGetErrorString(err) : "");
  }
}

}  // namespace gemm
}  // namespace stackfuse
