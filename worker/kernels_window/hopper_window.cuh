// Sliding-window causal attention on the Hopper FMHA (hopper_fmha.cuh): key j is seen from query
// i iff  i + off - W < j <= i + off  (off = Sk - Sq bottom-right, 0 top-left; flash-attention's
// window_size_left = W - 1, right = 0), with W read at run time.
//
// Why a folder of its own: every file under worker/kernels is digested into the cache key of
// every cached Hopper and GEMM object (worker.nvcc.headers_digest); only window configurations
// include this one, and their generated source carries this folder's digest.
//
// What it adds to the ping-pong kernel (the example's mainloop, not our overlapped one):
//   * `WindowMask<mode, BQ, BKV>`: a CTA of query block m reads key tiles
//     [first_tile(m), first_tile(m) + trip count) only; tiles wholly outside the window are
//     neither loaded nor computed. Every tile in that range is treated as masked (the per-element
//     mask runs on each): the mainloop runs unmasked tiles first and masked ones last, and a
//     window has partial tiles at both ends. The mask reads W from the problem shape's sixth
//     mode and shifts a score's key coordinate by the CTA's first tile (the consumer's
//     coordinates count from the CTA's first tile; q / BQ is the CTA's block: 128-row CTAs of
//     two 64-row warpgroups, no ShiftRows);
//   * `WindowMainloop<Base, Mask>`: the window in the mainloop's Params; the producer's K/V tile
//     iterator starts at the first tile; `compute` hands the example's consumer the problem
//     shape with W appended, which it passes only to the mask;
//   * `WindowConfig<...>` and `launch_window<Cfg>(p, window, ...)`: the grouped (one launch per
//     GQA group) ping-pong composition of hopper_fmha.cuh's `Compose` and `launch_cutlass`, with
//     the window in the mainloop's arguments and in the launch-parameter cache's key.
#pragma once

#include <cstring>
#include <utility>

#include "hopper_fmha.cuh"

namespace stackfuse {
namespace hopper {

// Keys a CTA of query block m (rows [m BQ, (m + 1) BQ)) needs: [lo, hi). Problem shape
// (mode 0, mode 1, Sq, Sk, D, W).
template <CausalMode kMode, int kBlockQ, int kBlockKV>
struct WindowMask : cutlass::fmha::collective::DefaultFusion {
  static_assert(kMode != CausalMode::kNone, "a window needs a causal mask");
  static constexpr int kRowShiftBlock = 0;  // (GroupedMainloop's ShiftRows hook: off)

  template <class ProblemSize>
  CUTLASS_HOST_DEVICE static int offset(ProblemSize const& ps) {
    if constexpr (kMode == CausalMode::kBottomRight) {
      return int(cute::get<3>(ps)) - int(cute::get<2>(ps));
    } else {
      return 0;
    }
  }

  // [first tile, end tile) of block m: at least one tile (the mainloop assumes it), the first
  // before the end even where the block's rows see no key (those rows come out as zeros)
  template <class ProblemSize>
  CUTLASS_HOST_DEVICE static void tiles(int m, ProblemSize const& ps, int& first, int& end) {
    int const seq_k = cute::get<3>(ps);
    int const w = cute::get<5>(ps);  // 1 <= w <= Sq + Sk (launch_window clamps it)
    int const off = offset(ps);
    int hi = (m + 1) * kBlockQ + off;  // exclusive
    hi = hi < seq_k ? hi : seq_k;
    hi = hi > 1 ? hi : 1;
    int lo = m * kBlockQ + off - w + 1;  // inclusive
    lo = lo > 0 ? lo : 0;
    end = (hi + kBlockKV - 1) / kBlockKV;
    first = lo / kBlockKV;
    first = first < end ? first : end - 1;
  }

  template <class BlkCoord, class ProblemSize>
  CUTLASS_HOST_DEVICE static int first_tile(BlkCoord const& blk, ProblemSize const& ps) {
    int first, end;
    tiles(int(cute::get<0>(blk)), ps, first, end);
    return first;
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const& blk, TileShape const& tile,
                                    ProblemSize const& ps) {
    static_assert(cute::get<0>(TileShape{}) == kBlockQ && cute::get<1>(TileShape{}) == kBlockKV);
    int first, end;
    tiles(int(cute::get<0>(blk)), ps, first, end);
    return end - first;
  }

