// Two CTAs per cluster sharing their K/V loads: TMA multicast for the Hopper FMHA example's
// warp-specialized mainloop (examples/88_hopper_fmha, CUTLASS 4.2).
//
// Why: two neighbouring query blocks of one head read the same K and V tiles. Paired in a
// cluster of two, each CTA loads half of every K/V tile and multicasts it to both, so L2 serves
// each tile once per pair instead of once per CTA. FlashAttention-3 does this for head dims
// >= 128 without a mask (ClusterM = 2 when the query blocks pair up). The example has the
// multicast code paths already (its loads take a multicast mask, its pipeline a cluster shape)
// but fixes its cluster to 1 x 1 x 1; `ClusterPairMainloop` rebuilds the K/V copies for a
// 2 x 1 x 1 cluster and keeps the rest (Q loads, shared storage, `compute`) of the mainloop it
// wraps. Its load function is the example's `load_kv_maybe_q` (BSD-3-Clause, Copyright (c)
// 2024 - 2025 NVIDIA CORPORATION & AFFILIATES) with the multicast copies.
//
// Both CTAs of a pair must walk the same key tiles in step (each waits for the other's half of
// every tile, and releases a stage to both), so only masks that give paired blocks the same
// trip count are allowed: none (keys past Sk are masked alike). `ClusterPairScheduler` hands
// out pairs of query blocks; with an odd count the last pair's second block lies past Sq, loads
// zeros (TMA fills out-of-bounds boxes) and stores nothing (TMA clips; the LSE store checks rows).
#pragma once

#include <type_traits>

#include <cuda_runtime.h>

#include "collective/fmha_collective_tma_warpspecialized.hpp"
#include "cutlass/fast_math.h"
#include "cutlass/kernel_hardware_info.h"

namespace stackfuse {
namespace hopper {

// Option tag: a cluster of two CTAs (neighbouring query blocks) sharing K/V by TMA multicast
struct ClusterPair {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1005);  // not CUTLASS's
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kClusterPair = (std::is_same_v<Options, ClusterPair> || ...);

template <class Base, class Fusion>
struct ClusterPairMainloop : Base {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using typename Base::Element;
  using typename Base::MainloopPipeline;
  using typename Base::MainloopPipelineQ;
  using typename Base::PipelineState;
  using typename Base::PipelineStateQ;
  using typename Base::SharedStorage;
  using typename Base::SmemLayoutK;
  using typename Base::SmemLayoutV;
  using typename Base::TileShape;
  using typename Base::TileShapePV;
  using typename Base::TileShapeQK;
  static constexpr int NumMmaWarpGroups = Base::NumMmaWarpGroups;

  // the example's K and V copies, built for the cluster: the builder picks
  // SM90_TMA_LOAD_MULTICAST for B when the cluster's M extent is above 1
  using CollectiveMmaQK = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename Base::LayoutQ,
      Base::Alignment, Element, typename Base::LayoutK, Base::Alignment,
      typename Base::ElementAccumulatorQK, TileShapeQK, ClusterShape, typename Base::Stages,
      cutlass::gemm::KernelTmaWarpSpecialized>::CollectiveOp;
  using CollectiveMmaPV = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename Base::LayoutK,
      Base::Alignment, Element, decltype(cute::select<1, 0, 2>(typename Base::LayoutV{})),
      Base::Alignment, typename Base::ElementAccumulatorPV, TileShapePV, ClusterShape,
      typename Base::Stages, cutlass::gemm::KernelTmaWarpSpecialized>::CollectiveOp;
  static_assert(std::is_same_v<typename CollectiveMmaQK::GmemTiledCopyB,
                               cute::SM90_TMA_LOAD_MULTICAST>);
  static_assert(std::is_same_v<typename CollectiveMmaQK::SmemLayoutB, SmemLayoutK>,
                "the cluster's K tiles keep the mainloop's shared-memory layout");
  static_assert(std::is_same_v<typename CollectiveMmaPV::SmemLayoutB, SmemLayoutV>,
                "the cluster's V tiles keep the mainloop's shared-memory layout");

