// Hopper GEMM configurations: CUTLASS 3.x TMA + warp-specialized mainloops from the collective
// builder, with the epilogue visitor tree act(acc + beta * C + bias) (LinCombPerColBiasEltAct),
// or silu(C) * acc for a gated unit (SwiGLU's up projection times the SiLU of its gate).
// One Config is one compiled object; the problem size is run-time data (gemm_api.h), so a few
// configurations serve every layer of every model. A null bias reads as zeros and beta 0 skips
// loading C. A configuration with C serves residual adds; one without (HasC false) gives its
// shared memory to the mainloop, for the sites that add no residual.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "gemm_api.h"

namespace stackfuse {
namespace gemm {

struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

template <template <class> class Act, class ElementD, class Element>
struct FusionOf {
  static constexpr bool kGate = false;
  using type = cutlass::epilogue::fusion::LinCombPerColBiasEltAct<Act, ElementD, float, Element,
                                                                  Element, float>;
};

template <class ElementD, class Element>
struct FusionOf<SiLuGate, ElementD, Element> {
  static constexpr bool kGate = true;
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using type = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float, kRound>,
      cutlass::epilogue::fusion::Sm90EVT<
          cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::SiLu, float, float,
                                                 kRound>,
          cutlass::epilogue::fusion::Sm90SrcFetch<Element>>,
      cutlass::epilogue::fusion::Sm90AccFetch>;
};

// BKMajor: B stored [N, K] (a transposed weight, torch.nn.Linear's layout); else [K, N].
template <class Element, bool BKMajor, int TileM, int TileN, int TileK, int ClusterM,
          int ClusterN, class Schedule, class Scheduler, template <class> class Act, bool HasC>
struct Config {
  static constexpr bool kHasC = HasC;
  static constexpr bool kGate = FusionOf<Act, Element, Element>::kGate;
  static_assert(!kGate || HasC, "a gated configuration reads its gate as C");
  using ElementA = Element;
  using ElementB = Element;
  using ElementC = cute::conditional_t<HasC, Element, void>;
  using ElementD = Element;
  using Accumulator = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB =
      cute::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;

  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using Fusion = typename FusionOf<Act, ElementD, Element>::type;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, float, ElementC, LayoutC,
      kAlign, ElementD, LayoutC, kAlign, typename Schedule::Epilogue, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB,
      LayoutB, kAlign, Accumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int sm_count(int device) {
  static int counts[64] = {};
  if (device < 0 || device >= 64) {
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }
  if (counts[device] == 0) {
    counts[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }
  return counts[device];
}

template <class Cfg>
Status launch(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error) {
  using Gemm = typename Cfg::Gemm;
  using Element = typename Cfg::ElementA;
  *cuda_error = cudaSuccess;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d) || (p.c && !aligned16(p.c)) ||
      (p.bias && !aligned16(p.bias))) {
    return Status::kMisaligned;
  }
  auto stride_a = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideA{},
                                                   cute::make_shape(p.m, p.k, p.l));
  auto stride_b = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideB{},
                                                   cute::make_shape(p.n, p.k, p.l));
  cute::get<2>(stride_b) = p.batch_stride_b;
  auto stride_c = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideC{},
                                                   cute::make_shape(p.m, p.n, p.l));
  auto stride_d = cutlass::make_cute_packed_stride(typename Gemm::GemmKernel::StrideD{},
                                                   cute::make_shape(p.m, p.n, p.l));
  if (p.c != nullptr && !Cfg::kHasC) return Status::kUnsupported;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {p.m, p.n, p.k, p.l};
  args.mainloop.ptr_A = static_cast<const Element*>(p.a);
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = static_cast<const Element*>(p.b);
  args.mainloop.dB = stride_b;
  if constexpr (Cfg::kHasC) {
    // beta 0 never reads C, but its TMA descriptor still needs an address
    args.epilogue.ptr_C = static_cast<const Element*>(p.c ? p.c : p.d);
  } else {
    args.epilogue.ptr_C = nullptr;
  }
  args.epilogue.dC = stride_c;
  args.epilogue.ptr_D = static_cast<Element*>(p.d);
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = p.device_id;
  args.hw_info.sm_count = sm_count(p.device_id);
  if (p.swizzle > 1) args.scheduler.max_swizzle_size = p.swizzle;
  if constexpr (Cfg::kGate) {
    // the tree's nodes take no arguments; the gate is C, which it always reads
    if (p.c == nullptr || p.bias != nullptr) return Status::kUnsupported;
  } else {
    auto& f = args.epilogue.thread;
    f.alpha = 1.0f;
    f.beta = p.c ? p.beta : 0.0f;
    f.bias_ptr = static_cast<const Element*>(p.bias);
  }

  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return Status::kUnsupported;
  const size_t bytes = Gemm::get_workspace_size(args);
  void* workspace = nullptr;
  if (bytes > 0) {
    workspace = p.alloc ? p.alloc(bytes, p.device_id, p.alloc_ctx) : nullptr;
    if (workspace == nullptr) return Status::kWorkspace;
  }
  Status status = Status::kOk;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    status = Status::kInitialize;
  } else if (gemm.run(stream) != cutlass::Status::kSuccess) {
    status = Status::kLaunch;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    *cuda_error = e;
    if (status == Status::kOk) status = Status::kLaunch;
  }
  if (workspace != nullptr && p.free) p.free(workspace, p.device_id, p.alloc_ctx);
  return status;
}

}  // namespace gemm
}  // namespace stackfuse
