// Short-sequence attention for the stacked layout: every key of a head (at most 128) in shared
// memory, one CTA of 4 warps per 64 query rows of one (batch, head), FlashAttention-2-style
// register tiles on mma.sync m16n8k16. Why: at one key tile per CTA (BERT-base: S 128) the
// example's TMA/warp-specialized kernels pay fixed costs per CTA (barriers, descriptor
// prefetch, a producer warpgroup) and hold one 128-row tile per SM; this kernel is small
// (~130 registers, 40 KB of shared memory), so 3 CTAs share an SM and every load of a wave is in
// flight at once. No online softmax is needed: the whole key range is one tile.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace stackfuse {
namespace hopper {
namespace short_seq {

constexpr int kHeadDim = 64;   // tile head dim: 8 chunks of 16 bytes per row
constexpr int kMaxKeys = 128;  // keys held in shared memory
constexpr int kChunks = kHeadDim / 8;
// kWarps warps of 16 query rows each per CTA: 4 (64 rows, 3-4 CTAs per SM) or 8 (128 rows,
// K/V read once per head, 2 CTAs per SM); at most 48 KB of shared memory either way
template <int kWarps>
constexpr int smem_bytes() {
  return (16 * kWarps + 2 * kMaxKeys) * kHeadDim * 2;
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

// 16-byte chunk c of row r lives at chunk (c ^ (r & 7)): ldmatrix's 8 rows hit 8 bank groups
__device__ __forceinline__ int swz(int row, int chunk) { return row * kChunks + (chunk ^ (row & 7)); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <class T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
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

// grid: (ceil(seq_q / (16 kWarps)), q heads, batch); block: 32 kWarps threads; dynamic smem
// smem_bytes<kWarps>(). Loads: Q and K as one cp.async group, V as a second one, so V is in
// flight while Q K^T and the softmax run. The output goes through this warp's Q rows in shared
// memory (no other warp reads them) and leaves as coalesced 16-byte stores.
template <class T, bool kCausal, int kWarps>
__global__ void __launch_bounds__(32 * kWarps, kWarps == 4 ? 3 : 2) kernel(Params const p) {
  constexpr int kRows = 16 * kWarps;
  constexpr int kThreads = 32 * kWarps;
  extern __shared__ uint4 smem[];
  uint4* sQ = smem;
  uint4* sK = sQ + kRows * kChunks;
  uint4* sV = sK + kMaxKeys * kChunks;

  int const m0 = blockIdx.x * kRows;
  int const h = blockIdx.y, b = blockIdx.z;
  int const kv = h / p.groups;
  int const tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  auto const* q = static_cast<const T*>(p.q) + b * p.q_batch + h * p.q_head + m0 * p.q_row;
  auto const* k = static_cast<const T*>(p.k) + b * p.k_batch + kv * p.k_head;
  auto const* v = static_cast<const T*>(p.v) + b * p.v_batch + kv * p.v_head;
  int const q_rows = min(kRows, p.seq_q - m0);
  int const d_chunks = p.head_dim / 8;  // columns past head_dim are zero-filled

  for (int i = tid; i < kRows * kChunks; i += kThreads) {
    int const r = i / kChunks, c = i % kChunks;
    bool const ok = r < q_rows && c < d_chunks;
    cp_async16(&sQ[swz(r, c)], ok ? q + r * p.q_row + c * 8 : q, ok);
  }
  for (int i = tid; i < kMaxKeys * kChunks; i += kThreads) {
    int const r = i / kChunks, c = i % kChunks;
    bool const ok = r < p.seq_kv && c < d_chunks;
    cp_async16(&sK[swz(r, c)], ok ? k + r * p.k_row + c * 8 : k, ok);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  for (int i = tid; i < kMaxKeys * kChunks; i += kThreads) {
    int const r = i / kChunks, c = i % kChunks;
    bool const ok = r < p.seq_kv && c < d_chunks;
    cp_async16(&sV[swz(r, c)], ok ? v + r * p.v_row + c * 8 : v, ok);
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 1;\n" ::: "memory");
  __syncthreads();

  // S = Q K^T for this warp's 16 rows and all 128 keys (16 n-tiles of 8 keys)
  uint32_t qf[4][4];
  for (int ks = 0; ks < 4; ++ks) {
    ldsm_x4(qf[ks], &sQ[swz(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, ks * 2 + (lane >> 4))]);
  }
  float s[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int n2 = 0; n2 < 8; ++n2) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t kb[4];
      ldsm_x4(kb, &sK[swz(n2 * 16 + (lane & 7) + (lane >> 4) * 8, ks * 2 + ((lane >> 3) & 1))]);
      mma<T>(s[2 * n2], qf[ks], kb[0], kb[1]);
      mma<T>(s[2 * n2 + 1], qf[ks], kb[2], kb[3]);
    }
  }

  // mask, softmax over the whole key range (rows r0 and r0 + 8 of this thread)
  int const r0 = m0 + warp * 16 + (lane >> 2);
  int const c0 = (lane & 3) * 2;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int const col = j * 8 + c0 + (e & 1);
      int const row = r0 + (e >> 1) * 8;
      bool masked = col >= p.seq_kv;
      if constexpr (kCausal) masked = masked || col > row + p.causal_offset;
      if (masked) s[j][e] = -INFINITY;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
    }
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
    mx[i] = mx[i] == -INFINITY ? 0.f : mx[i] * p.scale_log2;  // a row with no key: zeros
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2f(s[j][e] * p.scale_log2 - mx[e >> 1]);
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
  __syncthreads();

  // O = P V: P's accumulator layout is the A operand of the next mma (two n-tiles = k 16)
  float o[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    uint32_t a[4] = {pack<T>(s[2 * kk][0], s[2 * kk][1]), pack<T>(s[2 * kk][2], s[2 * kk][3]),
                     pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                     pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int d2 = 0; d2 < 4; ++d2) {
      uint32_t vb[4];
      ldsm_x4_t(vb, &sV[swz(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, d2 * 2 + (lane >> 4))]);
      mma<T>(o[2 * d2], a, vb[0], vb[1]);
      mma<T>(o[2 * d2 + 1], a, vb[2], vb[3]);
    }
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
