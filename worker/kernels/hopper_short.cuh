// Short-sequence attention for the stacked layout on wgmma: every key of a head (at most 128 or
// 256) in shared memory, one CTA of one warpgroup per 64 query rows of one (batch, head).
// Why: at one or two key tiles per CTA (BERT-base: S 128) the example's TMA/warp-specialized
// kernels pay fixed costs per CTA (barriers, descriptor prefetch, a producer warpgroup) and hold
// one 128-row tile per SM; this kernel is small (96 registers and 42 KB at 128 keys), so five
// CTAs share an SM and most loads of the launch are in flight at once. No online softmax: the
// whole key range is one tile. Both products (and the row sums) run on wgmma (an mma.sync
// version was bound by its tensor-core rate: 13.4 us at BERT-base). What bounds it now is
// instruction issue (Nsight Compute, commit 02fc3b8), so every per-element step is kept to a
// minimum: 9.5 us at BERT-base.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_gmma.hpp>  // wgmma.mma_async wrappers and fences (no CuTe layouts)

namespace stackfuse {
namespace hopper {
namespace short_seq {

constexpr int kHeadDim = 64;  // tile head dim: 8 chunks of 16 bytes (one 128-byte swizzle row)
constexpr int kChunks = kHeadDim / 8;
constexpr int kRows = 64;  // query rows per CTA: one warpgroup, 16 rows per warp
constexpr int kThreads = 128;

constexpr int kOnesBytes = 1024;  // a tile of ones: the B operand of the row-sum wgmma

// Q (64 rows), K and V (kKeys rows each), 128 bytes per row, then the ones; every tile a
// multiple of 1024 bytes
template <int kKeys>
constexpr int smem_bytes() {
  return (kRows + 2 * kKeys) * kHeadDim * 2 + kOnesBytes;
}

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_row, q_batch, q_head;
  int64_t k_row, k_batch, k_head;
  int64_t v_row, v_batch, v_head;
  int64_t o_row, o_batch, o_head;
  int seq_q, seq_kv, head_dim, groups;
  float scale_log2;
  int causal_offset;  // key k is visible to row q iff k <= q + causal_offset (causal only)
};

// 16-byte chunk c of row r lives at chunk (c ^ (r & 7)): the 128-byte swizzle that wgmma's
// SWIZZLE_128B descriptors expect (CuTe's Layout_{K,MN}_SW128_Atom), tile base 1024-aligned
__device__ __forceinline__ int swz(int row, int chunk) { return row * kChunks + (chunk ^ (row & 7)); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}

template <class T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// One MUFU.EX2, no subnormal fix-ups: the arguments are <= 0 and a probability below 2^-126 is
// zero in fp16/bf16 P anyway.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory matrix descriptor of a swz() tile. Fields as CuTe's make_gmma_desc computes them
// for Layout_{K,MN}_SW128_Atom (checked on the host): stride byte offset 1024 (8 rows), leading
// byte offset 1 (K-major; unused) or 0 (MN-major, one 64-element block), layout type 1
// (SWIZZLE_128B). Advancing 16 elements along K adds 32 bytes (K-major: Q, K) or 16 rows =
// 2048 bytes (MN-major: V) to the start address, in 16-byte units.
__device__ __forceinline__ uint64_t sw128_desc(const void* smem, uint64_t lbo) {
  uint64_t const addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr & 0x3FFFF) >> 4) | (lbo << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// cp.async writes shared memory through the generic proxy; wgmma reads it through the async one
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// S += Q K^T, 64 x N x 16 with N = 2 * sizeof...(I) keys (64, 128, 192 or 256), both operands
// K-major
template <class T, size_t... I>
__device__ __forceinline__ void gmma_qk(uint64_t da, uint64_t db, float* d,
                                        std::index_sequence<I...>) {
  namespace G = cute::SM90::GMMA;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr auto K = G::Major::K;
  constexpr size_t kN = 2 * sizeof...(I);
  static_assert(kN == 64 || kN == 128 || kN == 192 || kN == 256, "64 to 256 keys by 64");
  using Mma = std::conditional_t<
      kN == 64, std::conditional_t<kBf16, G::MMA_64x64x16_F32BF16BF16_SS<K, K>,
                                   G::MMA_64x64x16_F32F16F16_SS<K, K>>,
      std::conditional_t<
          kN == 128,
          std::conditional_t<kBf16, G::MMA_64x128x16_F32BF16BF16_SS<K, K>,
                             G::MMA_64x128x16_F32F16F16_SS<K, K>>,
          std::conditional_t<
              kN == 192,
              std::conditional_t<kBf16, G::MMA_64x192x16_F32BF16BF16_SS<K, K>,
                                 G::MMA_64x192x16_F32F16F16_SS<K, K>>,
              std::conditional_t<kBf16, G::MMA_64x256x16_F32BF16BF16_SS<K, K>,
                                 G::MMA_64x256x16_F32F16F16_SS<K, K>>>>>;
  Mma::fma(da, db, d[I]...);
}

// O += P V, 64 x 64 x 16: P from registers, V MN-major (head dim contiguous) in shared memory
template <class T, size_t... I>
__device__ __forceinline__ void gmma_pv(uint32_t const (&a)[4], uint64_t db, float* d,
                                        std::index_sequence<I...>) {
  namespace G = cute::SM90::GMMA;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    G::MMA_64x64x16_F32BF16BF16_RS<G::Major::K, G::Major::MN>::fma(a[0], a[1], a[2], a[3], db,
                                                                   d[I]...);
  } else {
    G::MMA_64x64x16_F32F16F16_RS<G::Major::K, G::Major::MN>::fma(a[0], a[1], a[2], a[3], db,
                                                                 d[I]...);
  }
}

// Row sums of P as a product, l += P 1 (64 x 8 x 16, every column the row sum): B is any 16 x 8
// block of ones (no swizzle; the descriptor may point at the same ones for every k-step). Why:
// adding 128 or 256 probabilities per row cost one FADD each and this kernel is bound by
// instruction issue; the tensor core sums the rounded P that P V uses, for ~nothing.
template <class T>
__device__ __forceinline__ void gmma_sum(uint32_t const (&a)[4], uint64_t db, float (&l)[4]) {
  namespace G = cute::SM90::GMMA;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    G::MMA_64x8x16_F32BF16BF16_RS<G::Major::K, G::Major::K>::fma(a[0], a[1], a[2], a[3], db,
                                                                 l[0], l[1], l[2], l[3]);
  } else {
    G::MMA_64x8x16_F32F16F16_RS<G::Major::K, G::Major::K>::fma(a[0], a[1], a[2], a[3], db, l[0],
                                                               l[1], l[2], l[3]);
  }
}

