// Stackfuse wrapper around CUTLASS's Hopper FMHA (examples/88_hopper_fmha in nvidia-cutlass 4.2).
//
// Why this file exists: the example is a benchmark program; we use its collective/kernel headers
// as a library and add only what a stacked-attention call needs:
//   * a mask fusion (`StackfuseMask`) that handles causal top-left / bottom-right masks and a
//     key length that is not a multiple of the key tile, with all bounds read at run time;
//   * `Problem`: Q, K, V and O addressed by base pointer + CuTe strides (row, batch, head), so
//     a stacked [B, S, (Nq + 2 Nkv) * H] tensor is read in place, without copies;
//   * GQA/MQA in one launch (`GroupedMainloop`): the mainloop sees the head mode as (G, Nkv)
//     with K/V stride (0, H), so query head kv*G + g reads key/value head kv (PyTorch's
//     enable_gqa convention) straight from the stacked tensor; the non-warp-specialized kernel,
//     whose mainloop fixes its strides, still runs a group as G launches;
//   * heads-first tile order (the heads in the problem shape's first mode), so CTAs running
//     together read neighbouring columns of the same stacked rows (`BatchMajor`: the example's);
//   * tile schedulers for causal masks (`HeavyFirstScheduler`, `SerpentineScheduler`,
//     `ChunkedSerpentineScheduler`) that even out the unequal cost of causal query blocks (+11%
//     and, for 192-row tiles, +2-3% more, measured on an H200), and a persistent grid without a
//     nearly empty last round (`BalancedPersistentScheduler`);
//   * `launch<Cfg>()`: builds the TMA descriptors (cached per thread for repeated pointers),
//     overrides the softmax scale, raises the dynamic shared-memory limit once per device and
//     launches on the caller's stream;
//   * with the `Overlap` option, the example's mainloop with its softmax overlapped with the
//     warpgroup's own P V product (hopper_overlap.cuh), with `LazyRescale` O rescaled only when
//     a row maximum moves by more than 2^8.
//
// The example's headers are included, not copied; only its mainloop's `compute` loop is
// adapted, in hopper_overlap.cuh.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/fast_math.h"
#include "cutlass/kernel_hardware_info.h"

#include "collective/fmha_fusion.hpp"
#include "kernel/fmha_kernel_builder.hpp"

#include "hopper_api.h"
#include "hopper_kernel_ws.cuh"
#include "hopper_overlap.cuh"
#include "hopper_short.cuh"

namespace stackfuse {
namespace hopper {

using cute::_1;

enum class CausalMode : int { kNone = 0, kTopLeft = 1, kBottomRight = 2 };

// Mask fusion for the Hopper FMHA mainloop. Problem shape is (B, H, Sq, Sk, D).
// Masked tiles must be the last ones of a CTA's key range (the mainloop runs unmasked tiles
// first); both the causal band and the ragged last key tile satisfy that.
// Row q may attend to key k iff k < Sk and (not causal or k <= q + offset), where offset is 0
// for top-left and Sk - Sq for bottom-right alignment.
//
// kShiftBlock > 0 (the `ShiftRows` option; causal masks, CTA tiles of kShiftBlock rows): the
// query blocks end at most 63 rows after row Sq instead of starting at row 0, i.e. block m holds
// rows [m B - s, (m + 1) B - s) with s = row_shift(Sq): (-Sq) mod B, rounded down to whole
// warpgroup tiles of 64 rows. The kernel's row coordinates (blocks, the mask's row index) stay
// "virtual" (v = q + s); only Q's load and O's store move, by s / 64 tiles, and the mask sees
// offset - s. A warpgroup tile before row 0 only drains its K/V and stores nothing.
// Why: under a causal mask a ragged last block is the heaviest (it sees every key), the first
// the lightest; shifted, the rows the ragged block wastes are the first block's, which sees one
// key tile. Measured at 192 x 128 tiles, head dim 64: 1.3-1.9% faster at 2048 rows, 3% at
// 1024, 0.9% slower where nothing shifts (commit c9a21ab; docs/hopper-kernel.md).
// (`row_shift` itself is in hopper_kernel_ws.cuh, whose epilogue needs it first.)
template <CausalMode kMode, int kShiftBlock = 0>
struct StackfuseMask : cutlass::fmha::collective::DefaultFusion {
  static constexpr bool kCausal = kMode != CausalMode::kNone;
  static_assert(kShiftBlock == 0 || kCausal, "shifted query blocks only pay under a causal mask");
  static constexpr int kRowShiftBlock = kShiftBlock;

  // rows before row 0 in the first query block (0 unless kShiftBlock > 0)
  template <class ProblemSize>
  CUTLASS_HOST_DEVICE static int row_shift(ProblemSize const& ps) {
    return stackfuse::hopper::row_shift<kShiftBlock>(int(cute::get<2>(ps)));
  }

  // of the kernel's (virtual) row index
  template <class ProblemSize>
  CUTLASS_DEVICE static int offset(ProblemSize const& ps) {
    if constexpr (kMode == CausalMode::kBottomRight) {
      return cute::get<3>(ps) - cute::get<2>(ps) - row_shift(ps);
    } else {
      return -row_shift(ps);
    }
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_trip_count(BlkCoord const& blk, TileShape const& tile, ProblemSize const& ps) {
    int const seq_k = cute::get<3>(ps);
    int const block_kv = cute::get<1>(tile);
    if constexpr (kMode == CausalMode::kNone) {
      return cute::ceil_div(seq_k, block_kv);
    } else {
      int const block_q = cute::get<0>(tile);
      int hi = (int(cute::get<0>(blk)) + 1) * block_q + offset(ps);  // exclusive key bound
      hi = hi < seq_k ? hi : seq_k;
      hi = hi > 1 ? hi : 1;  // at least one tile: the mainloop assumes it
      return cute::ceil_div(hi, block_kv);
    }
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_unmasked_trip_count(BlkCoord const& blk, TileShape const& tile,
                                             ProblemSize const& ps) {
    int const seq_k = cute::get<3>(ps);
    int const block_kv = cute::get<1>(tile);
    int n = get_trip_count(blk, tile, ps);
    int full = seq_k / block_kv;  // tiles with no ragged key tail
    n = n < full ? n : full;
    if constexpr (kMode != CausalMode::kNone) {
      int const block_q = cute::get<0>(tile);
      int lo = int(cute::get<0>(blk)) * block_q + offset(ps) + 1;  // keys every row may see
      int free_tiles = lo > 0 ? lo / block_kv : 0;
      n = n < free_tiles ? n : free_tiles;
    }
    return n;
  }

  template <class BlkCoord, class TileShape, class ProblemSize>
  CUTLASS_DEVICE int get_masked_trip_count(BlkCoord const& blk, TileShape const& tile,
                                           ProblemSize const& ps) {
    return get_trip_count(blk, tile, ps) - get_unmasked_trip_count(blk, tile, ps);
  }

  template <class AccQK, class IndexQK, class ProblemSize>
  CUTLASS_DEVICE void before_softmax(AccQK& acc_qk, IndexQK const& index_qk, ProblemSize const& ps) {
    int const seq_k = cute::get<3>(ps);
    [[maybe_unused]] int const off = offset(ps);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc_qk); i++) {
      auto pos = index_qk(i);
      int const q = cute::get<0>(pos);
      int const k = cute::get<1>(pos);
      bool masked = k >= seq_k;
      if constexpr (kMode != CausalMode::kNone) {
        masked = masked || (k > q + off);
      }
      if (masked) {
        acc_qk(i) = -INFINITY;
      }
    }
  }
};

// Tile schedulers (the kernel takes any type with this interface). Causal tiles differ in cost:
// query block m needs about m + 1 key tiles. The example's schedulers hand them out in order,
// which leaves the last wave (non-persistent) or some CTAs (persistent round robin, ~20% above
// the mean for B*H = 128, 16 blocks) with the heavy ones.

// Non-persistent, heaviest query block of each head first: the hardware launches blocks in
// index order, so the last wave holds light blocks.
struct HeavyFirstScheduler {
  struct Params {
    dim3 grid;
  };

