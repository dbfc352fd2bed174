// Short-sequence attention for the stacked layout on wgmma: every key of a head (at most 128 or
// 256) in shared memory, one CTA of one warpgroup per 64 query rows of one (batch, head).
// Why: at one or two key tiles per CTA (BERT-base: S 128) the example's TMA/warp-specialized
// kernels pay fixed costs per CTA (barriers, descriptor prefetch, a producer warpgroup) and hold
// one 128-row tile per SM; this kernel is small (96 registers and 41 KB at 128 keys), so five
// CTAs share an SM and most loads of the launch are in flight at once. No online softmax: the
// whole key range is one tile. Both products run on wgmma (an mma.sync version of this kernel,
// session 4, was bound by its tensor-core rate: 13.4 us at BERT-base against 10.8 here).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

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

// Q (64 rows), K and V (kKeys rows each), 128 bytes per row; every tile a multiple of 1024 bytes
template <int kKeys>
constexpr int smem_bytes() {
  return (kRows + 2 * kKeys) * kHeadDim * 2;
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

// S += Q K^T, 64 x N x 16 with N = 2 * sizeof...(I) keys (128 or 256), both operands K-major
template <class T, size_t... I>
__device__ __forceinline__ void gmma_qk(uint64_t da, uint64_t db, float* d,
                                        std::index_sequence<I...>) {
  namespace G = cute::SM90::GMMA;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (sizeof...(I) == 64) {
    if constexpr (kBf16) {
      G::MMA_64x128x16_F32BF16BF16_SS<G::Major::K, G::Major::K>::fma(da, db, d[I]...);
    } else {
      G::MMA_64x128x16_F32F16F16_SS<G::Major::K, G::Major::K>::fma(da, db, d[I]...);
    }
  } else {
    static_assert(sizeof...(I) == 128, "128 or 256 keys");
    if constexpr (kBf16) {
      G::MMA_64x256x16_F32BF16BF16_SS<G::Major::K, G::Major::K>::fma(da, db, d[I]...);
    } else {
      G::MMA_64x256x16_F32F16F16_SS<G::Major::K, G::Major::K>::fma(da, db, d[I]...);
    }
  }
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

// kTileRows rows of one operand (row stride `stride` elements) into a swz() tile by cp.async;
// rows from `rows` on and columns from `d_chunks` on are zero-filled, nothing read for them.
template <int kTileRows, class T>
__device__ __forceinline__ void load_tile(uint4* dst, const T* src, int64_t stride, int rows,
                                          int d_chunks, int tid) {
  for (int i = tid; i < kTileRows * kChunks; i += kThreads) {
    int const r = i / kChunks, c = i % kChunks;
    bool const ok = r < rows && c < d_chunks;
    cp_async16(&dst[swz(r, c)], ok ? src + r * stride + c * 8 : src, ok);
  }
}

// Q's 64 rows and every key of one head into swizzled shared memory as two cp.async groups (Q
// and K, then V); columns past head_dim and rows past the ends are zero-filled.
template <class T, int kKeys>
__device__ __forceinline__ void load_qkv(uint4* sQ, uint4* sK, uint4* sV, const T* q, const T* k,
                                         const T* v, Params const& p, int q_rows, int tid) {
  int const d_chunks = p.head_dim / 8;
  load_tile<kRows>(sQ, q, p.q_row, q_rows, d_chunks, tid);
  load_tile<kKeys>(sK, k, p.k_row, p.seq_kv, d_chunks, tid);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  load_tile<kKeys>(sV, v, p.v_row, p.seq_kv, d_chunks, tid);
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// grid: (ceil(seq_q / 64), q heads, batch); block: 128 threads; dynamic smem smem_bytes<kKeys>().
// V is in flight while Q K^T and the softmax run. Each warp's accumulators hold rows
// 16 w + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1): the layout of mma.sync's C, which is
// also the A-operand layout of the P V wgmma, so P never leaves registers. The output goes
// through this warp's own Q rows in shared memory and leaves as coalesced 16-byte stores.
// Registers: ~96 at 128 keys (5 CTAs per SM, as many as the shared memory allows), ~168 at 256.
template <class T, bool kCausal, int kKeys>
__global__ void __launch_bounds__(kThreads, kKeys == 128 ? 5 : 2) kernel(Params const p) {
  extern __shared__ __align__(1024) uint4 smem[];
  uint4* sQ = smem;
  uint4* sK = sQ + kRows * kChunks;
  uint4* sV = sK + kKeys * kChunks;
  constexpr int kN = kKeys / 8;  // n-tiles of 8 keys

  int const m0 = blockIdx.x * kRows;
  int const h = blockIdx.y, b = blockIdx.z;
  int const kv = h / p.groups;
  int const tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  auto const* q = static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head + m0 * p.q_row;
  auto const* k = static_cast<const T*>(p.k) + b * p.k_batch + kv * p.k_head;
  auto const* v = static_cast<const T*>(p.v) + b * p.v_batch + kv * p.v_head;
  int const d_chunks = p.head_dim / 8;

  load_qkv<T, kKeys>(sQ, sK, sV, q, k, v, p, min(kRows, p.seq_q - m0), tid);
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  fence_async_shared();
  __syncthreads();

  // S = Q K^T: 64 rows x kKeys keys, four k-steps of 16 over the head dim
  float s[kN][4];
#pragma unroll
  for (int j = 0; j < kN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  {
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

  // mask, softmax over the whole key range (rows r0 and r0 + 8 of this thread)
  int const r0 = m0 + warp * 16 + (lane >> 2);
  int const c0 = (lane & 3) * 2;
  if (kCausal || p.seq_kv < kKeys) {  // uniform: a full non-causal key tile needs no mask
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
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
    mx[i] = mx[i] == -INFINITY ? 0.f : mx[i] * p.scale_log2;  // a row with no key: zeros
  }
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2_ftz(s[j][e] * p.scale_log2 - mx[e >> 1]);
      sum[e >> 1] += s[j][e];
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sum[i] += __shfl_xor_sync(0xffffffff, sum[i], 1);
    sum[i] += __shfl_xor_sync(0xffffffff, sum[i], 2);
    sum[i] = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
  }

  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  fence_async_shared();
  __syncthreads();

  // O = P V: two n-tiles of P (16 keys) are one A fragment; all of them stay live (fenced)
  // until the wgmma group has completed
  float o[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  {
    uint32_t pa[kN / 2][4];
#pragma unroll
    for (int kk = 0; kk < kN / 2; ++kk) {
      pa[kk][0] = pack<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    uint64_t const dv = sw128_desc(sV, 0);
#pragma unroll
    for (int j = 0; j < 32; ++j) cute::warpgroup_fence_operand(o[j / 4][j % 4]);
#pragma unroll
    for (int j = 0; j < 2 * kN; ++j) cute::warpgroup_fence_operand(pa[j / 4][j % 4]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < kN / 2; ++kk) {
      gmma_pv<T>(pa[kk], dv + kk * (2048 >> 4), &o[0][0], std::make_index_sequence<32>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int j = 0; j < 32; ++j) cute::warpgroup_fence_operand(o[j / 4][j % 4]);
#pragma unroll
    for (int j = 0; j < 2 * kN; ++j) cute::warpgroup_fence_operand(pa[j / 4][j % 4]);
  }

  // this warp's 16 output rows into its own (already consumed) Q rows, then 16-byte stores
  int const lr0 = warp * 16 + (lane >> 2);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      auto* chunk = reinterpret_cast<T*>(&sQ[swz(lr0 + i * 8, j)]);
      *reinterpret_cast<uint32_t*>(chunk + c0) =
          pack<T>(o[j][2 * i] * sum[i], o[j][2 * i + 1] * sum[i]);
    }
  }
  __syncwarp();
  auto* out = static_cast<T*>(p.o) + b * p.o_batch + h * p.o_head;
#pragma unroll
  for (int i = lane; i < 16 * kChunks; i += 32) {
    int const lr = i / kChunks, c = i % kChunks;
    int const row = m0 + warp * 16 + lr;
    if (row < p.seq_q && c < d_chunks) {
      *reinterpret_cast<uint4*>(out + row * p.o_row + c * 8) = sQ[swz(warp * 16 + lr, c)];
    }
  }
}

}  // namespace short_seq
}  // namespace hopper
}  // namespace stackfuse
