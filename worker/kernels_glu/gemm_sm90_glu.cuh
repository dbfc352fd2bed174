// SwiGLU as one Hopper GEMM: the gate and up projections' weights interleaved in blocks of 8
// rows (Wgu row 16j + i is Wg row 8j + i for i < 8, Wu row 8j + i - 8 for 8 <= i < 16), one
// GEMM of N = 2I columns, and an epilogue that pairs each gate column with its up column in
// registers and writes only D[m, i] = silu(gate) * up, D [L, M, I] compact (I = N / 2).
//
// The epilogue is a register-to-global one modelled on CUTLASS's DefaultEpilogue
// (cutlass/epilogue/collective/default_epilogue.hpp), wrapped in Sm90TmaWarpSpecializedAdapter
// as the sm90 collective builder does for the NoSmemWarpSpecialized schedule: no shared memory,
// so the mainloop keeps all of it. Why the pairing needs no data movement: a GMMA accumulator
// fragment is ((2,2,N/8), MMA_M, MMA_N) per thread, i.e. for every 8-column block a thread
// holds 2 adjacent columns of 2 rows, at the same column offset (2 * (lane % 4)) in every block.
// Tile column n (n % 16 < 8) and its partner n + 8 are blocks v and v + 1 of the same thread.
//
// This header lives outside worker/kernels on purpose: the kernel cache keys every object by a
// digest of worker/kernels, and only the paired configuration and its glue include this one
// (their generated source carries this directory's digest instead).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/memory.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/numeric_conversion.h"

#include "gemm_sm90.cuh"

namespace stackfuse {
namespace gemm {

// The Act of the paired configuration: D = silu(acc[:, gate cols]) * acc[:, up cols].
template <class T>
struct SwiGluPaired {};

// the value of a static integer (cute::Int) as a constant expression
template <class IntT>
constexpr int static_value(IntT) {
  return IntT::value;
}

// What launch<> fills in for an ungated configuration: alpha, beta and a bias. The paired
// epilogue takes none of them (can_implement refuses a bias, a beta or a C).
struct PairedUnusedThreadArgs {
  float alpha = 1.0f;
  float beta = 0.0f;
  void const* bias_ptr = nullptr;
};

template <class ElementD_>
class SwiGluPairedEpilogue {
 public:
  using EpilogueSchedule = cutlass::gemm::EpilogueDefault;
  using DispatchPolicy = EpilogueSchedule;
  using ThreadEpilogueOp = PairedUnusedThreadArgs;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = void;
  using ElementD = ElementD_;
  using ElementOutput = ElementD_;
  using StrideC = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>;
  using StrideD = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  // dD is ignored: D's row stride is I = N / 2, derived from the problem shape (launch<> fills
  // dD for N columns, the GEMM's width)
  struct Arguments {
    ThreadEpilogueOp thread{};
    void const* ptr_C = nullptr;
    StrideC dC{};
    ElementD* ptr_D = nullptr;
    StrideD dD{};
  };

  struct Params {
    ElementD* ptr_D = nullptr;
    int64_t ld_d = 0;     // I
    int64_t batch_d = 0;  // M * I
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape,
                                                  Arguments const& args, void*) {
    auto shape = cute::append<4>(problem_shape, 1);
    int64_t const m = cute::get<0>(shape);
    int64_t const i = cute::get<1>(shape) / 2;
    return Params{args.ptr_D, i, m * i};
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto shape = cute::append<4>(problem_shape, 1);
    // N = 2I with I a multiple of 8: whole 16-column (gate, up) groups, 16-byte output rows
    return cute::get<1>(shape) % 16 == 0 && args.ptr_C == nullptr &&
           args.thread.bias_ptr == nullptr && args.thread.beta == 0.0f &&
           args.ptr_D != nullptr;
  }

  CUTLASS_HOST_DEVICE
  SwiGluPairedEpilogue(Params const& params_, SharedStorage const& = SharedStorage())
      : params(params_) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // D's column of the pair whose gate is GEMM column n (n % 16 < 8; its up is n + 8)
  CUTLASS_HOST_DEVICE static int output_column(int n) { return (n >> 4) * 8 + (n & 7); }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(rank(ProblemShapeMNKL{}) == 4, "ProblemShapeMNKL must be rank 4");
    static_assert(is_static<BlockShapeMNK>::value, "the CTA tile must be static");
    static_assert(is_static<FrgLayout>::value, "the accumulator layout must be static");