  using TMA_K = typename CollectiveMmaQK::Params::TMA_B;
  using TMA_V = typename CollectiveMmaPV::Params::TMA_B;

  // the wrapped mainloop's parameters (Q's copy and the softmax scales used from there; its
  // K/V copies unused) and the multicast copies
  struct Params : Base::Params {
    TMA_K tma_load_k_pair;
    TMA_V tma_load_v_pair;
  };

  using LoadK = cutlass::fmha::collective::CollectiveLoadTma<
      cutlass::fmha::collective::LoadKind::kK, MainloopPipeline, Element, SmemLayoutK, TMA_K>;
  using LoadV = cutlass::fmha::collective::CollectiveLoadTma<
      cutlass::fmha::collective::LoadKind::kV, MainloopPipeline, Element, SmemLayoutV, TMA_V>;

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_size,
                                        typename Base::Arguments const& args, void* workspace) {
    using namespace cute;
    auto shape_qk = make_shape(get<2>(problem_size), get<3>(problem_size), get<4>(problem_size),
                               make_shape(get<0>(problem_size), get<1>(problem_size)));
    auto params_qk = CollectiveMmaQK::to_underlying_arguments(
        shape_qk, typename CollectiveMmaQK::Arguments{args.ptr_Q, args.dQ, args.ptr_K, args.dK},
        nullptr);
    auto shape_pv = select<0, 2, 1, 3>(shape_qk);
    auto params_pv = CollectiveMmaPV::to_underlying_arguments(
        shape_pv,
        typename CollectiveMmaPV::Arguments{args.ptr_K, args.dK, args.ptr_V,
                                            select<1, 0, 2>(args.dV)},
        nullptr);
    return Params{Base::to_underlying_arguments(problem_size, args, workspace),
                  params_qk.tma_load_b, params_pv.tma_load_b};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_k_pair.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_v_pair.get_tma_descriptor());
  }

  // The example's load_kv_maybe_q with the multicast K/V copies (mask: both CTAs)
  template <bool kLoadQ, class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_kv_maybe_q(int block_rank_in_cluster, BlkCoord const& blk_coord,
                                      Params const& params, ProblemShape const& problem_size,
                                      MainloopPipeline& pipeline, PipelineState& smem_pipe_write,
                                      MainloopPipelineQ& pipeline_q,
                                      PipelineStateQ& smem_pipe_write_q, SharedStorage& storage,
                                      LoadWarpBarrier& load_warp_barrier, bool do_barrier) {
    using namespace cute;
    int const fusion_tile_count = Fusion{}.get_trip_count(blk_coord, TileShape{}, problem_size);
    int lane_predicate = cute::elect_one_sync();
    uint16_t const mcast_mask = uint16_t((1u << size(ClusterShape{})) - 1u);

    auto q_tile_iter = cute::make_coord_iterator(Int<NumMmaWarpGroups>{});
    [[maybe_unused]] int q_tile_count = NumMmaWarpGroups;
    auto k_tile_iter = cute::make_coord_iterator(fusion_tile_count);
    int k_tile_count = 2 * fusion_tile_count;

    typename Base::LoadQ load_q{params.tma_load_q, pipeline_q, storage.smem_q};
    auto load_state_q =
        load_q.init_state(_0{}, problem_size, TileShapeQK{}, blk_coord, NumMmaWarpGroups);
    LoadK load_k{params.tma_load_k_pair, pipeline, storage.smem_k};
    auto load_state_k = load_k.init_state(block_rank_in_cluster, problem_size, TileShapeQK{},
                                          blk_coord, fusion_tile_count);
    LoadV load_v{params.tma_load_v_pair, pipeline, storage.smem_v};
    auto load_state_v = load_v.init_state(block_rank_in_cluster, problem_size, TileShapePV{},
                                          blk_coord, fusion_tile_count);

    if constexpr (kLoadQ) {
      load_q.step(q_tile_iter, load_state_q, smem_pipe_write_q, lane_predicate, q_tile_count);
    }
    load_k.template step<false>(k_tile_iter, load_state_k, smem_pipe_write, lane_predicate,
                                k_tile_count, mcast_mask);
    if constexpr (kLoadQ) {
      load_q.step(q_tile_iter, load_state_q, smem_pipe_write_q, lane_predicate, q_tile_count);
    }
    if constexpr (!kLoadQ) {
      if (do_barrier) {
        load_warp_barrier.arrive();
        load_warp_barrier.wait(/*phase=*/0);
      }
    }
    load_v.template step<true>(k_tile_iter, load_state_v, smem_pipe_write, lane_predicate,
                               k_tile_count, mcast_mask);
    if constexpr (kLoadQ) {
      while (q_tile_count > 0) {
        load_q.step(q_tile_iter, load_state_q, smem_pipe_write_q, lane_predicate, q_tile_count);
      }
    }
    CUTLASS_PRAGMA_NO_UNROLL
    while (k_tile_count > 0) {
      load_k.template step<false>(k_tile_iter, load_state_k, smem_pipe_write, lane_predicate,
                                  k_tile_count, mcast_mask);
      load_v.template step<true>(k_tile_iter, load_state_v, smem_pipe_write, lane_predicate,
                                 k_tile_count, mcast_mask);
    }
  }
};

