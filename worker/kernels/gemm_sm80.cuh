// Ampere-class (sm_80/86/89) GEMM configurations: CUTLASS 2.x multistage tensor-op mainloops
// (cp.async, mma.sync 16x8x16) with the 2.x epilogue visitor tree, the same epilogues as the
// Hopper configurations (gemm_sm90.cuh): act(acc + bias [+ C]), or silu(C) * acc for a gated
// unit. One Config is one compiled object; the problem size is run-time data (gemm_api.h). A
// null bias reads as zeros (the row broadcast's default); C is read only by configurations
// built with it (HasC), since the 2.x auxiliary load has no null default.
#pragma once

#include <cstdint>

// the visitors' headers lean on the GEMM and memory headers being included first
#include "cutlass/cutlass.h"
#include "cutlass/arch/memory.h"
#include "cutlass/gemm/device/gemm_universal.h"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/epilogue/threadblock/fusion/visitors.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

#include "gemm_api.h"

namespace stackfuse {
namespace gemm {
namespace sm80 {

namespace evt = cutlass::epilogue::threadblock;
using cute::_0;
using cute::_1;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
using StrideMN = cute::Stride<int64_t, _1, int64_t>;  // row-major [L, M, N]

// The visitor tree of one (Act, HasC) epilogue over OutputTileThreadMap, and how to fill its
// arguments from a Problem.
template <class ThreadMap, class Element, template <class> class Act, bool HasC>
struct Tree {
  using Acc = evt::VisitorAccFetch;
  using Bias = evt::VisitorRowBroadcast<ThreadMap, Element, cute::Stride<_0, _1, int32_t>>;
  using AccBias = evt::Sm80EVT<evt::VisitorCompute<cutlass::plus, float, float, kRound>, Acc, Bias>;
  using C = evt::VisitorAuxLoad<ThreadMap, Element, StrideMN>;
  using Sum = cute::conditional_t<
      HasC, evt::Sm80EVT<evt::VisitorCompute<cutlass::plus, float, float, kRound>, AccBias, C>,
      AccBias>;
  using Out = evt::Sm80EVT<evt::VisitorCompute<Act, Element, float, kRound>, Sum>;
  using D = evt::VisitorAuxStore<ThreadMap, Element, kRound, StrideMN>;
  using type = evt::Sm80EVT<D, Out>;

  static typename type::Arguments arguments(Problem const& p) {
    const int64_t mn = int64_t(p.m) * p.n;
    typename Bias::Arguments bias{static_cast<const Element*>(p.bias), Element(0),
                                  {_0{}, _1{}, int32_t(0)}};
    typename AccBias::Arguments acc_bias{{}, bias, {}};
    typename D::Arguments d{static_cast<Element*>(p.d), {int64_t(p.n), _1{}, mn}};
    if constexpr (HasC) {
      typename C::Arguments c{static_cast<Element*>(const_cast<void*>(p.c)), Element(0),
                              {int64_t(p.n), _1{}, mn}};
      return {{{acc_bias, c, {}}, {}}, d};
    } else {
      return {{acc_bias, {}}, d};
    }
  }
};

// D = silu(C) * acc, C being the gate's projection; SiLU in float32 on C as stored.
template <class ThreadMap, class Element>
struct Tree<ThreadMap, Element, SiLuGate, true> {
  using Acc = evt::VisitorAccFetch;
  using C = evt::VisitorAuxLoad<ThreadMap, Element, StrideMN>;
  using Silu = evt::Sm80EVT<
      evt::VisitorCompute<cutlass::epilogue::thread::SiLu, float, float, kRound>, C>;
  using Out = evt::Sm80EVT<evt::VisitorCompute<cutlass::multiplies, Element, float, kRound>,
                           Silu, Acc>;
  using D = evt::VisitorAuxStore<ThreadMap, Element, kRound, StrideMN>;
  using type = evt::Sm80EVT<D, Out>;

  static typename type::Arguments arguments(Problem const& p) {
    const int64_t mn = int64_t(p.m) * p.n;
    typename C::Arguments c{static_cast<Element*>(const_cast<void*>(p.c)), Element(0),
                            {int64_t(p.n), _1{}, mn}};
    typename D::Arguments d{static_cast<Element*>(p.d), {int64_t(p.n), _1{}, mn}};
    return {{{c, {}}, {}, {}}, d};
  }
};

// BKMajor: B stored [N, K] (torch.nn.Linear's layout); else [K, N].
template <class Element, bool BKMajor, int TileM, int TileN, int TileK, int WarpM, int WarpN,
          int Stages, template <class> class Act, bool HasC>
struct Config {
  static constexpr bool kHasC = HasC;
  static constexpr bool kGate = cute::is_same_v<Act<float>, SiLuGate<float>>;
  static_assert(!kGate || HasC, "a gated configuration reads its gate as C");
  using ElementA = Element;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB =
      cute::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
  static constexpr int kEpilogueStages = 1;

  using TileShape = cutlass::gemm::GemmShape<TileM, TileN, TileK>;
  using WarpShape = cutlass::gemm::GemmShape<WarpM, WarpN, TileK>;
  using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;
  using ThreadMap =
      evt::OutputTileThreadLayout<TileShape, WarpShape, Element, kAlign, kEpilogueStages>;
  using Epilogue = Tree<ThreadMap, Element, Act, HasC>;

  using Kernel = typename cutlass::gemm::kernel::DefaultGemmWithVisitor<
      Element, LayoutA, cutlass::ComplexTransform::kNone, kAlign, Element, LayoutB,
      cutlass::ComplexTransform::kNone, kAlign, Element, LayoutC, kAlign, float, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, TileShape, WarpShape,
      InstructionShape, typename Epilogue::type,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, Stages,
      cutlass::arch::OpMultiplyAdd, kEpilogueStages>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class Cfg>
Status launch(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error) {
  using Gemm = typename Cfg::Gemm;
  using Element = typename Cfg::ElementA;
  *cuda_error = cudaSuccess;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.d) || (p.c && !aligned16(p.c)) ||
      (p.bias && !aligned16(p.bias))) {
    return Status::kMisaligned;
  }
  // C is read exactly when the configuration was built to read it; a gate takes no bias
  if ((p.c != nullptr) != Cfg::kHasC || (Cfg::kGate && p.bias != nullptr)) {
    return Status::kUnsupported;
  }
  const int64_t lda = p.k;
  const int64_t ldb = (cute::is_same_v<typename Cfg::LayoutB, cutlass::layout::ColumnMajor>)
                          ? p.k
                          : p.n;
  typename Gemm::Arguments args(
      p.l > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
              : cutlass::gemm::GemmUniversalMode::kGemm,
      cutlass::gemm::GemmCoord{p.m, p.n, p.k}, p.l, Cfg::Epilogue::arguments(p),
      static_cast<const Element*>(p.a), static_cast<const Element*>(p.b), nullptr, nullptr,
      int64_t(p.m) * p.k, p.batch_stride_b, 0, 0, lda, ldb, 0, 0);

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

}  // namespace sm80
}  // namespace gemm
}  // namespace stackfuse