  bool valid_ = true;

  CUTLASS_DEVICE explicit HeavyFirstScheduler(Params const&) {}

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& ps, cutlass::KernelHardwareInfo,
                                        ClusterShape const&, TileShape const&) {
    int const blocks_q = cute::ceil_div(int(cute::get<2>(ps)), int(cute::get<0>(TileShape{})));
    return Params{dim3(blocks_q, cute::get<0>(ps), cute::get<1>(ps))};
  }

  static dim3 get_grid_shape(Params const& params) { return params.grid; }

  CUTLASS_DEVICE bool is_valid() const { return valid_; }

  CUTLASS_DEVICE auto get_block_coord() const {
    return cute::make_coord(int(gridDim.x - 1 - blockIdx.x), cute::_0{},
                            cute::make_coord(int(blockIdx.y), int(blockIdx.z)));
  }

  CUTLASS_DEVICE HeavyFirstScheduler& operator++() {
    valid_ = false;
    return *this;
  }
};

// Persistent, serpentine: tiles are listed query block fastest (heads stay together, so their
// K/V stay in L2); in round r, CTA i of P takes tile r*P + i when r is even and r*P + P-1-i when
// odd. Heavy and light blocks then even out per CTA (max/mean 1.03 instead of 1.21 above).
struct SerpentineScheduler {
  struct Params {
    int num_blocks;
    int grid;
    cutlass::FastDivmod divmod_m_block;
    cutlass::FastDivmod divmod_b;
  };

  Params params;
  int round = 0;
  int tile;

  CUTLASS_DEVICE explicit SerpentineScheduler(Params const& p) : params(p), tile(index(0)) {}

  CUTLASS_DEVICE static int index(int r) {
    int const n = int(gridDim.x);
    int const i = int(blockIdx.x);
    return r * n + ((r & 1) ? n - 1 - i : i);
  }

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& ps, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const&, TileShape const&) {
    int const blocks_q = cute::ceil_div(int(cute::get<2>(ps)), int(cute::get<0>(TileShape{})));
    int const num_blocks = blocks_q * int(cute::get<0>(ps)) * int(cute::get<1>(ps));
    int const sms = hw.sm_count > 0 ? hw.sm_count : 1;
    return Params{num_blocks, num_blocks < sms ? num_blocks : sms,
                  cutlass::FastDivmod(blocks_q), cutlass::FastDivmod(int(cute::get<0>(ps)))};
  }

  static dim3 get_grid_shape(Params const& params) { return dim3(params.grid, 1, 1); }

  CUTLASS_DEVICE bool is_valid() const { return tile < params.num_blocks; }

  CUTLASS_DEVICE auto get_block_coord() const {
    int rest, m, b, h;
    params.divmod_m_block(rest, m, tile);
    params.divmod_b(h, b, rest);
    return cute::make_coord(m, cute::_0{}, cute::make_coord(b, h));
  }

  CUTLASS_DEVICE SerpentineScheduler& operator++() {
    ++round;
    tile = index(round);
    return *this;
  }
};

// Persistent, serpentine over a heavy-first order within chunks of heads (the `ChunkedOrder`
// option). With 192-row tiles a head has 11 query blocks at 2048 rows, which do not
// divide the 132 CTAs' rounds: the plain serpentine pairs heavy with light blocks for ten rounds
// and hands the last, partial round's 88 tiles (light to heavy) to 88 CTAs, max/mean ~1.10 by a
// cost model of key tiles per block. Listing the blocks of each chunk of K heads heaviest first
// (K heads' K/V in L2 at once) evens that out to ~1.03 at K = 32, and is much worse than the plain
// order at other shapes; so the host simulates the serpentine for each K that keeps a chunk's
// K/V under kChunkBytes and takes the best, K = 1 (as balanced as the plain order) included. The
// rounds, grid and tile index are the serpentine's own (inherited); only the tile's coordinates
// differ.
// kShiftBlock: the mask's (StackfuseMask), for the cost model's rows per block.
template <int kShiftBlock = 0>
struct ChunkedSerpentineScheduler : SerpentineScheduler {
  struct Params : SerpentineScheduler::Params {
    int blocks_q;
    int heads;  // mode 0 x mode 1 (heads x batch)
    int chunk;  // K >= 1 (1: each head's blocks heaviest first, heads in order)
    // the chunked order's divisions, by multiply and shift: by K x blocks_q (the tiles of a
    // chunk), by K and by the last chunk's heads
    cutlass::FastDivmod divmod_chunk_tiles, divmod_chunk, divmod_last_chunk;
  };

  static constexpr double kChunkBytes = 24.0 * 1024 * 1024;
  // tile steps the host may simulate to try every chunk size (else the coarse list)
  static constexpr long kSimSteps = 1L << 18;
  // how much lighter (a share of the mean CTA load) the busiest CTA must be for chunks of several
  // heads to replace chunks of one: a chunk of heads gives up some of one head's K/V reuse in L2
  // (chunks the model put 1.6-2.1% ahead of the plain order ran 0.6-1.4% slower; 4.6% and more
  // paid; commit 7bcb0ef)
  static constexpr double kMinGain = 0.03;