// The wrapped mainloop, or paired in a cluster when the options name ClusterPair
template <class Base, class Fusion, class... Options>
using MaybeClusterPair =
    std::conditional_t<kClusterPair<Options...>, ClusterPairMainloop<Base, Fusion>, Base>;

// Persistent, for clusters of two: work items are pairs of neighbouring query blocks of one
// head (pairs fastest, then mode 0, then mode 1: the example's order), cluster c takes items
// c, c + C, c + 2C, ... and its CTA of rank r the pair's block 2 p + r. `sm_count` of the
// hardware info is the number of CTAs that can be resident as clusters (the launcher asks the
// driver). As in BalancedPersistentScheduler, a last round on at most a quarter of the clusters
// shrinks the grid to the same number of rounds on every cluster.
struct ClusterPairScheduler {
  struct Params {
    int num_pairs;
    int clusters;
    cutlass::FastDivmod divmod_pairs;
    cutlass::FastDivmod divmod_b;
  };

  Params params;
  int item;

  CUTLASS_DEVICE explicit ClusterPairScheduler(Params const& p)
      : params(p), item(int(blockIdx.x) / 2) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& ps, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const&, TileShape const&) {
    static_assert(cute::size(ClusterShape{}) == 2, "clusters of two CTAs");
    int const blocks_q = cute::ceil_div(int(cute::get<2>(ps)), int(cute::get<0>(TileShape{})));
    int const pairs = (blocks_q + 1) / 2;
    int const num_pairs = pairs * int(cute::get<0>(ps)) * int(cute::get<1>(ps));
    int most = hw.sm_count / 2;
    most = most > 0 ? most : 1;
    int clusters = num_pairs < most ? num_pairs : most;
    int const rounds = clusters > 0 ? (num_pairs + clusters - 1) / clusters : 0;
    int const last = num_pairs - (rounds - 1) * clusters;
    if (rounds > 1 && 4 * last <= clusters) clusters = (num_pairs + rounds - 1) / rounds;
    return Params{num_pairs, clusters > 0 ? clusters : 1, cutlass::FastDivmod(pairs > 0 ? pairs : 1),
                  cutlass::FastDivmod(int(cute::get<0>(ps)) > 0 ? int(cute::get<0>(ps)) : 1)};
  }

  static dim3 get_grid_shape(Params const& params) { return dim3(2 * params.clusters, 1, 1); }

  CUTLASS_DEVICE bool is_valid() const { return item < params.num_pairs; }

  CUTLASS_DEVICE auto get_block_coord() const {
    int rest, p, b, h;
    params.divmod_pairs(rest, p, item);
    params.divmod_b(h, b, rest);
    return cute::make_coord(2 * p + int(blockIdx.x & 1), cute::_0{}, cute::make_coord(b, h));
  }

  CUTLASS_DEVICE ClusterPairScheduler& operator++() {
    item += params.clusters;
    return *this;
  }
};

}  // namespace hopper
}  // namespace stackfuse