// Descriptor of the ones tile: no swizzle (layout type 0), core matrices 128 bytes apart along
// K (leading byte offset) and 256 apart along N (stride byte offset): the first 256 bytes
__device__ __forceinline__ uint64_t ones_desc(const void* smem) {
  uint64_t const addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(128 >> 4) << 16) | (uint64_t(256 >> 4) << 32);
}

// The ones tile, written by the whole CTA (visible to wgmma after the next land())
template <class T>
__device__ __forceinline__ void fill_ones(uint4* ones, int tid) {
  static_assert(kOnesBytes == kThreads * 8, "8 bytes per thread");
  uint32_t const one = pack<T>(1.f, 1.f);
  reinterpret_cast<uint2*>(ones)[tid] = make_uint2(one, one);
}

// kTileRows rows of one operand (row stride `stride` elements) into a swz() tile by cp.async;
// rows from `rows` on and columns from `d_chunks` on are zero-filled, nothing read for them.
// Thread t copies chunk t % 8 of rows t / 8 + 16 k: its swizzled column and its source step are
// the same for every k, so each copy costs a compare and a pointer add (written as i / 8,
// i % 8 per copy, address arithmetic was a third of the 256-key kernel's instructions). Rows
// from `touch` on (a multiple of 16) are left alone: the causal kernel does not read them.
template <int kTileRows, class T>
__device__ __forceinline__ void load_tile(uint4* dst, const T* src, int64_t stride, int rows,
                                          int d_chunks, int tid, int touch = kTileRows) {
  constexpr int kPass = kThreads / kChunks;  // rows per pass of the CTA: 16
  static_assert(kTileRows % kPass == 0 && kPass % 8 == 0, "the swizzle repeats every 8 rows");
  int const r = tid / kChunks, c = tid % kChunks;
  uint4* d = dst + swz(r, c);  // row r + 16 k: the same chunk, 16 k rows further
  const T* g = src + r * stride + c * 8;
  int const left = c < d_chunks ? rows - r : 0;  // rows this thread still copies
  int64_t const step = kPass * stride;
#pragma unroll
  for (int k = 0; k < kTileRows / kPass; ++k) {
    if (k * kPass >= touch) break;  // uniform: whole passes
    bool const ok = k * kPass < left;
    cp_async16(d + k * kPass * kChunks, g, ok);  // src-size 0: g is not dereferenced
    g += step;
  }
}