  Params const& chunked;  // the kernel's (parameter space): read where needed, not copied

  CUTLASS_DEVICE explicit ChunkedSerpentineScheduler(Params const& p)
      : SerpentineScheduler(p), chunked(p) {}

  // Chunks of k heads in `p`: the chunk and its divisions (p.blocks_q and p.heads set)
  static void set_chunk(Params& p, int k) {
    p.chunk = k;
    p.divmod_chunk_tiles = cutlass::FastDivmod(k * p.blocks_q);
    p.divmod_chunk = cutlass::FastDivmod(k);
    p.divmod_last_chunk = cutlass::FastDivmod(p.heads - (p.heads - 1) / k * k);  // the last's
  }

  // Tile `tile` of the chunked order: its query block (heaviest first within its chunk) and its
  // head (mode 0 x mode 1 index), by FastDivmod (0.7% faster than integer division on
  // overlap3kls, commit dc2a7c5); the device's (get_block_coord) and the host simulation's
  // (busiest)
  CUTLASS_HOST_DEVICE static void chunked_tile(int tile, Params const& p, int& m, int& rest) {
    int c, u, r, j;
    p.divmod_chunk_tiles(c, u, tile);
    bool const last = p.heads - c * p.chunk < p.chunk;
    (last ? p.divmod_last_chunk : p.divmod_chunk)(r, j, u);
    m = p.blocks_q - 1 - r;
    rest = c * p.chunk + j;
  }

  struct Shape {
    int blocks_q, heads, grid, rows_q, seq_k, head_dim, block_q, block_kv;
    bool operator==(Shape const& o) const {
      return blocks_q == o.blocks_q && heads == o.heads && grid == o.grid && rows_q == o.rows_q &&
             seq_k == o.seq_k && head_dim == o.head_dim && block_q == o.block_q &&
             block_kv == o.block_kv;
    }
  };

  // Query block m's cost by the model: the key tiles its last row sees (its busiest
  // warpgroup's), plus 1.5 for the tile's fixed work
  static std::vector<double> block_costs(Shape const& s) {
    int const kv_tiles = (s.seq_k + s.block_kv - 1) / s.block_kv;
    int const shift = row_shift<kShiftBlock>(s.rows_q);  // block m's last row: (m + 1) B - 1 - s
    std::vector<double> cost(s.blocks_q);
    for (int m = 0; m < s.blocks_q; ++m) {
      int const end = (m + 1) * s.block_q - shift;
      int const last = end < s.rows_q ? end - 1 : s.rows_q - 1;
      int const t = last / s.block_kv + 1;
      cost[m] = (t < kv_tiles ? t : kv_tiles) + 1.5;
    }
    return cost;
  }

  // The busiest CTA's load under the serpentine for chunk size k
  static double busiest(int k, std::vector<double> const& cost, int heads, int grid) {
    Params p{};
    p.blocks_q = int(cost.size());
    p.heads = heads;
    set_chunk(p, k);
    std::vector<double> load(grid, 0.0);
    long const n = long(p.blocks_q) * heads;
    for (long t = 0; t < n; ++t) {
      long const r = t / grid, j = t - r * grid;
      int const cta = int((r & 1) ? grid - 1 - j : j);
      int m, rest;
      chunked_tile(int(t), p, m, rest);
      load[cta] += cost[m];
    }
    double most = 0;
    for (double l : load) most = l > most ? l : most;
    return most;
  }

  // The serpentine's own parameters (blocks, grid), plus the chunk the host simulation picks
  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& ps, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const& cluster, TileShape const& tile) {
    Params p{
        SerpentineScheduler::to_underlying_arguments(ps, hw, cluster, tile), 0, 0, 0, {}, {}, {}};
    p.blocks_q = p.divmod_m_block.divisor;
    p.heads = p.num_blocks / p.blocks_q;
    set_chunk(p, choose_chunk({p.blocks_q, p.heads, p.grid, int(cute::get<2>(ps)),
                               int(cute::get<3>(ps)), int(cute::get<4>(ps)),
                               int(cute::get<0>(TileShape{})), int(cute::get<1>(TileShape{}))}));
    return p;
  }

  // The chunk size for a shape, simulated on the host and remembered per thread for the last 8
  // shapes: a caller whose pointers change every call misses the launch-parameter cache but not
  // this one. Past 64 rounds the serpentine's last, partial round costs at most 1/64 and is not
  // simulated. Every K up to the heads whose K/V fit kChunkBytes is tried, one chunk of all
  // heads included, where that is at most kSimSteps tile steps of simulation (else the coarse
  // list 8 ... 64 plus that largest K); a larger K must beat a smaller one by 1% of the mean
  // load, and the best chunk K = 1 by kMinGain. K = 1 (each head's blocks heaviest first, the
  // heads in order) stands in for the plain order: the same balance by the model, and no branch
  // between two orders on the device, which cost 0.5-4.4% where the plain order ran (commit
  // bb53392). The coarse list alone leaves launches of a few waves unbalanced (B2 S2048 N16
  // causal in 192-row blocks: the busiest CTA 37.5 tile steps by the model, 30.5 with one chunk
  // of all 32 heads; 59.7 vs 49.7 us, commit 7bcb0ef)
  static int choose_chunk(Shape const& s) {
    thread_local Shape seen[8];
    thread_local int chosen[8];
    thread_local int filled = 0, next = 0;
    for (int i = 0; i < filled; ++i) {
      if (seen[i] == s) return chosen[i];
    }
    int chunk = 1;
    long const n = long(s.blocks_q) * s.heads;
    if (n <= 64L * s.grid) {
      // K and V bytes of one head (fp16/bf16; GQA heads share theirs, so this overcounts)
      double const kv_bytes = 4.0 * s.seq_k * double(s.head_dim);
      std::vector<double> const cost = block_costs(s);
      double total = 0;
      for (double c : cost) total += c;
      double const mean = total * s.heads / s.grid;
      double const one_head = busiest(1, cost, s.heads, s.grid);
      double best = one_head;
      auto coarse = [](int k) {
        return k == 8 || k == 16 || k == 24 || k == 32 || k == 48 || k == 64;
      };
      int const fit = int(kChunkBytes / kv_bytes);
      int const most = fit < s.heads ? fit : s.heads;
      bool const every = n * most <= kSimSteps;
      for (int k = 2; k <= most; ++k) {
        if (!every && !coarse(k) && k != most) continue;
        double const v = busiest(k, cost, s.heads, s.grid);
        if (v < best - 0.01 * mean) best = v, chunk = k;
      }
      if (best > one_head - kMinGain * mean) chunk = 1;
    }
    seen[next] = s;
    chosen[next] = chunk;
    next = (next + 1) % 8;
    filled = filled < 8 ? filled + 1 : 8;
    return chunk;
  }

  // Hides the serpentine's: the kernel calls this through the derived type (no virtuals)
  CUTLASS_DEVICE auto get_block_coord() const {
    int rest, m, b, h;
    chunked_tile(tile, chunked, m, rest);
    params.divmod_b(h, b, rest);
    return cute::make_coord(m, cute::_0{}, cute::make_coord(b, h));
  }
};