    // The layout assumption, checked on the MMA atom's own C layout (thread, value) -> m + 64 n
    // (CUTE's CLayout_64xN): values (2, 2, N/8) step n by 1, m by 8 and n by 8; the thread
    // modes (4, 8, 4) step n by 2 (so every thread starts at column 0, 2, 4 or 6 of a block),
    // m by 1 and m by 16.
    using CL = typename TiledMma::Atom::LayoutC_TV;
    static_assert(static_value(size<0, 0>(CL{})) == 4 && static_value(stride<0, 0>(CL{})) == 128 &&
                      static_value(stride<0, 1>(CL{})) == 1 &&
                      static_value(stride<0, 2>(CL{})) == 16,
                  "a GMMA accumulator's threads start at columns 0, 2, 4, 6 of an 8-column block");
    static_assert(static_value(size<1, 0>(CL{})) == 2 && static_value(stride<1, 0>(CL{})) == 64 &&
                      static_value(size<1, 1>(CL{})) == 2 && static_value(stride<1, 1>(CL{})) == 8 &&
                      static_value(stride<1, 2>(CL{})) == 512,
                  "a GMMA accumulator holds (2 columns, 2 rows) per 8-column block");
    static_assert(static_value(size<1, 2>(CL{})) % 2 == 0,
                  "the MMA atom's N must hold whole (gate, up) pairs of 8-column blocks");
    static_assert(static_value(size<1>(BlockShapeMNK{})) % 16 == 0,
                  "the CTA tile's N must be a multiple of 16");
    // the fragment is ((2, 2, N/8), MMA_M, MMA_N) of those values
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3,
                  "unexpected accumulator fragment");
    static_assert(static_value(size<0, 0>(FrgLayout{})) == 2 &&
                      static_value(size<0, 1>(FrgLayout{})) == 2 &&
                      static_value(size<0, 2>(FrgLayout{})) == static_value(size<1, 2>(CL{})),
                  "the fragment's first mode is not the atom's (2, 2, N/8) values");

    auto M = get<0>(problem_shape_mnkl);
    auto N = get<1>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;

    // each accumulator's (m, n) in the GEMM's M x 2I problem, as DefaultEpilogue finds them
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));  // (BLK_M, BLK_N)
    Tensor tCcD = thr_mma.partition_C(cD);                 // ((2, 2, V), MMA_M, MMA_N)
    CUTE_STATIC_ASSERT_V(size(tCcD) == size(accumulators));

    ElementD* d = params.ptr_D + static_cast<int64_t>(l_coord) * params.batch_d;
    int const rows = static_cast<int>(M);
    int const cols = static_cast<int>(N);
    using Out = cutlass::Array<ElementD, 2>;
    cutlass::NumericConverter<ElementD, float, cutlass::FloatRoundStyle::round_to_nearest> cvt;
    cutlass::epilogue::thread::SiLu<float> silu;

    CUTLASS_PRAGMA_UNROLL
    for (int mn = 0; mn < size<2>(accumulators); ++mn) {
      CUTLASS_PRAGMA_UNROLL
      for (int mm = 0; mm < size<1>(accumulators); ++mm) {
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < size<0, 2>(accumulators); v += 2) {
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            auto gate0 = make_coord(make_coord(0, r, v), mm, mn);
            auto gate1 = make_coord(make_coord(1, r, v), mm, mn);
            auto up0 = make_coord(make_coord(0, r, v + 1), mm, mn);
            auto up1 = make_coord(make_coord(1, r, v + 1), mm, mn);
            int const m = get<0>(tCcD(gate0));
            int const n = get<1>(tCcD(gate0));  // n % 16 < 8: a gate column; n + 8: its up
            Out out;
            out[0] = cvt(silu(accumulators(gate0)) * accumulators(up0));
            out[1] = cvt(silu(accumulators(gate1)) * accumulators(up1));
            // even (n is): both columns of the pair are in range together
            int const o = output_column(n);
            bool const pred = m < rows && n < cols;
            cutlass::arch::global_store<Out, sizeof(Out)>(
                out, d + static_cast<int64_t>(m) * params.ld_d + o, pred);
          }
        }
      }
    }
  }

 private:
  Params params;
};

// The paired configuration: the mainloop of the other configurations, this epilogue; it reads
// no C (HasC must be false) and gives the mainloop all the shared memory.
template <class Element, bool BKMajor, int TileM, int TileN, int TileK, int ClusterM,
          int ClusterN, class Schedule, class Scheduler, bool HasC>
struct Config<Element, BKMajor, TileM, TileN, TileK, ClusterM, ClusterN, Schedule, Scheduler,
              SwiGluPaired, HasC> {
  static_assert(!HasC, "the paired SwiGLU configuration reads no C");
  static constexpr bool kHasC = false;
  static constexpr bool kGate = false;
  static constexpr bool kPaired = true;
  using ElementA = Element;
  using ElementB = Element;
  using ElementC = void;
  using ElementD = Element;
  using Accumulator = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB =
      cute::conditional_t<BKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;

  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;

  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
      SwiGluPairedEpilogue<Element>>;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB,
      LayoutB, kAlign, Accumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<0>, typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace gemm
}  // namespace stackfuse
