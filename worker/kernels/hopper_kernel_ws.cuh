// The warp-specialized kernel of the Hopper FMHA example (examples/88_hopper_fmha, CUTLASS 4.2)
// with an epilogue of our own, so that the consumer warpgroups' epilogues run out of turn.
//
// Why: the example's `FmhaKernelTmaWarpSpecialized` means to take the warpgroups' turn order
// around the epilogue only with the `kIsEpilogueLocked` option, but its lines read
// `if constexpr (kIsEpilogueLocked) ; math_wg_order_barrier.wait();` (a stray semicolon), so
// every epilogue waits its turn. The turn order (warpgroup 0, 1, ..., 0, 1, ...) is shared with
// the first `Q K^T` of each tile, so in the persistent kernels warpgroup 0 cannot start its next
// tile before the last warpgroup has finished its epilogue: every tile pays for the epilogues
// (conversion, shared-memory stores, barriers, TMA stores and their wait) with the tensor cores
// idle. With a tile of only two key blocks (B16 S256 at head dim 128) that is a large share of
// the tile; Nsight Compute put 23% of the consumer warps' stall samples in the tail and epilogue
// (commit c3963fa). The turn cannot simply be dropped: CUTLASS's collective epilogue syncs every
// warpgroup on one named barrier (`EpilogueBarrier`), so two epilogues at once would race
// (commit 0208341).
//
// `OwnEpilogue` stores a warpgroup's whole O tile with one TMA store from shared memory of its
// own (in the persistent kernels, unless `EpilogueInQ` stages it in the warpgroup's finished Q
// stage as the non-persistent kernels always do, like the example's epilogue: the head-dim-256
// persistent kernel), syncs on a named barrier of its own, and does not wait for the
// store: the next tile's epilogue waits before it writes the buffer again, and the kernel waits
// once before it exits. No `alpha * acc` (the example's linear combination with alpha 1).
// `WarpSpecializedKernel` derives from the example's kernel (types, Params, shared storage,
// grid: the example's) and replaces only `operator()`, which follows the example's
// (BSD-3-Clause, Copyright (c) 2024 - 2025 NVIDIA CORPORATION & AFFILIATES) line by line except
// for the epilogue's turn, the final wait and one runtime advance of the Q pipeline state in place
// of its per-warpgroup chains of constant ones.
//
// Measured on an H200 (commit 499bb57): the example's ping-pong
// mainloop 2-6% faster with it (B8 S2048 N16 H128 causal 245.4 / 249.2 vs 252.6 / 256.5 us,
// B16 S256 N16 25.0 vs 25.5-25.6, B1 S512 N16 10.9 vs 11.4-11.6), the cooperative head-dim-256
// kernel 0.4-2%. Our overlapped mainloop lost without the turn (up to 18%: B8 S2048 N16 H32
// 308.1 vs 259.9 us), so those kernels keep the example's epilogue in turn (`ExampleEpilogue`).
#pragma once

#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "cutlass/numeric_conversion.h"
#include "collective/fmha_epilogue.hpp"
#include "kernel/fmha_kernel_tma_warpspecialized.hpp"

// Experiments: 1 builds every warp-specialized kernel with the example's epilogue in turn, 2 with
// ours in turn; 0 (default): as the kernel's options say.
#ifndef STACKFUSE_EPILOGUE_IN_TURN
#define STACKFUSE_EPILOGUE_IN_TURN 0
#endif