// Persistent, tiles in the example's order (the non-causal ping-pong kernels). T
// equal tiles on P SMs take R = ceil(T / P) rounds, the last one on T - (R - 1) P SMs. When that
// last round holds at most a quarter of the SMs (4 of 132 at B4 S4096 N32 H128 and at GQA 32/8
// B8 S2048: 4096 tiles), the grid shrinks to ceil(T / R): the same R rounds on every CTA, and
// the SMs left idle give their share of the power-bound card's budget to the others from the
// start instead of 128 of them waiting for 4 (GQA 32/8 1.1-1.4%, B4 S4096 0.5-0.9% faster,
// commit b2ec89a). With a fuller last round (68 of 132 at 2048 tiles) the smaller grid lost up
// to 1.5% (head dim 32) and it is left as it is.
struct BalancedPersistentScheduler : cutlass::fmha::kernel::PersistentTileScheduler {
  using Base = cutlass::fmha::kernel::PersistentTileScheduler;
  using Base::Base;

  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const& ps, cutlass::KernelHardwareInfo hw,
                                        ClusterShape const& cluster, TileShape const& tile) {
    Params p = Base::to_underlying_arguments(ps, hw, cluster, tile);
    int const sms = p.hw_info.sm_count > 0 ? p.hw_info.sm_count : 1;
    int const rounds = (p.num_blocks + sms - 1) / sms;
    int const last = p.num_blocks - (rounds - 1) * sms;
    if (rounds > 1 && 4 * last <= sms) p.hw_info.sm_count = (p.num_blocks + rounds - 1) / rounds;
    return p;
  }
};

// Option tag: the causal ping-pong kernels take ChunkedSerpentineScheduler
struct ChunkedOrder {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1003);  // not CUTLASS's
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kChunked = (std::is_same_v<Options, ChunkedOrder> || ...);

// Option tag (warp-specialized kernels with our epilogue): under a causal mask the query blocks
// end at the last row instead of starting at row 0 (see StackfuseMask's kShiftBlock)
struct ShiftRows {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1008);  // not CUTLASS's
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kShiftRows = (std::is_same_v<Options, ShiftRows> || ...);

// Tile order. The example's problem shape is (B, H, Sq, Sk, D) and its schedulers walk query
// blocks, then mode 0, then mode 1. We put the heads in mode 0 ("heads first"): CTAs that run
// together then read neighbouring columns of the same rows of the stacked tensor (one row holds
// every head's Q, K and V), and a GQA group's query heads share their K/V tiles in L2. The
// example's batch-first order stays available as an option (`BatchMajor`), for comparison.
struct BatchMajor {
  static constexpr auto tag = static_cast<cutlass::fmha::kernel::Tag>(1000);  // not CUTLASS's
  using option_value = cute::true_type;
};

template <class... Options>
inline constexpr bool kHeadsFirst = !(std::is_same_v<Options, BatchMajor> || ...);

// GQA/MQA in one launch. The kernel keeps a flat problem shape (Nq, B, Sq, Sk, D) (heads first;
// (B, Nq, ...) batch-major): schedulers, epilogue (O and LSE are linear in the query head) and
// mask see Nq heads. Only the loads need to know that query head h = g + G * kv reads key/value
// head kv: this mainloop hands the base mainloop the head mode as (G, Nkv), with Q strides
// (H, G H) and K/V strides (_0, H). A static zero stride drops out of the TMA descriptor (CuTe
// filters it), so K/V tiles are the same TMA boxes as without groups; nothing is copied.
//
// With a `ShiftRows` fusion (Fusion::kRowShiftBlock > 0, persistent kernels whose Q warp loads
// Q) the Q warp's tiles move back by row_shift (q_tiles); K/V follow the Fusion's trip counts.
template <class Base, bool kHeadsMode0, class Fusion>
struct GroupedMainloop : Base {
  static constexpr bool kShifted = Fusion::kRowShiftBlock > 0;
  using typename Base::LoadQ;
  using typename Base::MainloopPipelineQ;
  using typename Base::PipelineStateQ;
  using typename Base::SharedStorage;
  using typename Base::TileShapeQK;

  struct Arguments : Base::Arguments {
    int groups;
    int kv_heads;
  };
  struct Params : Base::Params {
    int groups;
    int kv_heads;
  };

  template <class ProblemShape>
  CUTLASS_HOST_DEVICE static auto grouped(ProblemShape const& ps, int groups, int kv_heads) {
    auto heads = cute::make_tuple(groups, kv_heads);
    if constexpr (kHeadsMode0) {
      return cute::make_tuple(heads, cute::get<1>(ps), cute::get<2>(ps), cute::get<3>(ps),
                              cute::get<4>(ps));
    } else {
      return cute::make_tuple(cute::get<0>(ps), heads, cute::get<2>(ps), cute::get<3>(ps),
                              cute::get<4>(ps));
    }
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& ps, Arguments const& args,
                                        void* workspace) {
    return Params{
        Base::to_underlying_arguments(grouped(ps, args.groups, args.kv_heads), args, workspace),
        args.groups, args.kv_heads};
  }

  template <bool kLoadQ, class BlkCoord, class ProblemShape, class... Rest>
  CUTLASS_DEVICE void load_kv_maybe_q(int block_rank_in_cluster, BlkCoord const& blk_coord,
                                      Params const& params, ProblemShape const& ps,
                                      Rest&&... rest) {
    // shifted: Q comes from its own warp (load_maybe_q); K/V need only the shifted Fusion
    static_assert(!(kShifted && kLoadQ), "ShiftRows needs Q loaded by its own warp");
    Base::template load_kv_maybe_q<kLoadQ>(block_rank_in_cluster, blk_coord, params,
                                           grouped(ps, params.groups, params.kv_heads),
                                           std::forward<Rest>(rest)...);
  }

