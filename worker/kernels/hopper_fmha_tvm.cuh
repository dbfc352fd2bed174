// TVM-FFI glue for the Hopper FMHA wrapper (hopper_fmha.cuh): checks the DLTensor arguments
// against the numbers the code generator baked in, resolves run-time batch/sequence lengths,
// takes the LSE scratch buffer from TVM's workspace pool and launches on TVM's stream.
//
// Why a header and not generated text: the checks are the same for every configuration; the
// generated translation unit only fills a `StackedSpec` with numbers and names the compiled
// configuration (a `LaunchFn`, see hopper_api.h) to call. No CUTLASS header is included here.
#pragma once

#include <cstdint>

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "hopper_api.h"

extern "C" {
void* TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes,
                               int dtype_code_hint, int dtype_bits_hint);
int TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr);
}

namespace stackfuse {
namespace hopper {

constexpr int kMaxOperands = 8;
constexpr int kMaxRank = 6;

struct AccessSpec {
  int operand;
  int64_t offset;
  int64_t row;
  int64_t head;
};

// Numbers only; -1 marks an extent read at run time, op_rank -1 an argument that is no tensor
// (TVM passes symbolic reshape targets as shape arguments; the kernel ignores them).
struct StackedSpec {
  int num_operands;
  AccessSpec q, k, v;
  int64_t batch, seq_q, seq_kv;
  int q_heads, kv_heads, head_dim, head_dim_v;
  float scale;
  int dtype_code;  // kDLFloat (2) or kDLBfloat (4)
  int dtype_bits;
  int op_rank[kMaxOperands];
  int64_t op_shape[kMaxOperands][kMaxRank];
};

inline int64_t numel(const DLTensor* t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

inline bool is_compact(const DLTensor* t) {
  if (t->strides == nullptr) return true;
  int64_t expect = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    if (t->shape[i] != 1 && t->strides[i] != expect) return false;
    expect *= t->shape[i];
  }
  return true;
}

inline void check_tensor(const DLTensor* t, const StackedSpec& s, const char* what) {
  TVM_FFI_ICHECK(t != nullptr) << what << " is null";
  TVM_FFI_ICHECK_EQ(t->device.device_type, kDLCUDA) << what << " must live on a CUDA device";
  TVM_FFI_ICHECK(t->dtype.code == s.dtype_code && t->dtype.bits == s.dtype_bits &&
                 t->dtype.lanes == 1)
      << what << " has dtype code " << int(t->dtype.code) << " bits " << int(t->dtype.bits)
      << "; expected code " << s.dtype_code << " bits " << s.dtype_bits;
  TVM_FFI_ICHECK(is_compact(t)) << what << " must be compact (row-major, no gaps)";
}

inline const char* data_of(const DLTensor* t) {
  return static_cast<const char*>(t->data) + t->byte_offset;
}

// Resolves an extent: the baked number, or the run-time one when the spec says -1.
inline int64_t resolve(int64_t baked, int64_t runtime, const char* what) {
  if (baked >= 0) {
    TVM_FFI_ICHECK_EQ(runtime, baked) << what << " is " << runtime << ", compiled for " << baked;
    return baked;
  }
  return runtime;
}

// launch: the compiled configuration's entry point. ops[i] is null where op_rank[i] is -1.
inline void run_stacked(LaunchFn launch, const StackedSpec& s, DLTensor* const* ops,
                        DLTensor* out) {
  const DLTensor* first = nullptr;
  for (int i = 0; i < s.num_operands; ++i) {
    if (s.op_rank[i] < 0) continue;
    check_tensor(ops[i], s, "attention operand");
    TVM_FFI_ICHECK_EQ(ops[i]->ndim, s.op_rank[i]) << "attention operand " << i << " rank";
    TVM_FFI_ICHECK_GE(ops[i]->ndim, 3) << "attention operand " << i << " must be [B, S, ...]";
    for (int d = 0; d < s.op_rank[i]; ++d) {
      if (s.op_shape[i][d] >= 0) {
        TVM_FFI_ICHECK_EQ(ops[i]->shape[d], s.op_shape[i][d])
            << "attention operand " << i << " dim " << d;
      }
    }
    if (first == nullptr) first = ops[i];
    TVM_FFI_ICHECK_EQ(ops[i]->device.device_id, first->device.device_id)
        << "operands on different devices";
  }
  TVM_FFI_ICHECK(first != nullptr) << "no tensor operand";
  check_tensor(out, s, "attention output");
  TVM_FFI_ICHECK_EQ(out->device.device_id, first->device.device_id)
      << "output on a different device";

  TVM_FFI_ICHECK(s.op_rank[s.q.operand] >= 0 && s.op_rank[s.k.operand] >= 0 &&
                 s.op_rank[s.v.operand] >= 0)
      << "q, k and v must be tensor operands";
  const DLTensor* tq = ops[s.q.operand];
  const DLTensor* tk = ops[s.k.operand];
  const DLTensor* tv = ops[s.v.operand];
  int64_t const batch = resolve(s.batch, tq->shape[0], "batch");
  int64_t const seq_q = resolve(s.seq_q, tq->shape[1], "query sequence length");
  int64_t const seq_kv = resolve(s.seq_kv, tk->shape[1], "key sequence length");
  TVM_FFI_ICHECK_EQ(tk->shape[0], batch) << "key batch";
  TVM_FFI_ICHECK_EQ(tv->shape[0], batch) << "value batch";
  TVM_FFI_ICHECK_EQ(tv->shape[1], seq_kv) << "value sequence length";
  TVM_FFI_ICHECK(batch > 0 && seq_q > 0 && seq_kv > 0) << "empty attention problem";
  TVM_FFI_ICHECK(batch <= INT32_MAX && seq_q <= INT32_MAX && seq_kv <= INT32_MAX)
      << "extent too large";

  // Each operand's rows must be exactly `row` elements, so that batch stride = row * seq.
  const AccessSpec* acc[3] = {&s.q, &s.k, &s.v};
  for (const AccessSpec* a : acc) {
    const DLTensor* t = ops[a->operand];
    int64_t row = 1;
    for (int d = 2; d < t->ndim; ++d) row *= t->shape[d];
    TVM_FFI_ICHECK_EQ(row, a->row) << "operand " << a->operand << " row size";
  }

  TVM_FFI_ICHECK_EQ(out->shape[0], batch) << "output batch";
  TVM_FFI_ICHECK_EQ(out->shape[1], seq_q) << "output sequence length";
  TVM_FFI_ICHECK_EQ(numel(out), batch * seq_q * s.q_heads * s.head_dim_v)
      << "output must be [B, S, " << s.q_heads << ", " << s.head_dim_v << "]";

  int const dev = out->device.device_id;
  int64_t const elem = s.dtype_bits / 8;
  Problem p;
  p.q = {data_of(tq) + s.q.offset * elem, s.q.row, s.q.row * seq_q, s.q.head};
  p.k = {data_of(tk) + s.k.offset * elem, s.k.row, s.k.row * seq_kv, s.k.head};
  p.v = {data_of(tv) + s.v.offset * elem, s.v.row, s.v.row * seq_kv, s.v.head};
  p.o = static_cast<char*>(out->data) + out->byte_offset;
  p.o_row = int64_t(s.q_heads) * s.head_dim_v;
  p.o_batch = p.o_row * seq_q;
  p.o_head = s.head_dim_v;
  p.batch = int(batch);
  p.seq_q = int(seq_q);
  p.seq_kv = int(seq_kv);
  p.q_heads = s.q_heads;
  p.kv_heads = s.kv_heads;
  p.head_dim = s.head_dim;
  p.scale = s.scale;
  p.device_id = dev;

  int64_t const lse_nbytes = lse_bytes(p.batch, p.q_heads, p.seq_q);
  void* lse = TVMBackendAllocWorkspace(kDLCUDA, dev, uint64_t(lse_nbytes), 2, 32);
  if (lse == nullptr) {
    TVM_FFI_THROW(RuntimeError) << "Hopper FMHA: cannot allocate " << lse_nbytes
                                << " bytes of workspace";
  }
  p.lse = static_cast<float*>(lse);
  cudaStream_t stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, dev));
  int prev_dev = -1;
  bool switched = false;
  if (cudaGetDevice(&prev_dev) == cudaSuccess && prev_dev != dev) {
    switched = cudaSetDevice(dev) == cudaSuccess;
  }
  cudaError_t cuda_error = cudaSuccess;
  Status st = launch(p, stream, &cuda_error);
  if (switched) (void)cudaSetDevice(prev_dev);
  TVMBackendFreeWorkspace(kDLCUDA, dev, lse);
  if (st != Status::kOk) {
    TVM_FFI_THROW(RuntimeError) << "Hopper FMHA: " << status_text(st)
                                << (cuda_error != cudaSuccess ? ": " : "")
                                << (cuda_error != cudaSuccess ? cudaGetErrorString(cuda_error) : "")
                                << " (batch " << batch << ", seq_q " << seq_q << ", seq_kv "
                                << seq_kv << ")";
  }
}

}  // namespace hopper
}  // namespace stackfuse