// Q's 64 rows and the first `keys` keys of one head into swizzled shared memory; columns past
// head_dim and rows past the ends are zero-filled.
template <class T, int kKeys>
__device__ __forceinline__ void load_qk(uint4* sQ, uint4* sK, const T* q, const T* k,
                                        Params const& p, int q_rows, int tid, int keys) {
  int const d_chunks = p.head_dim / 8;
  load_tile<kRows>(sQ, q, p.q_row, q_rows, d_chunks, tid);
  load_tile<kKeys>(sK, k, p.k_row, p.seq_kv, d_chunks, tid, keys);
}

__device__ __forceinline__ void commit_group() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Pointers to one work item's Q rows (block m0 of head h, batch b) and its K/V head
template <class T>
struct Item {
  const T* q;
  const T* k;
  const T* v;
  int m0, h, b;

  __device__ __forceinline__ Item(Params const& p, int block, int head, int batch)
      : m0(block * kRows), h(head), b(batch) {
    int const kv = head / p.groups;
    q = static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head + m0 * p.q_row;
    k = static_cast<const T*>(p.k) + b * p.k_batch + kv * p.k_head;
    v = static_cast<const T*>(p.v) + b * p.v_batch + kv * p.v_head;
  }
};

// Accumulator layout of every product below: each warp holds rows 16 w + lane / 4 (+ 8),
// columns 8 j + 2 (lane % 4) (+ 1), the layout of mma.sync's C, which is also the A-operand
// layout of the P V wgmma, so P never leaves registers.

// s = Q K^T over kN n-tiles of 8 keys (64 x 8 kN), four k-steps of 16 over the head dim
template <class T, int kN>
__device__ __forceinline__ void product_qk(uint4 const* sQ, uint4 const* sK, float (&s)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  uint64_t const dq = sw128_desc(sQ, 1);
  uint64_t const dk = sw128_desc(sK, 1);
#pragma unroll
  for (int j = 0; j < 4 * kN; ++j) cute::warpgroup_fence_operand(s[j / 4][j % 4]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    gmma_qk<T>(dq + 2 * ks, dk + 2 * ks, &s[0][0], std::make_index_sequence<4 * kN>{});
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int j = 0; j < 4 * kN; ++j) cute::warpgroup_fence_operand(s[j / 4][j % 4]);
}

