// FlashAttention-3's intra-warpgroup overlap for the Hopper FMHA example's warp-specialized
// mainloop (examples/88_hopper_fmha, CUTLASS 4.2).
//
// Why: in the example's loop a consumer warpgroup issues S_j = Q K_j^T, waits for it *and* for
// the previous O += P_{j-1} V_{j-1}, then runs the softmax of S_j with its tensor-core work
// drained; only the other warpgroup can fill that gap. FlashAttention-3 (Shah et al. 2024,
// "intra-warpgroup overlapping") orders the loop so that a warpgroup's softmax of S_j runs
// while its own P_{j-1} V_{j-1} is on the tensor cores. O then holds every P_i V_i (i < j)
// scaled to the row maxima m_{j-1}; it is rescaled by exp(m_{j-1} - m_j) once that product is
// done, before P_j V_j is added: the same online softmax, one product later. It costs
// registers (S_j, P_{j-1} and O live at once: 64 + 32 + 64 per thread at 64 x 128 x 128 per
// warpgroup, under the 240 that setmaxnreg gives a consumer; no spills).
//
// `OverlapMainloop<Base, Fusion>` derives from the example's `FmhaMainloopTmaWarpSpecialized`
// and replaces only `compute`; loads, pipelines, shared storage, scheduler and kernel are the
// example's. The loop follows the example's `compute` (BSD-3-Clause, Copyright (c) 2024 - 2025
// NVIDIA CORPORATION & AFFILIATES) with the order changed and two details of ptxas handled
// (see `compute`). Measured on an H200 (commit e0e9c94): 1-4% faster than
// the example's ping-pong at head dim 128, 10% with three warpgroups at head dim 64.
#pragma once

#include <cmath>

#include "collective/fmha_collective_tma_warpspecialized.hpp"

namespace stackfuse {
namespace hopper {

// Option tag, passed among the example's Options (its find_option_t needs a tag: ours is
// outside CUTLASS's enum, so no option lookup of the example matches it)
struct Overlap {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1001);
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kOverlap = (std::is_same_v<Options, Overlap> || ...);

// Option tag: O rescaled lazily (see `OverlapMainloop::kLazyRescale`)
struct LazyRescale {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1002);
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kLazy = (std::is_same_v<Options, LazyRescale> || ...);

template <class Base, class Fusion, bool kLazyRescaleO = false>
struct OverlapMainloop : Base {
  using typename Base::Element;
  using typename Base::MainloopPipeline;
  using typename Base::MainloopPipelineQ;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::PipelineStateQ;
  using typename Base::SharedStorage;
  using typename Base::SmemLayoutK;
  using typename Base::SmemLayoutQ;
  using typename Base::SmemLayoutV;
  using typename Base::TileShape;
  using typename Base::TileShapePV;
  using typename Base::TileShapeQK;
  using typename Base::TiledMmaPV;
  using typename Base::TiledMmaQK;
  using ElementQK = typename Base::ElementAccumulatorQK;

  // Lazy rescale (FlashAttention-4's): a row keeps its running maximum until a tile's
  // maximum exceeds it by more than kRescaleLog2 (log2 units: probabilities up to 256, which
  // fp16 and bf16 hold at full relative precision; the fp32 sums and O do not care), and a warp
  // whose rows all kept theirs skips O's rescale between the wait for P V and the next wgmma.
  // The result is the same online softmax: sums and O share the stale maximum, and the tail
  // divides one by the other. Pays where O is large next to S: head dim 256 with 64-key tiles
  // (128 FMULs per thread and tile for 32 exponentials), 212 -> 198-199 us at B4 S2048 N8
  // (commit 2fdf822); at head dims 32-128 with 128-key tiles it lost 1-4% (the branch
  // costs more than the FMULs), so only the variants that name the option have it.
  static constexpr bool kLazyRescale = kLazyRescaleO;
  static constexpr float kRescaleLog2 = 8.f;

  // per-warpgroup key-tile counts (see `compute`): causal masks, three 64-row warpgroups
  static constexpr bool kWarpgroupTrips =
      Fusion::kCausal &&
      cute::size<0>(TileShape{}) == 3 * cute::size<0>(TileShapeQK{});

  // Block 0's softmax is ours too (one MUFU.EX2 per probability; the mask only where tile 0
  // has masked keys) instead of the example's step, which masks every first tile and calls
  // exp2f (a range check and two multiplies more per probability): 17% fewer instructions at
  // B16 S256 N16 H128, where that block is half of every tile's softmax (Nsight Compute).
  // Side by side on the H200 (medians of 9 rounds, commit 3425fc6) it was faster in both
  // lazy-rescale kernels: 185.4 vs 190.5 us at B8 S2048 N16 H64 causal (three warpgroups, 9 of
  // 9 rounds), 192.2 vs 193.8 at B4 S2048 N8 H256 (cooperative, 8 of 9). In the two-warpgroup
  // ping-pong kernels ptxas scheduled the loop differently and long head-dim-128 launches lost
  // 1-3% (bf16 B8 S2048: 428.6 vs 417.3 us, 0 of 9 rounds faster), though single short
  // sequences gained up to 10%; they keep the example's step.
  static constexpr bool kOwnFirstSoftmax = kLazyRescale;