  // every tile of the range is masked: partial tiles lie at both ends of a window
  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const&, TileShape const&,
                                             ProblemSize const&) {
    return 0;
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_masked_trip_count(BlkCoord const& blk, TileShape const& tile,
                                           ProblemSize const& ps) {
    return get_trip_count(blk, tile, ps);
  }

  // index_qk's key coordinates count from the CTA's first tile; every row of a thread's
  // fragment is in one CTA block
  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk,
                                     ProblemSize const& ps) {
    int const seq_k = cute::get<3>(ps);
    int const w = cute::get<5>(ps);
    int const off = offset(ps);
    int first, end;
    tiles(int(cute::get<0>(index_qk(0))) / kBlockQ, ps, first, end);
    int const k0 = first * kBlockKV;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc_qk); i++) {
      auto pos = index_qk(i);
      int const d = int(cute::get<1>(pos)) + k0 - int(cute::get<0>(pos)) - off;  // k - (q + off)
      bool const masked = int(cute::get<1>(pos)) + k0 >= seq_k || d > 0 || d <= -w;
      if (masked) acc_qk(i) = -INFINITY;
    }
  }
};

// The problem shape with the window appended: what the mask reads
template <class ProblemShape>
CUTLASS_HOST_DEVICE auto with_window(ProblemShape const& ps, int window) {
  return cute::make_tuple(cute::get<0>(ps), cute::get<1>(ps), cute::get<2>(ps), cute::get<3>(ps),
                          cute::get<4>(ps), window);
}

// The example's warp-specialized mainloop (FmhaMainloopTmaWarpSpecialized) with a window: its
// K/V loads start at the CTA's first tile, its consumer sees W through the problem shape.
template <class Base, class Mask>
struct WindowMainloop : Base {
  using typename Base::ClusterShape;
  using typename Base::CollectiveMmaQK;
  using typename Base::LoadK;
  using typename Base::LoadQ;
  using typename Base::LoadV;
  using typename Base::MainloopPipeline;
  using typename Base::MainloopPipelineQ;
  using typename Base::PipelineState;
  using typename Base::PipelineStateQ;
  using typename Base::SharedStorage;
  using typename Base::TileShape;
  using typename Base::TileShapePV;
  using typename Base::TileShapeQK;

  struct Arguments : Base::Arguments {
    int window;
  };
  struct Params : Base::Params {
    int window;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& ps, Arguments const& args,
                                        void* workspace) {
    return Params{Base::to_underlying_arguments(ps, args, workspace), args.window};
  }

  // K/V tile coordinates from the CTA's first tile
  struct Tiles {
    int tile;
    CUTLASS_DEVICE int operator*() const { return tile; }
    CUTLASS_DEVICE Tiles& operator++() {
      ++tile;
      return *this;
    }
  };

  // The example's load_kv_maybe_q (CUTLASS 4.2, BSD-3-Clause, Copyright (c) 2024 - 2025 NVIDIA
  // CORPORATION & AFFILIATES) with the K/V tiles from the mask's first tile
  template <bool kLoadQ, class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void load_kv_maybe_q(int block_rank_in_cluster, BlkCoord const& blk_coord,
                                      Params const& params, ProblemShape const& problem_size,
                                      MainloopPipeline& pipeline, PipelineState& smem_pipe_write,
                                      MainloopPipelineQ& pipeline_q,
                                      PipelineStateQ& smem_pipe_write_q, SharedStorage& storage,
                                      LoadWarpBarrier& load_warp_barrier, bool do_barrier) {
    using namespace cute;
    auto const masked_ps = with_window(problem_size, params.window);
    int fusion_tile_count = Mask{}.get_trip_count(blk_coord, TileShape{}, masked_ps);

    int lane_predicate = cute::elect_one_sync();

    uint16_t mcast_mask_b = 0;

    if (lane_predicate == 1) {
      if constexpr (cute::is_same_v<typename CollectiveMmaQK::GmemTiledCopyB,
                                    SM90_TMA_LOAD_MULTICAST>) {
        auto block_layout = Layout<ClusterShape>{};  // (m,n) -> block_id
        for (int m = 0; m < size<0>(block_layout); ++m) {
          mcast_mask_b |= (uint16_t(1) << block_layout(m, _0{}, Int<0>{}));
        }
      }
    }

    auto q_tile_iter = cute::make_coord_iterator(Int<Base::NumMmaWarpGroups>{});
    [[maybe_unused]] int q_tile_count = Base::NumMmaWarpGroups;

    Tiles k_tile_iter{Mask::first_tile(blk_coord, masked_ps)};
    int k_tile_count = 2 * fusion_tile_count;

    LoadQ load_q{params.tma_load_q, pipeline_q, storage.smem_q};
    auto load_state_q = load_q.init_state(_0{}, problem_size, TileShapeQK{}, blk_coord,
                                          Base::NumMmaWarpGroups);

    LoadK load_k{params.tma_load_k, pipeline, storage.smem_k};
    auto load_state_k = load_k.init_state(block_rank_in_cluster, problem_size, TileShapeQK{},
                                          blk_coord, fusion_tile_count);

    LoadV load_v{params.tma_load_v, pipeline, storage.smem_v};
    auto load_state_v = load_v.init_state(block_rank_in_cluster, problem_size, TileShapePV{},
                                          blk_coord, fusion_tile_count);

    if constexpr (kLoadQ) {
      load_q.step(q_tile_iter, load_state_q, smem_pipe_write_q, lane_predicate, q_tile_count);
    }

    load_k.template step<false>(k_tile_iter, load_state_k, smem_pipe_write, lane_predicate,
                                k_tile_count, mcast_mask_b);

    if constexpr (kLoadQ) {
      load_q.step(q_tile_iter, load_state_q, smem_pipe_write_q, lane_predicate, q_tile_count);
    }

    if constexpr (!kLoadQ) {
      if (do_barrier) {
        load_warp_barrier.arrive();
        load_warp_barrier.wait(/*phase=*/0);
        do_barrier = false;
      }
    }

    load_v.template step<true>(k_tile_iter, load_state_v, smem_pipe_write, lane_predicate,
                               k_tile_count, mcast_mask_b);

    if constexpr (kLoadQ) {
      while (q_tile_count > 0) {
        load_q.step(q_tile_iter, load_state_q, smem_pipe_write_q, lane_predicate, q_tile_count);
      }
    }

    CUTLASS_PRAGMA_NO_UNROLL
    while (k_tile_count > 0) {
      load_k.template step<false>(k_tile_iter, load_state_k, smem_pipe_write, lane_predicate,
                                  k_tile_count, mcast_mask_b);
      load_v.template step<true>(k_tile_iter, load_state_v, smem_pipe_write, lane_predicate,
                                 k_tile_count, mcast_mask_b);
    }
  }