// A probe, only in objects built with -DSTACKFUSE_TIMELINE=N: %globaltimer stamps
// at each CTA's start and around each consumer warpgroup's tiles, into a buffer the host names
// with stackfuse_timeline_set_N(pointer, CTAs it holds) (benchmarks/timeline_probe.py). Why:
// Nsight Compute gives each SM's active cycles, not when each CTA started and ended, which is
// what tells a late start from an uneven end. N tells the objects of one library apart.
#if defined(STACKFUSE_TIMELINE)
#include <cuda_runtime.h>
#define STACKFUSE_CAT2(a, b) a##b
#define STACKFUSE_CAT(a, b) STACKFUSE_CAT2(a, b)
static __device__ unsigned long long* stackfuse_timeline_buf = nullptr;
static __device__ unsigned stackfuse_timeline_ctas = 0;  // CTAs the buffer holds
extern "C" __attribute__((visibility("default"))) int STACKFUSE_CAT(stackfuse_timeline_set_,
                                                                   STACKFUSE_TIMELINE)(
    void* ptr, unsigned ctas) {
  cudaError_t err = cudaMemcpyToSymbol(stackfuse_timeline_buf, &ptr, sizeof(ptr));
  if (err == cudaSuccess) err = cudaMemcpyToSymbol(stackfuse_timeline_ctas, &ctas, sizeof(ctas));
  return static_cast<int>(err);
}
namespace stackfuse::hopper::timeline {
// per CTA (linear block index): [0] start, [1] SM id, then per consumer warpgroup w at
// 2 + w * kPerWg: [0] tiles, [1] exit, then (begin, end) of up to kTiles tiles
constexpr int kTiles = 20;
constexpr int kPerWg = 2 + 2 * kTiles;
constexpr int kPerCta = 2 + 3 * kPerWg;
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long* cta() {
  if (stackfuse_timeline_buf == nullptr) return nullptr;
  unsigned const b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (b >= stackfuse_timeline_ctas) return nullptr;  // past the buffer: not stamped
  return stackfuse_timeline_buf + size_t(b) * kPerCta;
}
}  // namespace stackfuse::hopper::timeline
#endif

namespace stackfuse {
namespace hopper {

// Option tag: the example's epilogue, in turn. For the overlapped mainloop in the persistent
// kernels: it orders its warpgroups only at a tile's first Q K^T, and the example's epilogues in
// turn are what stagger them at the next tile; out of turn (no stagger) it lost up to 18%, in
// turn with our shorter epilogue 1-7% at the long head-dim-128 launches (commit 499bb57).
struct ExampleEpilogue {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1004);  // not CUTLASS's
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kExampleEpilogue =
    (std::is_same_v<Options, ExampleEpilogue> || ...) || (STACKFUSE_EPILOGUE_IN_TURN == 1);

// Option tag: our epilogue, in turn (the overlapped mainloop's stagger, with our epilogue)
struct OwnEpilogueInTurn {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1007);  // not CUTLASS's
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kEpilogueInTurn = kExampleEpilogue<Options...> ||
                                        (std::is_same_v<Options, OwnEpilogueInTurn> || ...) ||
                                        (STACKFUSE_EPILOGUE_IN_TURN == 2);

// Option tag (persistent kernels, our epilogue): O staged in the warpgroup's own Q stage, which is
// released to the Q warp only once the TMA store has read it, instead of a buffer of its own:
// 32 KB freed at head dim 128 for a sixth K/V stage or a second Q stage (0.89-0.98x, not kept
// there: commit 0a43dd9), 64 KB at head dim 256 for five K/V stages instead of three (c866e95)
struct EpilogueInQ {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1006);  // not CUTLASS's
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kEpilogueInQ = (std::is_same_v<Options, EpilogueInQ> || ...);

// Rows of a consumer warpgroup's tile: the unit in which `row_shift` moves query blocks
inline constexpr int kShiftGranule = 64;

// Rows before row 0 in the first query block when blocks of kBlock rows end within a warpgroup
// tile of row seq_q (the `ShiftRows` option, StackfuseMask in hopper_fmha.cuh): the rows the
// last block would leave empty, in whole warpgroup tiles; kBlock 0: blocks start at row 0
template <int kBlock>
CUTLASS_HOST_DEVICE int row_shift(int seq_q) {
  if constexpr (kBlock > 0) {
    int const empty = (kBlock - seq_q % kBlock) % kBlock;
    return empty / kShiftGranule * kShiftGranule;
  } else {
    return 0;
  }
}

// A consumer warpgroup's epilogue: LSE as the example's (`FmhaFwdEpilogue`), O in one TMA store.
// kShiftBlock > 0: the mask's `ShiftRows` (hopper_fmha.cuh, StackfuseMask): the warpgroup's rows
// start row_shift(Sq) rows earlier; those before row 0 are not stored.
template <class Element, class ElementAccumulator, class TileShapePV, bool kInQ = false,
          int kShiftBlock = 0>
struct OwnEpilogue {
  static constexpr int kM = cute::get<0>(TileShapePV{});  // rows of a warpgroup
  static constexpr int kD = cute::get<1>(TileShapePV{});  // head dim (the tile's)
  static_assert(kShiftBlock == 0 || kM == kShiftGranule, "row_shift moves whole tiles");
  using StrideO = cute::tuple<int, cute::_1, cute::tuple<int, int>>;
  using StrideLSE = cute::tuple<cute::_1, cute::tuple<int, int>>;
  static constexpr int kRowBytes = kD * int(sizeof(Element));
  using SmemLayoutAtomO = std::conditional_t<
      kRowBytes % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kRowBytes % 64 == 0, cute::GMMA::Layout_K_SW64_Atom<Element>,
                         cute::GMMA::Layout_K_SW32_Atom<Element>>>;
  using TileO = cute::Shape<cute::Int<kM>, cute::Int<kD>>;
  using SmemLayoutO = decltype(cute::tile_to_shape(SmemLayoutAtomO{}, TileO{}));