  // 2^x in one MUFU.EX2. exp2f adds a compare and two multiplies per call for subnormal
  // results (< 2^-126): here they are probabilities that small next to a row maximum of 1,
  // which fp16 cannot hold and no sum notices, so flushing them to zero changes nothing.
  CUTLASS_DEVICE static float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }

  // The online softmax of one S tile with O's rescale deferred: the new row maxima go to the
  // state, the row sums are rescaled here, and the factor for O is returned in o_scale (O is
  // still being written by the P V product in flight when this runs).
  // Returns whether this thread's rows need O rescaled (always, unless kLazyRescale).
  template <bool kMasked, class AccQK, class CountQK, class State, class Scales, class ProblemShape>
  CUTLASS_DEVICE static bool online_softmax(AccQK& acc_qk, CountQK const& count_qk, State& state,
                                            Scales& o_scale, Params const& params,
                                            ProblemShape const& ps) {
    using namespace cute;
    using cutlass::fmha::collective::layout_acc_mn;
    using cutlass::fmha::collective::reduction_target_n;
    if constexpr (kMasked) Fusion{}.before_softmax(acc_qk, count_qk, ps);
    TiledMmaQK tiled_mma_qk;
    Tensor s = make_tensor(acc_qk.data(), layout_acc_mn(tiled_mma_qk, acc_qk.layout()));
    auto red = reduction_target_n(tiled_mma_qk);
    constexpr int kRedRank = decltype(rank(red))::value;
    auto& s_max = get<0>(state);
    auto& a_sum = get<1>(state);
    float const scale = params.scale_softmax_log2;

    Tensor m = make_fragment_like(s_max);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); i++) {
      m(i) = s_max(i);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); j++) m(i) = ::fmaxf(m(i), s(i, j));
    }
    for_each(make_seq<kRedRank>{}, [&](auto r) {
      CUTLASS_PRAGMA_UNROLL
      for (int k = 1; k < shape<r>(red); k *= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size<0>(s); i++) {
          m(i) = ::fmaxf(m(i), __shfl_xor_sync(uint32_t(-1), m(i), stride<r>(red) * k));
        }
      }
    });
    bool rescale = !kLazyRescale;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(s); i++) {
      float off;
      if constexpr (kLazyRescale) {
        // grown by more than the threshold, or from -inf to a number (a NaN: both -inf, no)
        bool const grown = (m(i) - s_max(i)) * scale > kRescaleLog2;
        rescale |= grown;
        float const cur = m(i) == -INFINITY ? 0.f : m(i);
        o_scale(i) = grown ? ::exp2f((s_max(i) - cur) * scale) : 1.f;
        s_max(i) = grown ? m(i) : s_max(i);
        off = (s_max(i) == -INFINITY ? 0.f : s_max(i)) * scale;
      } else {
        float const cur = m(i) == -INFINITY ? 0.f : m(i);
        o_scale(i) = ::exp2f((s_max(i) - cur) * scale);
        s_max(i) = m(i);
        off = cur * scale;
      }
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(s); j++) {
        s(i, j) = exp2_ftz(s(i, j) * scale - off);
        sum += s(i, j);
      }
      a_sum(i) = a_sum(i) * o_scale(i) + sum;
    }
    return rescale;
  }

  template <class BlkCoord, class ProblemShape, class MainloopPipelineReducer,
            class PipelineStateReducer, class MathWgOrderBarrier>
  CUTLASS_DEVICE auto compute(BlkCoord const& blk_coord, BlkCoord const& wg_coord,
                              Params const& params, ProblemShape const& problem_size,
                              MainloopPipeline& pipeline, PipelineState& smem_pipe_read,
                              MainloopPipelineQ& pipeline_q, PipelineStateQ& smem_pipe_read_q,
                              MainloopPipelineReducer&, PipelineStateReducer&,
                              SharedStorage& storage, MathWgOrderBarrier& math_wg_order_barrier) {
    using namespace cute;
    using cutlass::fmha::collective::gemm_zero_acc;
    using cutlass::fmha::collective::layout_acc_mn;
    using cutlass::fmha::collective::make_acc_into_op;
    int thread_idx = int(threadIdx.x);
    PipelineStateQ smem_pipe_release_q = smem_pipe_read_q;

    TiledMmaQK tiled_mma_qk;
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ));
    Tensor tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK));

    TiledMmaPV tiled_mma_pv;
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    Tensor tOrV = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sV));

    // Key tiles: the producer loads the CTA's (`cta_total`, from the CTA's last row). Under a
    // causal mask with three 64-row warpgroups (a 192-row CTA over 128-key tiles) each
    // warpgroup computes only those its own rows see (`total`) and passes the rest back
    // unread (`drain`): ~10% fewer tiles, 211 -> 195-198 us at B8 S2048 N16 H64 (three runs,
    // commit e95036c). With two warpgroups both see the same tiles, and without a mask every
    // warpgroup sees every tile: those kernels keep the example's count, and their code.
    int unmasked = Fusion{}.get_unmasked_trip_count(blk_coord, TileShape{}, problem_size);
    int total = unmasked + Fusion{}.get_masked_trip_count(blk_coord, TileShape{}, problem_size);
    int const cta_total = total;
    if constexpr (kWarpgroupTrips) {
      // (with ShiftRows the warpgroup's rows start row_shift earlier: a first block's may all
      // lie before row 0)
      int const wg_row =
          get<0>(wg_coord) * get<0>(TileShapeQK{}) - Fusion::row_shift(problem_size);
      bool const has_rows =
          wg_row < get<2>(problem_size) &&
          (Fusion::kRowShiftBlock == 0 || wg_row + get<0>(TileShapeQK{}) > 0);
      total = has_rows ? Fusion{}.get_trip_count(wg_coord, TileShapeQK{}, problem_size) : 0;
      unmasked = Fusion{}.get_unmasked_trip_count(wg_coord, TileShapeQK{}, problem_size);
      unmasked = unmasked < total ? unmasked : total;
    }
    // K_t and V_t of the tiles t in [total, cta_total): wait until loaded, release unread
    auto drain = [&]() {
      CUTLASS_PRAGMA_NO_UNROLL
      for (int t = total; t < cta_total; ++t) {
        CUTLASS_PRAGMA_UNROLL
        for (int kv = 0; kv < 2; ++kv) {
          pipeline.consumer_wait(smem_pipe_read);
          pipeline.consumer_release(smem_pipe_read);
          ++smem_pipe_read;
        }
      }
    };

    pipeline_q.consumer_wait(smem_pipe_read_q);
    int const q_stage = smem_pipe_read_q.index();

    // coordinates of the S accumulator (for the mask)
    Tensor cP = make_identity_tensor(take<0, 2>(TileShapeQK{}));
    Tensor tPcP = thr_mma_qk.partition_C(cP);
    int m_block = get<0>(wg_coord);
    tPcP.data() = tPcP.data() + E<0>{} * m_block * get<0>(TileShapeQK{});

    Tensor acc_pv = partition_fragment_C(tiled_mma_pv, take<0, 2>(TileShapePV{}));
    clear(acc_pv);
    Tensor acc_pv_mn = make_tensor(acc_pv.data(), layout_acc_mn(tiled_mma_pv, acc_pv.layout()));

    cutlass::fmha::collective::CollectiveSoftmax<ElementQK, Fusion, Params> softmax{params};
    auto softmax_state = softmax.init(acc_pv, tiled_mma_pv);
    Tensor o_scale = make_fragment_like(get<0>(softmax_state));

    if constexpr (kWarpgroupTrips) {
      if (total == 0) {  // no row of this warpgroup is inside Sq: O = 0, its LSE unused
        math_wg_order_barrier.wait();  // keep the warpgroups' turn order
        math_wg_order_barrier.arrive();
        drain();
        if constexpr (Base::kIsPersistent) pipeline_q.consumer_release(smem_pipe_release_q);
        Tensor lse = softmax.tail(softmax_state, acc_pv, tiled_mma_pv);
        return make_tuple(acc_pv, lse);
      }
    }

    // Block 0: S_0 and its softmax (the example's first step: the mask is always applied)
    Tensor acc_s = partition_fragment_C(tiled_mma_qk, take<0, 2>(TileShapeQK{}));
    pipeline.consumer_wait(smem_pipe_read);
    math_wg_order_barrier.wait();
    warpgroup_fence_operand(acc_s);
    warpgroup_arrive();
    gemm_zero_acc(tiled_mma_qk, tSrQ(_, _, _, q_stage), tSrK(_, _, _, smem_pipe_read.index()),
                  acc_s);
    warpgroup_commit_batch();
    math_wg_order_barrier.arrive();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    pipeline.consumer_release(smem_pipe_read);  // K_0
    ++smem_pipe_read;                           // -> V_0
    if constexpr (kOwnFirstSoftmax) {  // from an empty state; O is zero, its scale ignored
      fill(get<0>(softmax_state), -INFINITY);
      fill(get<1>(softmax_state), 0.f);
      if (unmasked > 0) {
        online_softmax<false>(acc_s, tPcP, softmax_state, o_scale, params, problem_size);
      } else {
        online_softmax<true>(acc_s, tPcP, softmax_state, o_scale, params, problem_size);
      }
    } else {
      softmax.step(acc_s, tiled_mma_qk, tPcP, softmax_state, problem_size);
    }
    fill(o_scale, 1.f);
    tPcP.data() = tPcP.data() + E<1>{} * get<1>(TileShapeQK{});
    // P in the element type and the A-operand layout of the P V product (written each block)
    decltype(make_acc_into_op<Element>(acc_s, typename TiledMmaPV::LayoutA_TV{})) p;
    // Once the last P V product is done: O to the new row maxima, the last block's P to p
    // (lazy rescale: only where a row of the warp moved its maximum; warp-uniform branch)
    bool rescale_o = false;
    auto rescale_o_and_convert_p = [&]() {
      if (!kLazyRescale || __any_sync(uint32_t(-1), rescale_o)) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size<0>(acc_pv_mn); i++) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(acc_pv_mn); c++) acc_pv_mn(i, c) *= o_scale(i);
        }
      }
      p = make_acc_into_op<Element>(acc_s, typename TiledMmaPV::LayoutA_TV{});
    };

    // Block j >= 1. At the top, acc_s holds the probabilities of block j - 1 (in fp32) and
    // O += P_{j-2} V_{j-2} may be in flight:
    //   wait for it; O *= o_scale_{j-1}; P_{j-1} to fp16/bf16 (p);
    //   issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; wait for S_j only;
    //   softmax(S_j) in place -> o_scale_j, while the P V product is on the tensor cores.
    // Every write of p comes after a wait for the product reading it: ptxas may give p the
    // registers of a value written during the product (it did, when P_j was converted during
    // it), and the product reads its A operand asynchronously. Each wait sits at the top of
    // an iteration, where ptxas cannot hoist it above the softmax (within one block it did).
    PipelineState v_prev = smem_pipe_read;  // V_{j-2} once j >= 2
    auto step = [&](auto masked, bool release_v_prev) {
      PipelineState v_read = smem_pipe_read;  // V_{j-1}
      ++smem_pipe_read;
      PipelineState k_read = smem_pipe_read;  // K_j
      ++smem_pipe_read;

      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_pv);
      warpgroup_fence_operand(p);
      if (release_v_prev) pipeline.consumer_release(v_prev);
      rescale_o_and_convert_p();

      pipeline.consumer_wait(k_read);
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_pv);
      warpgroup_fence_operand(p);
      warpgroup_arrive();
      gemm_zero_acc(tiled_mma_qk, tSrQ(_, _, _, q_stage), tSrK(_, _, _, k_read.index()), acc_s);
      warpgroup_commit_batch();
      pipeline.consumer_wait(v_read);
      warpgroup_arrive();
      cute::gemm(tiled_mma_pv, p, tOrV(_, _, _, v_read.index()), acc_pv);
      warpgroup_commit_batch();

      warpgroup_wait<1>();  // S_j is done; the P V product may still run
      warpgroup_fence_operand(acc_s);
      pipeline.consumer_release(k_read);
      rescale_o = online_softmax<decltype(masked)::value>(acc_s, tPcP, softmax_state, o_scale,
                                                          params, problem_size);
      v_prev = v_read;
      tPcP.data() = tPcP.data() + E<1>{} * get<1>(TileShapeQK{});
    };

    int j = 1;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; j < unmasked; ++j) step(cute::false_type{}, j >= 2);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; j < total; ++j) step(cute::true_type{}, j >= 2);

    // The last two P V products: wait for P_{n-2} V_{n-2}, rescale, add P_{n-1} V_{n-1}
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_pv);
    warpgroup_fence_operand(p);
    if (total >= 2) pipeline.consumer_release(v_prev);
    rescale_o_and_convert_p();
    PipelineState v_read = smem_pipe_read;  // V_{n-1}
    ++smem_pipe_read;
    pipeline.consumer_wait(v_read);
    warpgroup_fence_operand(acc_pv);
    warpgroup_fence_operand(p);
    warpgroup_arrive();
    cute::gemm(tiled_mma_pv, p, tOrV(_, _, _, v_read.index()), acc_pv);
    warpgroup_commit_batch();
    if constexpr (Base::kIsPersistent) pipeline_q.consumer_release(smem_pipe_release_q);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_pv);
    if constexpr (Base::kIsPersistent) pipeline.consumer_release(v_read);
    if constexpr (kWarpgroupTrips) drain();

    Tensor lse = softmax.tail(softmax_state, acc_pv, tiled_mma_pv);
    return make_tuple(acc_pv, lse);
  }
};

}  // namespace hopper
}  // namespace stackfuse