// P's k-step kk (keys 16 kk .. 16 kk + 15) as the A fragment of the P V wgmma: two n-tiles
// of 8 keys are one fragment
template <class T, int kN>
__device__ __forceinline__ void pack_step(float const (&s)[kN][4], int kk, uint32_t (&a)[4]) {
  a[0] = pack<T>(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack<T>(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// O's and l's registers, around the wgmma groups that accumulate into them
__device__ __forceinline__ void fence_ol(float (&o)[8][4], float (&l)[4]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) cute::warpgroup_fence_operand(o[j / 4][j % 4]);
#pragma unroll
  for (int j = 0; j < 4; ++j) cute::warpgroup_fence_operand(l[j]);
}

// o += P V and l += P 1: P from the probabilities in s (two n-tiles of 8 keys are one A
// fragment), V's kN * 8 rows MN-major in sV, ones in sOnes; the fragments stay live (fenced)
// until the wgmma group has completed
template <class T, int kN>
__device__ __forceinline__ void product_pv(float const (&s)[kN][4], uint4 const* sV,
                                           uint4 const* sOnes, float (&o)[8][4], float (&l)[4]) {
  uint32_t pa[kN / 2][4];
#pragma unroll
  for (int kk = 0; kk < kN / 2; ++kk) pack_step<T>(s, kk, pa[kk]);
  uint64_t const dv = sw128_desc(sV, 0);
  uint64_t const d1 = ones_desc(sOnes);
  auto const fence = [&] {  // every register the wgmma group reads or writes, around it
    fence_ol(o, l);
#pragma unroll
    for (int j = 0; j < 2 * kN; ++j) cute::warpgroup_fence_operand(pa[j / 4][j % 4]);
  };
  fence();
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < kN / 2; ++kk) {
    gmma_pv<T>(pa[kk], dv + kk * (2048 >> 4), &o[0][0], std::make_index_sequence<32>{});
    gmma_sum<T>(pa[kk], d1, l);
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  fence();
}

// The softmax's exponentials and P V in two halves of the keys: the first half's wgmma group is
// committed and left running while the second half is exponentiated, so the exponentials
// (MUFU) overlap the tensor core's P V inside the warpgroup, not only across CTAs (GQA 16/4 B32
// S256 28.44 vs 28.93 us, B2 S256 N12 4.12 vs 4.41; commit 9466ce9). Not in quarters: with three
// quarters of S still in registers when the first group is issued, the 168 registers of three
// CTAs per SM are too few and ptxas serializes the wgmma (C7512); at 128 keys even halves need
// more than the 96 registers of five CTAs per SM, so the pipelined 128-key kernel runs four.
// `base` as for exponentiate(); o and l zeroed by the caller; waits for every group at the end.
template <class T, int kN>
__device__ __forceinline__ void softmax_pv_pipelined(float (&s)[kN][4], float const (&base)[2],
                                                     float scale_log2, uint4 const* sV,
                                                     uint4 const* sOnes, float (&o)[8][4],
                                                     float (&l)[4]) {
  constexpr int kSteps = kN / 2;  // k-steps of 16 keys
  constexpr int kChunk = kSteps / 2;  // k-steps per group: two groups
  static_assert(kSteps % 2 == 0, "whole halves");
  uint32_t pa[kSteps][4];
  uint64_t const dv = sw128_desc(sV, 0);
  uint64_t const d1 = ones_desc(sOnes);
  fence_ol(o, l);
#pragma unroll
  for (int c = 0; c < kSteps / kChunk; ++c) {
#pragma unroll
    for (int kk = c * kChunk; kk < (c + 1) * kChunk; ++kk) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[2 * kk + h][e] = exp2_ftz(s[2 * kk + h][e] * scale_log2 - base[e >> 1]);
        }
      }
      pack_step<T>(s, kk, pa[kk]);
#pragma unroll
      for (int j = 0; j < 4; ++j) cute::warpgroup_fence_operand(pa[kk][j]);
    }
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = c * kChunk; kk < (c + 1) * kChunk; ++kk) {
      gmma_pv<T>(pa[kk], dv + kk * (2048 >> 4), &o[0][0], std::make_index_sequence<32>{});
      gmma_sum<T>(pa[kk], d1, l);
    }
    cute::warpgroup_commit_batch();
  }
  cute::warpgroup_wait<0>();
  fence_ol(o, l);
}

// Keys past seq_kv (and, causal, past row + causal_offset) to -inf. Uniform skip: a full
// non-causal tile needs no mask.
template <bool kCausal, int kN>
__device__ __forceinline__ void mask_scores(float (&s)[kN][4], Params const& p, int m0) {
  if (!kCausal && p.seq_kv >= 8 * kN) return;
  int const warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int const r0 = m0 + warp * 16 + (lane >> 2);
  int const c0 = (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int const col = j * 8 + c0 + (e & 1);
      int const row = r0 + (e >> 1) * 8;
      bool masked = col >= p.seq_kv;
      if constexpr (kCausal) masked = masked || col > row + p.causal_offset;
      if (masked) s[j][e] = -INFINITY;
    }
  }
}