  template <class ProblemShape>
  CUTLASS_HOST_DEVICE static auto shape_o(ProblemShape const& ps) {  // (Sq, D, (mode 0, mode 1))
    return cute::make_shape(int(cute::get<2>(ps)), int(cute::get<4>(ps)),
                            cute::make_shape(int(cute::get<0>(ps)), int(cute::get<1>(ps))));
  }
  static auto make_tma(Element* ptr, cute::tuple<int, int, cute::tuple<int, int>> const& shape,
                       StrideO const& stride) {
    return cute::make_tma_copy(cute::SM90_TMA_STORE{},
                               cute::make_tensor(cute::make_gmem_ptr(ptr), shape, stride),
                               SmemLayoutO{}, TileO{}, cute::_1{});
  }
  using TmaStoreO = decltype(make_tma(nullptr, {}, {}));

  struct Arguments {
    Element* ptr_O;
    StrideO dO;
    ElementAccumulator* ptr_LSE;
    StrideLSE dLSE;
  };
  struct Params {
    ElementAccumulator* ptr_LSE;
    StrideLSE dLSE;
    TmaStoreO tma_store_o;
  };
  struct Buffer {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutO>, 1024> smem_o;
  };
  struct NoBuffer {};  // kInQ: the kernel hands over the warpgroup's Q stage
  using TensorStorage = std::conditional_t<kInQ, NoBuffer, Buffer>;
  static constexpr int kBufferBytes = int(sizeof(Element)) * int(cute::cosize_v<SmemLayoutO>);
  // The kernel builds an epilogue load pipeline (for C, which we do not read): the smallest one.
  using LoadPipeline = cutlass::PipelineTransactionAsync<1>;
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  static constexpr int TmaTransactionBytes = 0;

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& ps, Arguments const& args,
                                        void* = nullptr) {
    return Params{args.ptr_LSE, args.dLSE, make_tma(args.ptr_O, shape_o(ps), args.dO)};
  }

  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma,
            class ProblemShape>
  CUTLASS_DEVICE void operator()(TileShape const& tile_shape, BlkCoord const& blk_coord,
                                 ResultTuple const& result, TiledMma const& tiled_mma,
                                 ProblemShape const& problem_size, Params const& params,
                                 LoadPipeline, TensorStorage& storage) {
    static_assert(!kInQ, "the kernel calls store() with the Q stage");
    store(tile_shape, blk_coord, result, tiled_mma, problem_size, params,
          storage.smem_o.data());
  }