  // The example's consumer; the problem shape it passes to the mask carries the window
  template <class BlkCoord, class ProblemShape, class... Rest>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk_coord, BlkCoord const& wg_coord,
                              Params const& params, ProblemShape const& problem_size,
                              Rest&&... rest) {
    return Base::compute(blk_coord, wg_coord, params, with_window(problem_size, params.window),
                         std::forward<Rest>(rest)...);
  }
};

// One window configuration: the ping-pong kernel (persistent, Q in its own warp, GQA in one
// launch) with WindowMask. Same parameters as Config, so the generator names both alike.
template <class Element_, int kBlockQ, int kBlockKV, int kHeadDim, class Schedule, CausalMode kMode,
          class... Options>
struct WindowConfig {
  static_assert(std::is_same_v<Schedule, cutlass::gemm::KernelTmaWarpSpecializedPingpong>,
                "windows: the ping-pong kernel only");
  static_assert(!kOverlap<Options...> && !kShiftRows<Options...>,
                "windows: the example's mainloop, query blocks from row 0");
  using Element = Element_;
  using TileShape = cute::Shape<cute::Int<kBlockQ>, cute::Int<kBlockKV>, cute::Int<kHeadDim>>;
  using Mask = WindowMask<kMode, kBlockQ, kBlockKV>;
  static constexpr bool kHeadsMode0 = kHeadsFirst<Options...>;
  using Persistent = cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kIsPersistent,
                                                   cute::true_type>;
  using QSeparately = cutlass::fmha::kernel::Option<
      cutlass::fmha::kernel::Tag::kLoadsQSeparately, cute::true_type>;
  using Mainloop = GroupedMainloop<
      WindowMainloop<cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
                         Element, float, float, TileShape, detail::GroupedStrideQ<kHeadsMode0>,
                         detail::GroupedStrideKV<kHeadsMode0>,
                         detail::GroupedStrideKV<kHeadsMode0>, Mask, Options..., Persistent,
                         QSeparately>,
                     Mask>,
      kHeadsMode0, Mask>;
  using Epilogue =
      WarpSpecializedEpilogue<Element, typename Mainloop::TileShapePV, 0, Options...>;
  // (the serpentines' cost models assume causal blocks; windowed blocks cost about the same,
  // which either order balances)
  using Scheduler = std::conditional_t<kChunked<Options...>, ChunkedSerpentineScheduler<0>,
                                       SerpentineScheduler>;
  using Kernel =
      WarpSpecializedKernel<Mainloop, Epilogue, Scheduler, Options..., Persistent, QSeparately>;
  static constexpr CausalMode kCausalMode = kMode;
};

struct WindowParamsKey {
  ParamsKey base;
  int window;
};