  template <class BlkCoord, class ProblemShape, class... Rest>
  CUTLASS_DEVICE void load_maybe_q(BlkCoord const& blk_coord, Params const& params,
                                   ProblemShape const& ps, Rest&&... rest) {
    if constexpr (kShifted) {
      shifted_load_maybe_q(blk_coord, params, grouped(ps, params.groups, params.kv_heads),
                           std::forward<Rest>(rest)...);
    } else {
      Base::load_maybe_q(blk_coord, params, grouped(ps, params.groups, params.kv_heads),
                         std::forward<Rest>(rest)...);
    }
  }

 private:
  static_assert(!kShifted || cute::size<0>(TileShapeQK{}) == kShiftGranule,
                "row_shift moves rows in whole warpgroup tiles");

  // The CTA's Q tiles, from its first warpgroup tile moved back by row_shift: a tile wholly
  // before row 0 (its warpgroup only drains K/V) loads tile 0 instead, so that no TMA copy has a
  // negative coordinate (a TMA store with one raised an illegal instruction on the H200, run
  // 107; loads are kept to the same rule)
  struct QTiles {
    int tile;
    CUTLASS_DEVICE int operator*() const { return tile > 0 ? tile : 0; }
    CUTLASS_DEVICE QTiles& operator++() {
      ++tile;
      return *this;
    }
  };
  template <class BlkCoord, class ProblemShape>
  CUTLASS_DEVICE static QTiles q_tiles(BlkCoord const& blk_coord, ProblemShape const& ps) {
    return QTiles{Base::NumMmaWarpGroups * int(cute::get<0>(blk_coord)) -
                  Fusion::row_shift(ps) / kShiftGranule};
  }

  // The example's load_maybe_q (the persistent kernels' Q warp; CUTLASS 4.2, BSD-3-Clause,
  // Copyright (c) 2024 - 2025 NVIDIA CORPORATION & AFFILIATES) with Q's tiles from q_tiles
  template <class BlkCoord, class ProblemShape, class LoadWarpBarrier>
  CUTLASS_DEVICE void shifted_load_maybe_q(BlkCoord const& blk_coord, Params const& params,
                                           ProblemShape const& ps,
                                           MainloopPipelineQ& pipeline_q,
                                           PipelineStateQ& smem_pipe_write_q,
                                           SharedStorage& storage,
                                           LoadWarpBarrier& load_warp_barrier, bool do_barrier) {
    int const lane_predicate = cute::elect_one_sync();
    LoadQ load_q{params.tma_load_q, pipeline_q, storage.smem_q};
    // the head's Q tiles from row 0 (the example's, with no block offset: loop count 0)
    auto load_state_q = load_q.init_state(cute::_0{}, ps, TileShapeQK{}, blk_coord, 0);
    auto q_tile_iter = q_tiles(blk_coord, ps);
    CUTLASS_PRAGMA_UNROLL
    for (int q_tile_count = 0; q_tile_count < Base::NumMmaWarpGroups; q_tile_count++) {
      int count = 1;
      load_q.step(q_tile_iter, load_state_q, smem_pipe_write_q, lane_predicate, count);
      if (q_tile_count == 0 && do_barrier) {
        load_warp_barrier.arrive();
        load_warp_barrier.wait(/*phase=*/0);
        do_barrier = false;
      }
    }
  }
};

// Option tag of the short-sequence kernel: its exponentials overlap its own P V (in two halves
// of the keys; hopper_short.cuh, softmax_pv_pipelined)
struct ShortPipelined {};

template <class... Options>
inline constexpr bool kShortPipelined = (std::is_same_v<Options, ShortPipelined> || ...);

// Option tag of the short-sequence kernel: its tiles loaded by TMA (hopper_short.cuh,
// kernel_tma)
struct ShortTma {};

template <class... Options>
inline constexpr bool kShortTma = (std::is_same_v<Options, ShortTma> || ...);

// Schedule tag of our short-sequence kernel (hopper_short.cuh: at most 128 or 256 keys, head
// dim <= 64)
struct ShortSeq {};