  // O through `smem` (kBufferBytes, 1024-aligned, not read by anyone until the store has read
  // it: the leader thread's tma_store_wait says when)
  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma,
            class ProblemShape>
  CUTLASS_DEVICE void store(TileShape const& tile_shape, BlkCoord const& blk_coord,
                            ResultTuple const& result, TiledMma const& tiled_mma,
                            ProblemShape const& problem_size, Params const& params,
                            Element* smem) {
    using namespace cute;
    using X = Underscore;
    auto const& acc = get<0>(result);
    auto const& lse = get<1>(result);

    // LSE: the example's code
    auto thr_mma = tiled_mma.get_thread_slice(threadIdx.x);
    int seqlen_q = get<2>(problem_size);
    int num_batch = get<0>(problem_size);
    int num_heads = get<1>(problem_size);
    Tensor mLSE = make_tensor(
        make_gmem_ptr(params.ptr_LSE),
        make_shape(seqlen_q, get<1>(tile_shape), make_shape(num_batch, num_heads)),
        make_stride(_1{}, _0{}, get<1>(params.dLSE)));
    Tensor gLSE_full = local_tile(mLSE, tile_shape, make_coord(_, _, _), Step<_1, _1, X>{});
    Tensor gLSE = gLSE_full(_, _, get<0>(blk_coord), get<1>(blk_coord), get<2>(blk_coord));
    int const shift = row_shift<kShiftBlock>(seqlen_q);
    if constexpr (kShiftBlock > 0) gLSE.data() = gLSE.data() + (-shift);
    Tensor tOgLSE = thr_mma.partition_C(gLSE);
    Tensor cO = make_identity_tensor(take<0, 2>(tile_shape));
    Tensor tOcO = thr_mma.partition_C(cO);
    if (get<1>(tOcO(_0{})) == 0) {
      using cutlass::fmha::collective::layout_acc_mn;
      auto tOgLSE_mn = make_tensor(tOgLSE.data(), layout_acc_mn(tiled_mma, tOgLSE.layout()));
      auto tOcO_mn = make_tensor(tOcO.data(), layout_acc_mn(tiled_mma, tOcO.layout()));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size<0>(tOgLSE_mn); i++) {
        int const row = get<0>(tOcO_mn(i)) + get<0>(blk_coord) * get<0>(tile_shape) - shift;
        if (row < seqlen_q && (kShiftBlock == 0 || row >= 0)) {
          tOgLSE_mn(i, _0{}) = lse(i);
        }
      }
    }

    // O: registers -> Element -> shared memory (stmatrix) -> one TMA store, which clips rows
    // past Sq and columns past the head dim
    constexpr int kValues = decltype(size(acc))::value;
    Tensor tOrO = make_tensor_like<Element>(acc);
    cutlass::NumericArrayConverter<Element, ElementAccumulator, kValues> convert;
    *reinterpret_cast<cutlass::Array<Element, kValues>*>(raw_pointer_cast(tOrO.data())) =
        convert(*reinterpret_cast<cutlass::Array<ElementAccumulator, kValues> const*>(
            raw_pointer_cast(acc.data())));

    int const thread_idx = threadIdx.x % cutlass::NumThreadsPerWarpGroup;
    // a named barrier per warpgroup: user id = warpgroup index 1-3 (hardware ids 9-11, after
    // CUTLASS's reserved ones; nothing else in these kernels uses named barriers)
    int const barrier = cutlass::canonical_warp_group_idx();
    bool const leader = thread_idx == 0;
    Tensor sO = make_tensor(make_smem_ptr(smem), SmemLayoutO{});
    auto tiled_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma);
    auto thr_copy = tiled_copy.get_thread_slice(thread_idx);
    Tensor tRs = thr_copy.retile_S(tOrO);
    Tensor tSs = thr_copy.partition_D(sO);

    if (leader) tma_store_wait<0>();  // the previous tile's store has read the buffer
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
    copy(tiled_copy, tRs, tSs);
    cutlass::arch::fence_view_async_shared();  // visible to the TMA unit
    cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, barrier);
    if (leader) {
      Tensor mO = params.tma_store_o.get_tma_tensor(shape_o(problem_size));
      // shifted rows: the warpgroup's tile moves back by whole tiles; one wholly before row 0
      // stores nothing (a TMA store with a negative coordinate is an illegal instruction)
      int const tile = int(get<0>(blk_coord)) - shift / kShiftGranule;
      Tensor gO = local_tile(mO(_, _, get<2>(blk_coord)), TileO{}, make_coord(tile, _0{}));
      auto cta_tma = params.tma_store_o.get_slice(_0{});
      if (kShiftBlock == 0 || tile >= 0) {
        copy(params.tma_store_o, cta_tma.partition_S(sO), cta_tma.partition_D(gO));
        tma_store_arrive();
      }
    }
  }
};

