// The GEMM configurations' calling convention, apart from their implementation: what the
// TVM-FFI glue of one GEMM site (gemm_tvm.cuh) fills in and what one compiled configuration
// (gemm_sm90.cuh) takes. The glue includes only this, not CUTLASS: a configuration (element
// type, B's layout, tile, cluster, schedule, activation) is compiled once and shared by every
// site and model that needs it; a new shape compiles its few lines of glue in seconds.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace stackfuse {
namespace gemm {

// D[l] = act(A[l] B[l] + beta * C[l] + bias), or silu(C[l]) * A[l] B[l] for a gated
// configuration (beta and bias unused), every operand compact:
//   A [L, M, K] row-major; B [L, K, N] (N-major) or [L, N, K] (K-major) as the configuration
//   says; C and D [L, M, N] row-major; bias [N] broadcast over rows. C may be null (beta 0),
//   bias may be null (no bias). A batch stride of 0 broadcasts B over L.
struct Problem {
  const void* a;
  const void* b;
  const void* c;
  const void* bias;
  void* d;
  int m, n, k, l;
  int64_t batch_stride_b;
  float beta;
  int device_id;
  // the persistent scheduler's tile swizzle (1: none; 2, 4, 8: tiles visited in blocks, for L2)
  int swizzle;
  // scratch memory for the tile scheduler (stream-K partials); free is called once per alloc
  void* (*alloc)(size_t bytes, int device_id, void* ctx);
  void (*free)(void* ptr, int device_id, void* ctx);
  void* alloc_ctx;
};

enum class Status : int {
  kOk = 0,
  kUnsupported = 1,  // CUTLASS's can_implement refused the problem (alignment, extents)
  kWorkspace = 2,
  kInitialize = 3,
  kLaunch = 4,
  kMisaligned = 5,
};

inline const char* status_text(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kUnsupported:
      return "CUTLASS cannot run this problem (extents or alignment outside the kernel's range)";
    case Status::kWorkspace: return "the kernel's scratch memory could not be allocated";
    case Status::kInitialize: return "the kernel's parameters could not be initialized";
    case Status::kLaunch: return "the kernel launch failed";
    case Status::kMisaligned: return "an operand address is not 16-byte aligned (TMA needs 16)";
  }
  return "unknown status";
}

// The Act of a gated configuration (both families): D = silu(C) * acc, C being the gate's
// projection. SiLU runs in float32 on C as stored, like transformers'
// act_fn(gate_proj(x)) * up_proj(x).
template <class T>
struct SiLuGate {};

using LaunchFn = Status (*)(Problem const&, cudaStream_t, cudaError_t*);

}  // namespace gemm
}  // namespace stackfuse