namespace detail {

// (row, 1, (mode 0, mode 1)): the example's strides; the non-warp-specialized kernel's only ones
using FlatStride = cute::tuple<int, _1, cute::tuple<int, int>>;
// Q and K/V of a grouped mainloop: the head mode is (group, kv head)
template <bool kHeadsMode0>
using GroupedStrideQ =
    std::conditional_t<kHeadsMode0,
                       cute::tuple<int, _1, cute::tuple<cute::tuple<int, int>, int>>,
                       cute::tuple<int, _1, cute::tuple<int, cute::tuple<int, int>>>>;
template <bool kHeadsMode0>
using GroupedStrideKV =
    std::conditional_t<kHeadsMode0,
                       cute::tuple<int, _1, cute::tuple<cute::tuple<cute::_0, int>, int>>,
                       cute::tuple<int, _1, cute::tuple<int, cute::tuple<cute::_0, int>>>>;

// The example's mainloop, or with FlashAttention-3's intra-warpgroup overlap
// (hopper_overlap.cuh) when the options name Overlap
template <class Base, class Fusion, class... Options>
using MaybeOverlap = std::conditional_t<kOverlap<Options...>,
                                        OverlapMainloop<Base, Fusion, kLazy<Options...>>, Base>;

template <class Element, class TileShape, class Fusion, class Schedule, bool kCausal,
          class... Options>
struct Compose {
  // KernelTma (not warp-specialized): the example's builder, its fixed scheduler and strides
  static constexpr bool kGrouped = false;
  using Kernel = typename cutlass::fmha::kernel::FmhaBuilder<
      Element, float, float, TileShape, FlatStride, FlatStride, FlatStride, Fusion, Schedule,
      Options...>::Kernel;
};

template <class Element, class TileShape, class Fusion, bool kCausal, class... Options>
struct Compose<Element, TileShape, Fusion, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
               kCausal, Options...> {
  static constexpr bool kGrouped = true;
  static constexpr bool kHeads0 = kHeadsFirst<Options...>;
  using Mainloop = GroupedMainloop<
      MaybeOverlap<cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
                       Element, float, float, TileShape, GroupedStrideQ<kHeads0>,
                       GroupedStrideKV<kHeads0>, GroupedStrideKV<kHeads0>, Fusion, Options...>,
                   Fusion, Options...>,
      kHeads0, Fusion>;
  using Epilogue = WarpSpecializedEpilogue<Element, typename Mainloop::TileShapePV,
                                           Fusion::kRowShiftBlock, Options...>;
  using Scheduler = std::conditional_t<kCausal, HeavyFirstScheduler,
                                       cutlass::fmha::kernel::IndividualTileScheduler>;
  using Kernel = WarpSpecializedKernel<Mainloop, Epilogue, Scheduler, Options...>;
};

// Ping-pong: the cooperative kernel made persistent with Q loaded by its own warp, as the
// example's builder does, with our scheduler for causal masks.
template <class Element, class TileShape, class Fusion, bool kCausal, class... Options>
struct Compose<Element, TileShape, Fusion, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
               kCausal, Options...> {
  static constexpr bool kGrouped = true;
  static constexpr bool kHeads0 = kHeadsFirst<Options...>;
  using Persistent = cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kIsPersistent,
                                                   cute::true_type>;
  using QSeparately = cutlass::fmha::kernel::Option<
      cutlass::fmha::kernel::Tag::kLoadsQSeparately, cute::true_type>;
  using Mainloop = GroupedMainloop<
      MaybeOverlap<cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
                       Element, float, float, TileShape, GroupedStrideQ<kHeads0>,
                       GroupedStrideKV<kHeads0>, GroupedStrideKV<kHeads0>, Fusion, Options...,
                       Persistent, QSeparately>,
                   Fusion, Options...>,
      kHeads0, Fusion>;
  using Epilogue = WarpSpecializedEpilogue<Element, typename Mainloop::TileShapePV,
                                           Fusion::kRowShiftBlock, Options...>;
  using Scheduler = std::conditional_t<
      kCausal,
      std::conditional_t<kChunked<Options...>,
                         ChunkedSerpentineScheduler<Fusion::kRowShiftBlock>, SerpentineScheduler>,
      BalancedPersistentScheduler>;
  using Kernel = WarpSpecializedKernel<Mainloop, Epilogue, Scheduler, Options..., Persistent,
                                       QSeparately>;
};

// Our short-sequence kernel (hopper_short.cuh) as a schedule: no CUTLASS kernel type.
template <class Element, class TileShape, class Fusion, bool kCausal, class... Options>
struct Compose<Element, TileShape, Fusion, ShortSeq, kCausal, Options...> {
  static constexpr bool kGrouped = true;
  using Kernel = void;
};

}  // namespace detail

// One forward configuration: element type, tile (BlockQ x BlockKV x HeadDim), schedule, mask.
// Schedule is cutlass::gemm::KernelTma, KernelTmaWarpSpecializedCooperative or
// KernelTmaWarpSpecializedPingpong (the last is persistent and loads Q in its own warp).
template <class Element_, int kBlockQ, int kBlockKV, int kHeadDim, class Schedule, CausalMode kMode,
          class... Options>
struct Config {
  using Element = Element_;
  using TileShape = cute::Shape<cute::Int<kBlockQ>, cute::Int<kBlockKV>, cute::Int<kHeadDim>>;
  // the ShiftRows option: query blocks aligned to the end of the rows (StackfuseMask)
  static constexpr int kShiftBlock =
      (kShiftRows<Options...> && kMode != CausalMode::kNone) ? kBlockQ : 0;
  using Composed = detail::Compose<Element_, TileShape, StackfuseMask<kMode, kShiftBlock>,
                                   Schedule, kMode != CausalMode::kNone, Options...>;
  using Kernel = typename Composed::Kernel;
  using ScheduleTag = Schedule;
  static constexpr int kRowsPerCta = kBlockQ;
  static constexpr int kKeysPerCta = kBlockKV;  // the short-sequence kernels: every key
  static constexpr CausalMode kCausalMode = kMode;
  // one launch for a whole GQA group (else one launch per query head of a group)
  static constexpr bool kGrouped = Composed::kGrouped;
  // heads in the problem shape's mode 0 (walked before the batch), else the example's order
  static constexpr bool kHeadsMode0 = kHeadsFirst<Options...>;
  static constexpr bool kShortPipelined = hopper::kShortPipelined<Options...>;
  static constexpr bool kShortTma = hopper::kShortTma<Options...>;
};

constexpr double kLog2e = 1.4426950408889634;  // the kernels take the softmax scale in base 2

inline bool fits_int(int64_t x) { return x >= 0 && x <= INT32_MAX; }

// Raise kernel kFn's dynamic shared-memory limit to smem bytes where it is above the default.
// cudaFuncSetAttribute is per device; remember the devices already set (up to 64).
template <auto kFn>
Status ensure_smem_attribute(int smem, int device_id) {
  static uint64_t done_mask = 0;
  uint64_t bit = device_id < 64 ? (uint64_t(1) << device_id) : 0;
  if (bit != 0 && (__atomic_load_n(&done_mask, __ATOMIC_ACQUIRE) & bit)) return Status::kOk;
  if (smem >= (48 << 10)) {
    cudaError_t err = cudaFuncSetAttribute(kFn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::kSmemAttribute;
    }
  }
  if (bit != 0) __atomic_fetch_or(&done_mask, bit, __ATOMIC_ACQ_REL);
  return Status::kOk;
}

inline int sm_count(int device_id) {
  static int counts[64] = {0};
  if (device_id >= 0 && device_id < 64 && counts[device_id] > 0) return counts[device_id];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device_id) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (device_id >= 0 && device_id < 64) counts[device_id] = n;
  return n;
}

// Kernel parameters (TMA descriptors included) depend only on pointers and extents. Encoding a
// descriptor costs a driver call, so the last few parameter sets are kept per thread: a model
// with a static memory plan calls with the same pointers every time.
struct ParamsKey {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  int64_t strides[12];
  int dims[5];
  int sms;
  int device;
  float scale;
};

// The last kSlots values built for a key (compared bytewise: keys are memset before filling)
template <class Key, class Value, int kSlots = 16>
struct SlotCache {
  Key keys[kSlots];
  Value values[kSlots];
  bool valid[kSlots] = {};
  int next = 0;

  Value const* find(Key const& key) const {
    for (int i = 0; i < kSlots; ++i) {
      if (valid[i] && std::memcmp(&keys[i], &key, sizeof(Key)) == 0) return &values[i];
    }
    return nullptr;
  }

  Value const* insert(Key const& key, Value const& value) {
    int const i = next;
    next = (next + 1) % kSlots;
    keys[i] = key;
    values[i] = value;
    valid[i] = true;
    return &values[i];
  }
};