// Before the CTA exits, its last stores must have read shared memory: ours leaves them in
// flight; the example's epilogue waits for its own.
template <class Epilogue>
CUTLASS_DEVICE void finish_stores(Epilogue const*) {}
template <class Element, class ElementAccumulator, class TileShapePV, bool kInQ, int kShiftBlock>
CUTLASS_DEVICE void finish_stores(
    OwnEpilogue<Element, ElementAccumulator, TileShapePV, kInQ, kShiftBlock> const*) {
  cute::tma_store_wait<0>();
}

// The warp-specialized kernels' epilogue: ours, or the example's (ExampleEpilogue), which cannot
// store shifted rows (kShiftBlock > 0)
template <class Element, class TileShapePV, int kShiftBlock, class... Options>
struct WarpSpecializedEpilogueOf {
  static_assert(kShiftBlock == 0 || !kExampleEpilogue<Options...>,
                "ShiftRows needs our epilogue, not the example's");
  using type = std::conditional_t<
      kExampleEpilogue<Options...>,
      cutlass::fmha::collective::FmhaFwdEpilogue<Element, float, TileShapePV>,
      OwnEpilogue<Element, float, TileShapePV, kEpilogueInQ<Options...>, kShiftBlock>>;
};
template <class Element, class TileShapePV, int kShiftBlock, class... Options>
using WarpSpecializedEpilogue =
    typename WarpSpecializedEpilogueOf<Element, TileShapePV, kShiftBlock, Options...>::type;

template <class CollectiveMainloop, class CollectiveEpilogue, class TileScheduler,
          class... Options>