// The maximum of this thread's rows (r0, r0 + 8) over the tile, across the 4 lanes of a row
template <int kN>
__device__ __forceinline__ void row_max(float const (&s)[kN][4], float (&mx)[2]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
  }
}

// s <- 2^(s * scale_log2 - base) (base: a row's maximum, already scaled)
template <int kN>
__device__ __forceinline__ void exponentiate(float (&s)[kN][4], float const (&base)[2],
                                             float scale_log2) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = exp2_ftz(s[j][e] * scale_log2 - base[e >> 1]);
  }
}

// O x inv (1 / row sum) into this warp's own, already consumed Q rows of sQ, then out as
// 16-byte stores
template <class T>
__device__ __forceinline__ void store_out(float const (&o)[8][4], float const (&inv)[2],
                                          uint4* sQ, Params const& p, Item<T> const& it) {
  int const warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int const lr0 = warp * 16 + (lane >> 2);
  int const c0 = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      auto* chunk = reinterpret_cast<T*>(&sQ[swz(lr0 + i * 8, j)]);
      *reinterpret_cast<uint32_t*>(chunk + c0) =
          pack<T>(o[j][2 * i] * inv[i], o[j][2 * i + 1] * inv[i]);
    }
  }
  __syncwarp();
  int const d_chunks = p.head_dim / 8;
  auto* out = static_cast<T*>(p.o) + it.b * p.o_batch + it.h * p.o_head;
#pragma unroll
  for (int i = lane; i < 16 * kChunks; i += 32) {
    int const lr = i / kChunks, c = i % kChunks;
    int const row = it.m0 + warp * 16 + lr;
    if (row < p.seq_q && c < d_chunks) {
      *reinterpret_cast<uint4*>(out + row * p.o_row + c * 8) = sQ[swz(warp * 16 + lr, c)];
    }
  }
}

// cp.async groups up to the `kPending` most recent complete, their writes visible to wgmma
template <int kPending>
__device__ __forceinline__ void land() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
  fence_async_shared();
  __syncthreads();
}

