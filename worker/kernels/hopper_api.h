// The Hopper FMHA's calling convention, apart from its implementation: what the TVM-FFI glue
// (hopper_fmha_tvm.cuh) fills in and what one compiled configuration (hopper_fmha.cuh) takes.
//
// Why a header of its own: the glue of one attention site includes only this, not CUTLASS. A
// configuration (element type, tile, schedule, mask) is compiled once into an object that
// exports one `LaunchFn`, and every site and model that needs that configuration links the same
// object: a new model shape compiles its few lines of glue in seconds, not the CUTLASS kernel.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace stackfuse {
namespace hopper {

// Strides in elements. Batch stride of an operand is row * seq_len of that operand.
struct Operand {
  const void* ptr;
  int64_t row;
  int64_t batch;
  int64_t head;
};

struct Problem {
  Operand q, k, v;
  void* o;
  int64_t o_row, o_batch, o_head;
  float* lse;  // scratch of lse_bytes(): the epilogue always writes the log-sum-exp
  int batch, seq_q, seq_kv, q_heads, kv_heads, head_dim;
  float scale;
  int device_id;
};

// Bytes of the scratch buffer `launch` needs: one float per query row and query head (the
// launches of a group, where there are several, run one after the other and share it).
inline int64_t lse_bytes(int batch, int q_heads, int seq_q) {
  return int64_t(batch) * q_heads * seq_q * int64_t(sizeof(float));
}

// Why a failure happened, for the caller's error message.
enum class Status : int {
  kOk = 0,
  kBadHeads = 1,
  kStrideOverflow = 2,
  kMisaligned = 3,
  kSmemAttribute = 4,
  kLaunch = 5,
  kDevice = 6,
  kTooManyKeys = 7,
  kGridOverflow = 8,
};

inline const char* status_text(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kBadHeads: return "query heads are not a multiple of key/value heads";
    case Status::kStrideOverflow: return "a stride or extent exceeds 2^31 elements";
    case Status::kMisaligned:
      return "an operand address or stride is not 16-byte aligned (TMA needs 16 bytes)";
    case Status::kSmemAttribute: return "cudaFuncSetAttribute (shared memory) failed";
    case Status::kLaunch: return "kernel launch failed";
    case Status::kDevice: return "cannot query the CUDA device";
    case Status::kTooManyKeys:
      return "more keys than the short-sequence kernel holds (compiled for at most 128 or 256)";
    case Status::kGridOverflow: return "more than 65535 heads or batch entries in one launch";
  }
  return "unknown";
}

// One compiled configuration: checks `p` against what the kernel can do, then launches.
using LaunchFn = Status (*)(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error);

}  // namespace hopper
}  // namespace stackfuse