struct WarpSpecializedKernel
    : cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<CollectiveMainloop, CollectiveEpilogue,
                                                          TileScheduler, Options...> {
  using Base = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
      CollectiveMainloop, CollectiveEpilogue, TileScheduler, Options...>;
  using typename Base::ClusterShape;
  using typename Base::MainloopPipelineInner;
  using typename Base::MainloopPipelineOuter;
  using typename Base::MainloopPipelineReducer;
  using typename Base::MathWarpGroupOrderBarrier;
  using typename Base::Params;
  using typename Base::PipelineParamsInner;
  using typename Base::PipelineParamsOuter;
  using typename Base::PipelineParamsReducer;
  using typename Base::PipelineStateInner;
  using typename Base::PipelineStateOuter;
  using typename Base::PipelineStateReducer;
  using typename Base::SharedStorage;
  static constexpr int NumMmaWarpGroups = Base::NumMmaWarpGroups;
  static constexpr bool kLoadsQSeparately = Base::kLoadsQSeparately;
  static constexpr bool kEpilogueInTurn =
      Base::kIsEpilogueLocked || stackfuse::hopper::kEpilogueInTurn<Options...>;
  static_assert(Base::SharedStorageSize <= 227 * 1024, "shared storage above the H200's 227 KB");
  static constexpr bool kOInQ = kEpilogueInQ<Options...>;
  static_assert(!kOInQ || (CollectiveMainloop::kIsPersistent && !kExampleEpilogue<Options...>),
                "O in the Q stage: the persistent kernels with our epilogue");
  static_assert(!kOInQ || size(ClusterShape{}) == 1, "O in the Q stage: no cluster");

  CUTLASS_DEVICE void operator()(const Params& params, char* smem) {
#if defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
    using namespace cute;
    enum class WarpGroupRole { Producer = 0, Consumer0 = 1, Consumer1 = 2, Consumer2 = 3 };
    enum class ProducerWarpRole { Reducer = 0, LoadKV = 1, MaybeLoadQ = 2, MainloopEpilogue = 3 };
    static_assert(NumMmaWarpGroups <= 3);
    static constexpr ProducerWarpRole WarpRoleLoadQ =
        kLoadsQSeparately ? ProducerWarpRole::MaybeLoadQ : ProducerWarpRole::LoadKV;

#if defined(STACKFUSE_TIMELINE)
    if (threadIdx.x == 0) {
      if (auto* t = timeline::cta()) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        t[0] = timeline::now();
        t[1] = smid;
      }
    }
#endif
    TileScheduler tile_scheduler{params.tile_scheduler};
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);

    int warp_idx = cutlass::canonical_warp_idx_sync();
    int warp_idx_in_warp_group = warp_idx % cutlass::NumWarpsPerWarpGroup;
    int warp_group_idx = cutlass::canonical_warp_group_idx();
    auto warp_group_role = WarpGroupRole(warp_group_idx);
    auto producer_warp_role = ProducerWarpRole(warp_idx_in_warp_group);
    int consumer_warp_group_idx = warp_group_idx - (int)WarpGroupRole::Consumer0;
    int lane_predicate = cute::elect_one_sync();
    uint32_t block_rank_in_cluster = cute::block_rank_in_cluster();
    bool const is_consumer = warp_group_role != WarpGroupRole::Producer;

    if ((warp_idx == 0) && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
    }

    PipelineParamsOuter pipeline_params_outer;
    pipeline_params_outer.transaction_bytes = CollectiveMainloop::kOuterLoadBytes;
    pipeline_params_outer.is_leader = lane_predicate && (producer_warp_role == WarpRoleLoadQ);
    // with O in the Q stage, a stage is free once its warpgroup released it (128 arrivals) and
    // the epilogue's store has read it (one more, the storing thread's)
    pipeline_params_outer.num_consumers = cutlass::NumThreadsPerWarpGroup + (kOInQ ? 1 : 0);

    PipelineParamsInner pipeline_params_inner;
    pipeline_params_inner.transaction_bytes = CollectiveMainloop::kInnerLoadBytes;
    pipeline_params_inner.is_leader =
        lane_predicate && (producer_warp_role == ProducerWarpRole::LoadKV);
    pipeline_params_inner.num_consumers = NumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;

    PipelineParamsReducer pipeline_params_reducer;
    pipeline_params_reducer.producer_arv_count = NumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
    pipeline_params_reducer.consumer_arv_count = cutlass::NumThreadsPerWarp;

    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    typename EpiLoadPipeline::Params epi_load_pipeline_params;

    if (!is_consumer) {
      if (producer_warp_role == ProducerWarpRole::MainloopEpilogue) {
        epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Producer;
      }
      if (producer_warp_role == ProducerWarpRole::LoadKV) {
        pipeline_params_inner.role = MainloopPipelineInner::ThreadCategory::Producer;
      }
      if (producer_warp_role == WarpRoleLoadQ) {
        pipeline_params_outer.role = MainloopPipelineOuter::ThreadCategory::Producer;
      }
      if (producer_warp_role == ProducerWarpRole::Reducer) {
        pipeline_params_reducer.role = MainloopPipelineReducer::ThreadCategory::Consumer;
      }
    } else {
      pipeline_params_inner.role = MainloopPipelineInner::ThreadCategory::Consumer;
      pipeline_params_outer.role = MainloopPipelineOuter::ThreadCategory::Consumer;
      pipeline_params_reducer.role = MainloopPipelineReducer::ThreadCategory::Producer;
      epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    }

    // Q is the CTA's own, but a pipeline built for a 1x1x1 cluster (the example's) releases its
    // stages to the cluster's CTA 0: in a cluster of two the second CTA's releases landed on the
    // first's barrier and its Q warp waited forever once it took a second tile (commit
    // f6e81bd). Built for the kernel's cluster, each consumer warpgroup releases its Q stage to
    // every CTA of the cluster and each barrier counts all of them. Our kernels are 1x1x1 (TMA
    // multicast in pairs was no faster: 0.90-1.01x, f6e81bd); this and the tail below keep
    // the kernel right for any cluster shape.
    MainloopPipelineOuter pipeline_outer(storage.pipeline_storage_outer, pipeline_params_outer,
                                         ClusterShape{});
    MainloopPipelineInner pipeline_inner(storage.pipeline_storage_inner, pipeline_params_inner,
                                         ClusterShape{});
    MainloopPipelineReducer pipeline_reducer(storage.pipeline_storage_reducer,
                                             pipeline_params_reducer);

    PipelineStateInner smem_pipe_read_inner;
    PipelineStateInner smem_pipe_write_inner =
        cutlass::make_producer_start_state<MainloopPipelineInner>();
    PipelineStateOuter smem_pipe_read_outer;
    PipelineStateOuter smem_pipe_write_outer =
        cutlass::make_producer_start_state<MainloopPipelineOuter>();
    PipelineStateReducer smem_pipe_read_reducer;
    PipelineStateReducer smem_pipe_write_reducer =
        cutlass::make_producer_start_state<MainloopPipelineReducer>();

    typename MathWarpGroupOrderBarrier::Params params_math_wg_order_barrier;
    params_math_wg_order_barrier.group_id = consumer_warp_group_idx;
    params_math_wg_order_barrier.group_size = cutlass::NumThreadsPerWarpGroup;
    MathWarpGroupOrderBarrier math_wg_order_barrier(storage.math_wg_order,
                                                    params_math_wg_order_barrier);

    epi_load_pipeline_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_pipeline_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_pipeline_params.consumer_arv_count = cutlass::NumThreadsPerWarpGroup;
    epi_load_pipeline_params.transaction_bytes = CollectiveEpilogue::TmaTransactionBytes;
    EpiLoadPipeline epi_load_pipeline(storage.epi_load, epi_load_pipeline_params);

    if constexpr (kLoadsQSeparately) {
      if ((warp_idx == 0) && lane_predicate) {
        storage.load_warp_barrier.init(2 * cutlass::NumThreadsPerWarp);
      }
      cutlass::arch::fence_barrier_init();
    }

    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    CollectiveMainloop collective_mainloop;

    if (!is_consumer) {
      cutlass::arch::warpgroup_reg_dealloc<Base::LoadRegisterRequirement>();
      if (producer_warp_role == ProducerWarpRole::LoadKV) {
        bool do_barrier = kLoadsQSeparately;
        CUTLASS_PRAGMA_NO_UNROLL
        for (; tile_scheduler.is_valid(); ++tile_scheduler) {
          auto blk_coord = tile_scheduler.get_block_coord();
          collective_mainloop.template load_kv_maybe_q<!kLoadsQSeparately>(
              block_rank_in_cluster, blk_coord, params.mainloop, params.problem_size,
              pipeline_inner, smem_pipe_write_inner, pipeline_outer, smem_pipe_write_outer,
              storage.tensors.mainloop, storage.load_warp_barrier, do_barrier);
          do_barrier = false;
        }
        // In a cluster the other CTA's consumers release our stages too (its multicast loads
        // wrote them): wait for every stage's last release before this CTA may exit
        if constexpr (size(ClusterShape{}) > 1) {
          if (lane_predicate) pipeline_inner.producer_tail(smem_pipe_write_inner);
        }
      } else if (kLoadsQSeparately && (producer_warp_role == ProducerWarpRole::MaybeLoadQ)) {
        bool do_barrier = true;
        CUTLASS_PRAGMA_NO_UNROLL
        for (; tile_scheduler.is_valid(); ++tile_scheduler) {
          auto blk_coord = tile_scheduler.get_block_coord();
          collective_mainloop.load_maybe_q(blk_coord, params.mainloop, params.problem_size,
                                           pipeline_outer, smem_pipe_write_outer,
                                           storage.tensors.mainloop, storage.load_warp_barrier,
                                           do_barrier);
          do_barrier = false;
        }
      } else if (producer_warp_role == ProducerWarpRole::Reducer) {
        for (; tile_scheduler.is_valid(); ++tile_scheduler) {
          auto blk_coord = tile_scheduler.get_block_coord();
          collective_mainloop.reduce(blk_coord, params.mainloop, params.problem_size,
                                     pipeline_reducer, smem_pipe_read_reducer,
                                     storage.tensors.mainloop);
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Base::MmaRegisterRequirement>();
      constexpr int kOuterLoads = CollectiveMainloop::kOuterLoads;
#if defined(STACKFUSE_TIMELINE)
      unsigned long long* stamps = nullptr;
      if (threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0 && timeline::cta() != nullptr) {
        stamps = timeline::cta() + 2 + consumer_warp_group_idx * timeline::kPerWg;
      }
      int tiles_done = 0;
#endif
      CUTLASS_PRAGMA_NO_UNROLL
      for (; tile_scheduler.is_valid(); ++tile_scheduler) {
#if defined(STACKFUSE_TIMELINE)
        if (stamps != nullptr && tiles_done < timeline::kTiles) {
          stamps[2 + 2 * tiles_done] = timeline::now();
        }
#endif
        auto blk_coord = tile_scheduler.get_block_coord();
        auto wg_coord = blk_coord;

        // this warpgroup's Q stage, and its query block within the CTA's tile
        smem_pipe_read_outer.advance(consumer_warp_group_idx * kOuterLoads);
        PipelineStateOuter const q_state = smem_pipe_read_outer;  // this tile's Q stage
        constexpr int wg_dim = is_constant<0, decltype(get<1>(wg_coord))>::value ? 0 : 1;
        auto& wg_block = get<wg_dim>(wg_coord);
        wg_block = NumMmaWarpGroups * wg_block + consumer_warp_group_idx;

        auto result = collective_mainloop.compute(
            blk_coord, wg_coord, params.mainloop, params.problem_size, pipeline_inner,
            smem_pipe_read_inner, pipeline_outer, smem_pipe_read_outer, pipeline_reducer,
            smem_pipe_write_reducer, storage.tensors.mainloop, math_wg_order_barrier);

        smem_pipe_read_outer.advance(kOuterLoads * (NumMmaWarpGroups - consumer_warp_group_idx));

        if constexpr (kEpilogueInTurn) math_wg_order_barrier.wait();
        CollectiveEpilogue epilogue;
        if constexpr (kOInQ) {
          using ElementQ = typename CollectiveMainloop::Element;
          constexpr int kStageElems = CollectiveMainloop::kOuterLoadBytes / int(sizeof(ElementQ));
          static_assert(CollectiveEpilogue::kBufferBytes <= CollectiveMainloop::kOuterLoadBytes);
          static_assert(kStageElems * int(sizeof(ElementQ)) % 1024 == 0);
          ElementQ* q_stage =
              storage.tensors.mainloop.smem_q.data() + q_state.index() * kStageElems;
          epilogue.store(typename CollectiveMainloop::TileShapePV{}, wg_coord, result,
                         typename CollectiveMainloop::TiledMmaPV{}, params.problem_size,
                         params.epilogue, q_stage);
          // the storing thread: once its store has read the stage, hand the stage to the Q warp
          if (threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0) {
            tma_store_wait<0>();
            pipeline_outer.consumer_release(q_state);
          }
        } else {
          epilogue(typename CollectiveMainloop::TileShapePV{}, wg_coord, result,
                   typename CollectiveMainloop::TiledMmaPV{}, params.problem_size,
                   params.epilogue, epi_load_pipeline,
                   storage.tensors.epilogue[consumer_warp_group_idx]);
        }
        if constexpr (kEpilogueInTurn) math_wg_order_barrier.arrive();
#if defined(STACKFUSE_TIMELINE)
        if (stamps != nullptr && tiles_done < timeline::kTiles) {
          stamps[3 + 2 * tiles_done] = timeline::now();
        }
        ++tiles_done;
#endif
      }
      finish_stores(static_cast<CollectiveEpilogue const*>(nullptr));
#if defined(STACKFUSE_TIMELINE)
      if (stamps != nullptr) {
        stamps[0] = tiles_done;
        stamps[1] = timeline::now();
      }
#endif
    }
#endif
  }
};

}  // namespace hopper
}  // namespace stackfuse