// One work item whose Q and K have landed in sQ/sK (the first cp.async group waited on, proxy
// fenced, CTA synchronized), every key in one tile: S = Q K^T, softmax, then wait for V (the
// last group) and the ones, O = P V with the row sums, out.
template <class T, bool kCausal, int kKeys, bool kPipelined, class WaitV>
__device__ __forceinline__ void attend(uint4* sQ, uint4 const* sK, uint4 const* sV,
                                       uint4 const* sOnes, Params const& p, Item<T> const& it,
                                       WaitV const& wait_v) {
  constexpr int kN = kKeys / 8;  // n-tiles of 8 keys
  float s[kN][4];
  product_qk<T>(sQ, sK, s);
  mask_scores<kCausal>(s, p, it.m0);
  float mx[2] = {-INFINITY, -INFINITY};
  row_max(s, mx);
#pragma unroll
  for (int i = 0; i < 2; ++i) mx[i] = mx[i] == -INFINITY ? 0.f : mx[i] * p.scale_log2;
  if constexpr (!kPipelined) exponentiate(s, mx, p.scale_log2);
  wait_v();
  float o[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float l[4] = {0.f, 0.f, 0.f, 0.f};  // rows r0 and r0 + 8: l[0] and l[2]
  if constexpr (kPipelined) {
    softmax_pv_pipelined<T>(s, mx, p.scale_log2, sV, sOnes, o, l);
  } else {
    product_pv<T>(s, sV, sOnes, o, l);
  }
  // 1 / row sum; 0 for a row with no key (P all zero), which comes out as zeros
  float const inv[2] = {l[0] > 0.f ? 1.f / l[0] : 0.f, l[2] > 0.f ? 1.f / l[2] : 0.f};
  store_out<T>(o, inv, sQ, p, it);
}

// The CTA's tiles in dynamic shared memory, in the order smem_bytes() counts them: Q (64 rows),
// K and V (kKeys rows each), the ones
struct Tiles {
  uint4* q;
  uint4* k;
  uint4* v;
  uint4* ones;
};

template <int kKeys>
__device__ __forceinline__ Tiles tiles(uint4* smem) {
  uint4* const k = smem + kRows * kChunks;
  uint4* const v = k + kKeys * kChunks;
  return {smem, k, v, v + kKeys * kChunks};
}

// The keys a block computes: all of them, or at 256 keys under a causal mask those its last row
// sees (keys 0 .. m0 + 63 + causal_offset), rounded up to 64
template <bool kCausal, int kKeys, class T>
__device__ __forceinline__ int keys_seen(Params const& p, Item<T> const& it) {
  if constexpr (kCausal && kKeys == 256) {
    int const seen = min(p.seq_kv, it.m0 + kRows + p.causal_offset);
    return min(kKeys, max(64, (seen + 63) / 64 * 64));
  } else {
    return kKeys;
  }
}

// attend() at the key count a causal block sees (`keys`, a multiple of 64; 256-key kernel only)
template <class T, bool kCausal, int kKeys, bool kPipelined, class WaitV>
__device__ __forceinline__ void attend_seen(uint4* sQ, uint4 const* sK, uint4 const* sV,
                                            uint4 const* sOnes, Params const& p,
                                            Item<T> const& it, int keys, WaitV const& wait_v) {
  if constexpr (!kCausal || kKeys == 128) {
    attend<T, kCausal, kKeys, kPipelined>(sQ, sK, sV, sOnes, p, it, wait_v);
  } else if (keys == 64) {
    attend<T, true, 64, kPipelined>(sQ, sK, sV, sOnes, p, it, wait_v);
  } else if (keys == 128) {
    attend<T, true, 128, kPipelined>(sQ, sK, sV, sOnes, p, it, wait_v);
  } else if (keys == 192) {
    attend<T, true, 192, kPipelined>(sQ, sK, sV, sOnes, p, it, wait_v);
  } else {
    attend<T, true, 256, kPipelined>(sQ, sK, sV, sOnes, p, it, wait_v);
  }
}

// grid: (ceil(seq_q / 64), q heads, batch); block: 128 threads; dynamic smem smem_bytes<kKeys>().
// V is in flight while Q K^T and the softmax run. Causal at 256 keys: a block computes only the
// keys its last row sees, rounded up to 64 (a 64 x 64, 128, 192 or 256 product; 160 of 256 on
// average at S 256): B16 S256 N12 15.2 -> 14.4 us (commit cbf7a49). Not at 128 keys, where the two
// copies of the math cost more than the first block's 64 keys save (10.2 -> 10.4 us).
// Registers: ~96 at 128 keys, <= 168 at 256: as many CTAs per SM (5, 3) as the shared memory
// allows (without the bound at 256 keys nvcc takes 228 and only two fit). kPipelined: the
// exponentials overlap P V (softmax_pv_pipelined; option ShortPipelined, variants shortwo);
// at 128 keys with four CTAs per SM (110 registers: five leave 96, too few for it).
template <class T, bool kCausal, int kKeys, bool kPipelined = false>
__global__ void __launch_bounds__(kThreads, kKeys == 128 ? (kPipelined ? 4 : 5) : 3)
    kernel(Params const p) {
  extern __shared__ __align__(1024) uint4 smem[];
  auto const [sQ, sK, sV, sOnes] = tiles<kKeys>(smem);
  Item<T> const it(p, blockIdx.x, blockIdx.y, blockIdx.z);
  int const tid = threadIdx.x;
  int const keys = keys_seen<kCausal, kKeys>(p, it);
  load_qk<T, kKeys>(sQ, sK, it.q, it.k, p, min(kRows, p.seq_q - it.m0), tid, keys);
  commit_group();
  load_tile<kKeys>(sV, it.v, p.v_row, p.seq_kv, p.head_dim / 8, tid, keys);
  commit_group();
  fill_ones<T>(sOnes, tid);
  land<1>();
  attend_seen<T, kCausal, kKeys, kPipelined>(sQ, sK, sV, sOnes, p, it, keys, [] { land<0>(); });
}

// Tensor maps of a TMA launch (kernel_tma): dims (head dim, rows, heads, batch), a box of 64
// columns x the rows of the CTA's tile (64 of Q, every key of K and V) in the 128-byte swizzle
// that swz() describes, zero fill past the ends (rows past a sequence, columns past the head dim)
struct TmaMaps {
  CUtensorMap q;
  CUtensorMap k;
  CUtensorMap v;
};

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// One box of `map` at (0, row, head, batch) into `dst`, completing `bar`
__device__ __forceinline__ void tma_box(CUtensorMap const* map, uint4* dst, uint64_t* bar,
                                        int row, int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(0), "r"(row), "r"(head),
      "r"(batch)
      : "memory");
}