template <class Kernel>
using ParamsCache = SlotCache<ParamsKey, typename Kernel::Params>;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Parameters of one launch, from the cache or built (TMA descriptors encoded) and cached.
template <class Kernel>
typename Kernel::Params const* cached_params(ParamsCache<Kernel>& cache, ParamsKey const& key,
                                             typename Kernel::Arguments const& args, float scale) {
  typename Kernel::Params const* params = cache.find(key);
  if (params == nullptr) {
    // no Kernel::can_implement: its seq_q % 8 rule is not needed (TMA clips the ragged query
    // tile; checked on an H200), and head_dim <= tile, % 8 is checked when the code is made
    typename Kernel::Params fresh = Kernel::to_underlying_arguments(args, nullptr);
    fresh.mainloop.scale_softmax = scale;
    fresh.mainloop.scale_softmax_log2 = float(double(scale) * kLog2e);
    params = cache.insert(key, fresh);
  }
  return params;
}

// Right after a launch: its error, if any, as our status (and the CUDA error for the message).
inline Status after_launch(cudaError_t* cuda_error) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::kOk;
  if (cuda_error != nullptr) *cuda_error = err;
  return Status::kLaunch;
}

template <class Kernel>
Status launch_one(typename Kernel::Params const& params, cudaStream_t stream,
                  cudaError_t* cuda_error) {
  dim3 const grid = Kernel::get_grid_shape(params);
  dim3 const block = Kernel::get_block_shape();
  cutlass::device_kernel<Kernel><<<grid, block, Kernel::SharedStorageSize, stream>>>(params);
  return after_launch(cuda_error);
}

// The TMA short kernel's tensor maps for one launch, cached like the CUTLASS kernels' Params
// (an encoding costs host time at every call otherwise)
struct ShortTmaKey {
  const void* ptr[3];
  int64_t strides[9];
  int dims[6];
};

template <class T, int kKeys>
short_seq::TmaMaps const* short_tma_maps(Problem const& p) {
  thread_local SlotCache<ShortTmaKey, short_seq::TmaMaps> cache;
  ShortTmaKey key;
  std::memset(&key, 0, sizeof(key));
  key.ptr[0] = p.q.ptr;
  key.ptr[1] = p.k.ptr;
  key.ptr[2] = p.v.ptr;
  int64_t const strides[] = {p.q.row, p.q.head, p.q.batch, p.k.row, p.k.head,
                             p.k.batch, p.v.row, p.v.head, p.v.batch};
  std::memcpy(key.strides, strides, sizeof(strides));
  int const dims[] = {p.head_dim, p.seq_q, p.seq_kv, p.q_heads, p.kv_heads, p.batch};
  std::memcpy(key.dims, dims, sizeof(dims));
  if (short_seq::TmaMaps const* hit = cache.find(key)) return hit;
  short_seq::TmaMaps maps;
  std::memset(&maps, 0, sizeof(maps));
  auto encode = [&](CUtensorMap* map, Operand const& op, int rows, int heads, int box_rows) {
    constexpr int64_t kElem = sizeof(T);
    cuuint64_t dims4[4] = {cuuint64_t(p.head_dim), cuuint64_t(rows), cuuint64_t(heads),
                           cuuint64_t(p.batch)};
    cuuint64_t strides_b[3] = {cuuint64_t(op.row * kElem), cuuint64_t(op.head * kElem),
                               cuuint64_t(op.batch * kElem)};
    cuuint32_t box[4] = {cuuint32_t(short_seq::kHeadDim), cuuint32_t(box_rows), 1, 1};
    cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    CUresult const r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        map,
        std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        4, const_cast<void*>(op.ptr), dims4, strides_b, box, elem_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
  };
  if (!encode(&maps.q, p.q, p.seq_q, p.q_heads, short_seq::kRows) ||
      !encode(&maps.k, p.k, p.seq_kv, p.kv_heads, kKeys) ||
      !encode(&maps.v, p.v, p.seq_kv, p.kv_heads, kKeys)) {
    return nullptr;
  }
  return cache.insert(key, maps);
}

// One launch of a short-sequence kernel: CTAs of short_seq::kThreads, `smem` bytes each
template <auto kFn, class... Args>
Status launch_short_kernel(dim3 grid, int smem, int device_id, cudaStream_t stream,
                           cudaError_t* cuda_error, Args const&... args) {
  Status const st = ensure_smem_attribute<kFn>(smem, device_id);
  if (st != Status::kOk) return st;
  kFn<<<grid, short_seq::kThreads, smem, stream>>>(args...);
  return after_launch(cuda_error);
}

// The short-sequence kernel: one launch, GQA by head index (h / G), bounds read at run time.
template <class Cfg>
Status launch_short(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error) {
  using T = std::conditional_t<std::is_same_v<typename Cfg::Element, cutlass::bfloat16_t>,
                               __nv_bfloat16, __half>;
  namespace ss = short_seq;
  if (p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0) return Status::kBadHeads;
  constexpr int kKeys = Cfg::kKeysPerCta;
  static_assert(kKeys == 128 || kKeys == 256, "128 or 256 keys per CTA");
  if (p.seq_kv > kKeys) return Status::kTooManyKeys;
  if (p.head_dim > ss::kHeadDim || p.head_dim % 8 != 0) return Status::kMisaligned;
  int64_t const strides[] = {p.q.row, p.q.batch, p.q.head, p.k.row, p.k.batch, p.k.head,
                             p.v.row, p.v.batch, p.v.head, p.o_row, p.o_batch, p.o_head};
  for (int64_t s : strides) {
    if ((s * int64_t(sizeof(T))) % 16 != 0) return Status::kMisaligned;  // cp.async 16 bytes
  }
  if (!aligned16(p.q.ptr) || !aligned16(p.k.ptr) || !aligned16(p.v.ptr) || !aligned16(p.o)) {
    return Status::kMisaligned;
  }
  if (p.q_heads > 65535 || p.batch > 65535) return Status::kGridOverflow;
  if (p.batch == 0 || p.seq_q == 0) return Status::kOk;
  ss::Params sp{p.q.ptr,   p.k.ptr,    p.v.ptr,    p.o,        p.q.row,   p.q.batch,
                p.q.head,  p.k.row,    p.k.batch,  p.k.head,   p.v.row,   p.v.batch,
                p.v.head,  p.o_row,    p.o_batch,  p.o_head,   p.seq_q,   p.seq_kv,
                p.head_dim, p.q_heads / p.kv_heads, float(double(p.scale) * kLog2e),
                Cfg::kCausalMode == CausalMode::kBottomRight ? p.seq_kv - p.seq_q : 0};
  static_assert(Cfg::kRowsPerCta == ss::kRows, "one warpgroup of 64 query rows per CTA");
  dim3 const grid((p.seq_q + ss::kRows - 1) / ss::kRows, p.q_heads, p.batch);
  constexpr bool kCausal = Cfg::kCausalMode != CausalMode::kNone;
  if constexpr (Cfg::kShortTma) {
    // (an encoding the driver refuses falls back to the cp.async kernel below)
    if (ss::TmaMaps const* maps = short_tma_maps<T, kKeys>(p)) {
      return launch_short_kernel<ss::kernel_tma<T, kCausal, kKeys, Cfg::kShortPipelined>>(
          grid, ss::smem_bytes_tma<kKeys>(), p.device_id, stream, cuda_error, sp, *maps);
    }
  }
  return launch_short_kernel<ss::kernel<T, kCausal, kKeys, Cfg::kShortPipelined>>(
      grid, ss::smem_bytes<kKeys>(), p.device_id, stream, cuda_error, sp);
}