// launch_cutlass's grouped branch (hopper_fmha.cuh) with the window. The generator bakes in
// `window` >= 1; one above Sq + Sk is the same window as Sq + Sk (every causal key), and is
// clamped to it so that the mask's int sums stay in range.
template <class Cfg>
Status launch_window(Problem const& p, int window, cudaStream_t stream, cudaError_t* cuda_error) {
  using Kernel = typename Cfg::Kernel;
  using Element = typename Cfg::Element;
  constexpr int64_t kElem = sizeof(Element);
  if (p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0) return Status::kBadHeads;
  int64_t const widest = int64_t(p.seq_q) + p.seq_kv;
  if (!fits_int(widest)) return Status::kStrideOverflow;
  int const w = window < 1 ? 1 : (int64_t(window) < widest ? window : int(widest));
  int const groups = p.q_heads / p.kv_heads;

  int64_t const strides[] = {p.q.row, p.q.batch, p.q.head * groups, p.k.row, p.k.batch, p.k.head,
                             p.v.row, p.v.batch, p.v.head, p.o_row, p.o_batch, p.o_head * groups};
  for (int64_t s : strides) {
    if (!fits_int(s)) return Status::kStrideOverflow;
    if ((s * kElem) % 16 != 0) return Status::kMisaligned;
  }
  if (!fits_int(int64_t(p.batch) * p.q_heads * p.seq_q)) return Status::kStrideOverflow;
  if (!aligned16(p.q.ptr) || !aligned16(p.k.ptr) || !aligned16(p.v.ptr) || !aligned16(p.o)) {
    return Status::kMisaligned;
  }
  if ((p.q.head * kElem) % 16 != 0 || (p.o_head * kElem) % 16 != 0) return Status::kMisaligned;

  int const sms = sm_count(p.device_id);
  if (sms <= 0) return Status::kDevice;
  Status st = ensure_smem_attribute<cutlass::device_kernel<Kernel>>(Kernel::SharedStorageSize,
                                                                   p.device_id);
  if (st != Status::kOk) return st;

  cutlass::KernelHardwareInfo hw;
  hw.device_id = p.device_id;
  hw.sm_count = sms;

  WindowParamsKey key;
  std::memset(&key, 0, sizeof(key));
  key.base.q = p.q.ptr;
  key.base.k = p.k.ptr;
  key.base.v = p.v.ptr;
  key.base.o = p.o;
  key.base.lse = p.lse;
  std::memcpy(key.base.strides, strides, sizeof(strides));
  key.base.dims[0] = p.batch;
  key.base.dims[1] = p.kv_heads;
  key.base.dims[2] = p.seq_q;
  key.base.dims[3] = p.seq_kv;
  key.base.dims[4] = p.head_dim;
  key.base.sms = hw.sm_count;
  key.base.device = p.device_id;
  key.base.scale = p.scale;
  key.window = w;

  using StrideO = detail::FlatStride;
  using StrideLSE = cute::tuple<_1, cute::tuple<int, int>>;
  constexpr bool kH0 = Cfg::kHeadsMode0;
  auto modes = [](auto heads, auto batch) {
    if constexpr (kH0) {
      return cute::make_tuple(heads, batch);
    } else {
      return cute::make_tuple(batch, heads);
    }
  };
  using StrideQ = detail::GroupedStrideQ<kH0>;
  using StrideKV = detail::GroupedStrideKV<kH0>;
  auto const q_heads = cute::make_tuple(int(p.q.head), int(p.q.head * groups));
  StrideQ dQ{int(p.q.row), _1{}, modes(q_heads, int(p.q.batch))};
  StrideKV dK{int(p.k.row), _1{},
              modes(cute::make_tuple(cute::_0{}, int(p.k.head)), int(p.k.batch))};
  StrideKV dV{int(p.v.row), _1{},
              modes(cute::make_tuple(cute::_0{}, int(p.v.head)), int(p.v.batch))};
  StrideO dO{int(p.o_row), _1{}, modes(int(p.o_head), int(p.o_batch))};
  StrideLSE dLSE{_1{}, modes(p.seq_q, int(p.q_heads) * p.seq_q)};
  auto const m = modes(p.q_heads, p.batch);
  typename Kernel::Arguments args{
      {cute::get<0>(m), cute::get<1>(m), p.seq_q, p.seq_kv, p.head_dim},
      {{{static_cast<const Element*>(p.q.ptr), dQ, static_cast<const Element*>(p.k.ptr), dK,
         static_cast<const Element*>(p.v.ptr), dV},
        w},
       groups,
       p.kv_heads},
      {static_cast<Element*>(p.o), dO, p.lse, dLSE},
      hw};

  thread_local SlotCache<WindowParamsKey, typename Kernel::Params> cache;
  typename Kernel::Params const* params = cache.find(key);
  if (params == nullptr) {
    typename Kernel::Params fresh = Kernel::to_underlying_arguments(args, nullptr);
    fresh.mainloop.scale_softmax = p.scale;
    fresh.mainloop.scale_softmax_log2 = float(double(p.scale) * kLog2e);
    params = cache.insert(key, fresh);
  }
  return launch_one<Kernel>(*params, stream, cuda_error);
}

}  // namespace hopper
}  // namespace stackfuse