template <int kKeys>
constexpr int smem_bytes_tma() {
  return smem_bytes<kKeys>() + 16;  // two mbarriers after the ones
}

// The kernel with its tiles loaded by TMA (option ShortTma): one thread issues three
// tensor copies, Q and K on barrier 0, V on barrier 1, so the loads cost no instructions per copy
// (the cp.async kernel spends ~280 on them at 256 keys) and each lands as a few large L2
// requests. At 129-256 keys it is as fast or faster at every shape measured: GQA 16/4 B32 S256
// 26.8 vs 28.3 us, 9 of 9 rounds (commit a36b2fe). At 128 keys it is slower (BERT-base 9.8-10.3
// vs 9.6 us), and TMA always fetches the whole box, where the cp.async kernel skips the keys a
// causal block does not see; the 128-key variants keep cp.async.
template <class T, bool kCausal, int kKeys, bool kPipelined>
__global__ void __launch_bounds__(kThreads, kKeys == 128 ? (kPipelined ? 4 : 5) : 3)
    kernel_tma(Params const p, const __grid_constant__ TmaMaps maps) {
  extern __shared__ __align__(1024) uint4 smem[];
  auto const [sQ, sK, sV, sOnes] = tiles<kKeys>(smem);
  uint64_t* bars = reinterpret_cast<uint64_t*>(sOnes + kOnesBytes / 16);
  Item<T> const it(p, blockIdx.x, blockIdx.y, blockIdx.z);
  int const tid = threadIdx.x;
  if (tid == 0) {
    constexpr uint32_t kTile = kKeys * kHeadDim * 2;
    constexpr uint32_t kQK = kTile + kRows * kHeadDim * 2;
    asm volatile(
        "mbarrier.init.shared::cta.b64 [%0], 1;\n"
        "mbarrier.init.shared::cta.b64 [%1], 1;\n"
        "fence.mbarrier_init.release.cluster;\n"
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %2;\n"
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %3;\n" ::"r"(smem_u32(&bars[0])),
        "r"(smem_u32(&bars[1])), "r"(kQK), "r"(kTile)
        : "memory");
    int const kv = it.h / p.groups;
    tma_box(&maps.q, sQ, &bars[0], it.m0, it.h, it.b);
    tma_box(&maps.k, sK, &bars[0], 0, kv, it.b);
    tma_box(&maps.v, sV, &bars[1], 0, kv, it.b);
  }
  fill_ones<T>(sOnes, tid);
  int const keys = keys_seen<kCausal, kKeys>(p, it);
  fence_async_shared();  // the ones, visible to wgmma
  __syncthreads();       // ... and the barriers initialized before anyone waits on them
  mbar_wait(&bars[0], 0);
  attend_seen<T, kCausal, kKeys, kPipelined>(sQ, sK, sV, sOnes, p, it, keys,
                                             [&] { mbar_wait(&bars[1], 0); });
}

}  // namespace short_seq
}  // namespace hopper
}  // namespace stackfuse