template <class Cfg>
Status launch_cutlass(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error);

template <class Cfg>
Status launch(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error = nullptr) {
  if constexpr (std::is_same_v<typename Cfg::ScheduleTag, ShortSeq>) {
    return launch_short<Cfg>(p, stream, cuda_error);
  } else {
    return launch_cutlass<Cfg>(p, stream, cuda_error);
  }
}

template <class Cfg>
Status launch_cutlass(Problem const& p, cudaStream_t stream, cudaError_t* cuda_error) {
  using Kernel = typename Cfg::Kernel;
  using Element = typename Cfg::Element;
  constexpr int64_t kElem = sizeof(Element);
  if (p.kv_heads <= 0 || p.q_heads % p.kv_heads != 0) return Status::kBadHeads;
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

  ParamsKey key;
  std::memset(&key, 0, sizeof(key));
  key.k = p.k.ptr;
  key.v = p.v.ptr;
  key.lse = p.lse;
  std::memcpy(key.strides, strides, sizeof(strides));
  key.dims[0] = p.batch;
  key.dims[1] = p.kv_heads;
  key.dims[2] = p.seq_q;
  key.dims[3] = p.seq_kv;
  key.dims[4] = p.head_dim;
  key.sms = hw.sm_count;
  key.device = p.device_id;
  key.scale = p.scale;

  thread_local ParamsCache<Kernel> cache;
  using StrideO = detail::FlatStride;  // O and LSE are linear in the query head
  using StrideLSE = cute::tuple<_1, cute::tuple<int, int>>;
  constexpr bool kH0 = Cfg::kHeadsMode0;
  // (mode 0, mode 1) of the problem shape and of every L stride: (heads, batch) or (batch, heads)
  auto modes = [](auto heads, auto batch) {
    if constexpr (kH0) {
      return cute::make_tuple(heads, batch);
    } else {
      return cute::make_tuple(batch, heads);
    }
  };

  if constexpr (Cfg::kGrouped) {
    // One launch: query head h = g + G * kv of Nq heads (Q stride H) reads key/value head kv.
    using StrideQ = detail::GroupedStrideQ<kH0>;
    using StrideKV = detail::GroupedStrideKV<kH0>;
    auto const q_heads = cute::make_tuple(int(p.q.head), int(p.q.head * groups));
    StrideQ dQ{int(p.q.row), _1{}, modes(q_heads, int(p.q.batch))};
    StrideKV dK{int(p.k.row), _1{}, modes(cute::make_tuple(cute::_0{}, int(p.k.head)),
                                          int(p.k.batch))};
    StrideKV dV{int(p.v.row), _1{}, modes(cute::make_tuple(cute::_0{}, int(p.v.head)),
                                          int(p.v.batch))};
    StrideO dO{int(p.o_row), _1{}, modes(int(p.o_head), int(p.o_batch))};
    StrideLSE dLSE{_1{}, modes(p.seq_q, int(p.q_heads) * p.seq_q)};
    auto const m = modes(p.q_heads, p.batch);
    key.q = p.q.ptr;
    key.o = p.o;
    typename Kernel::Arguments args{
        {cute::get<0>(m), cute::get<1>(m), p.seq_q, p.seq_kv, p.head_dim},
        {{static_cast<const Element*>(p.q.ptr), dQ, static_cast<const Element*>(p.k.ptr), dK,
          static_cast<const Element*>(p.v.ptr), dV},
         groups,
         p.kv_heads},
        {static_cast<Element*>(p.o), dO, p.lse, dLSE},
        hw};
    return launch_one<Kernel>(*cached_params<Kernel>(cache, key, args, p.scale), stream,
                              cuda_error);
  } else {
    // The example's non-warp-specialized mainloop fixes its strides: launch g of G reads query
    // heads g, g + G, ... (stride G H) against all Nkv key/value heads.
    StrideO dQ{int(p.q.row), _1{}, modes(int(p.q.head * groups), int(p.q.batch))};
    StrideO dK{int(p.k.row), _1{}, modes(int(p.k.head), int(p.k.batch))};
    StrideO dV{int(p.v.row), _1{}, modes(int(p.v.head), int(p.v.batch))};
    StrideO dO{int(p.o_row), _1{}, modes(int(p.o_head * groups), int(p.o_batch))};
    StrideLSE dLSE{_1{}, modes(p.seq_q, int(p.kv_heads) * p.seq_q)};
    auto const m = modes(p.kv_heads, p.batch);
    for (int g = 0; g < groups; ++g) {
      auto const* q = static_cast<const Element*>(p.q.ptr) + int64_t(g) * p.q.head;
      auto* o = static_cast<Element*>(p.o) + int64_t(g) * p.o_head;
      key.q = q;
      key.o = o;
      typename Kernel::Arguments args{
          {cute::get<0>(m), cute::get<1>(m), p.seq_q, p.seq_kv, p.head_dim},
          {q, dQ, static_cast<const Element*>(p.k.ptr), dK,
           static_cast<const Element*>(p.v.ptr), dV},
          {o, dO, p.lse, dLSE},
          hw};
      st = launch_one<Kernel>(*cached_params<Kernel>(cache, key, args, p.scale), stream,
                              cuda_error);
      if (st != Status::kOk) return st;
    }
    return Status::kOk;
  }
}

}  // namespace hopper
}  // namespace stackfuse
