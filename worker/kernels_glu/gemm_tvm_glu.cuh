// The TVM-FFI side of a paired SwiGLU site (gemm_sm90_glu.cuh): the GEMM is N = 2I columns
// wide, the output [..., I]. The site's spec gives N and the output's real shape; the output is
// checked against that, then handed to run_site (gemm_tvm.cuh) as the [..., N] operand its GEMM
// checks expect: the kernel writes only the [..., I] it holds (its row stride is I).
#pragma once

#include "gemm_tvm.cuh"

namespace stackfuse {
namespace gemm {

inline void run_paired_site(LaunchFn launch, const SiteSpec& s, DLTensor* const* ops,
                            DLTensor* out) {
  TVM_FFI_ICHECK(s.out_rank >= 1 && s.out_rank <= kMaxRank && s.n % 16 == 0 &&
                 s.out_shape[s.out_rank - 1] == s.n / 2)
      << "a paired SwiGLU site's output must be [..., N / 2]";
  expect(s, out, "the output", s.out_rank, s.out_shape);
  SiteSpec wide = s;
  wide.out_shape[s.out_rank - 1] = s.n;
  int64_t shape[kMaxRank];
  for (int i = 0; i < out->ndim; ++i) shape[i] = out->shape[i];
  shape[out->ndim - 1] = s.n;
  DLTensor view = *out;
  view.shape = shape;
  view.strides = nullptr;
  run_site(launch, wide, ops, &view);
}

}  // namespace gemm
}  // namespace stackfuse
