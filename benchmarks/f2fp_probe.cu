// Issue rate of the softmax's instruction mix on one GPU, per way of turning fp32 probabilities
// into 16-bit P (session 8: why is our bf16 attention kernel slower than our fp16 one?).
//
// Each thread runs the softmax's inner step on 16 independent values, `iters` times:
//   e = 2^(a * c - d)  (FFMA + MUFU.EX2), sum += e (FADD), a = e * c2 - 1 (FFMA),
// and packs the 16 values into 8 pairs of 16-bit numbers by one of the modes below, XOR-ing the
// packed words into a register that is stored at the end (so nothing is dead code). The time
// per (warp, iteration) at full occupancy tells whether a mode's conversion shares a pipe with
// MUFU.EX2 or costs issue slots.
//
// Build: nvcc -O3 -arch=sm_90a -o f2fp_probe benchmarks/f2fp_probe.cu
// Run:   ./f2fp_probe > f2fp_probe.json
#include <cstdio>
#include <cstdint>

#include <cuda_runtime.h>

enum Mode : int {
  kExpOnly = 0,    // no conversion (the floor)
  kCvtF16 = 1,     // cvt.rn.f16x2.f32   (F2FP.F16.F32.PACK_AB)
  kCvtBf16 = 2,    // cvt.rn.bf16x2.f32  (F2FP.BF16.F32.PACK_AB)
  kIntBf16 = 3,    // bf16 by two integer adds (round half up) and one PRMT
  kTruncBf16 = 4,  // bf16 by one PRMT (truncation; for reference)
  kCvtF16Only = 5, // conversions without the exponentials
  kCvtBf16Only = 6,
  kIntBf16Only = 7,
  kNumModes = 8,
};

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t cvt_f16x2(float lo, float hi) {
  uint32_t r;
  asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t cvt_bf16x2(float lo, float hi) {
  uint32_t r;
  asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t int_bf16x2(float lo, float hi) {
  return __byte_perm(__float_as_uint(lo) + 0x8000u, __float_as_uint(hi) + 0x8000u, 0x7632);
}

__device__ __forceinline__ uint32_t trunc_bf16x2(float lo, float hi) {
  return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}

template <int kMode>
__global__ void probe(float* out, uint32_t* out_bits, int iters, float c, float d, float c2) {
  float a[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) a[i] = -0.01f * float((threadIdx.x + i) % 97);
  float sum = 0.f;
  uint32_t bits = 0;
  constexpr bool kExp = !(kMode == kCvtF16Only || kMode == kCvtBf16Only || kMode == kIntBf16Only);
  for (int it = 0; it < iters; ++it) {
    float e[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      e[i] = kExp ? ex2(a[i] * c - d) : a[i] * c - d;
      sum += e[i];
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float lo = e[2 * k], hi = e[2 * k + 1];
      if constexpr (kMode == kCvtF16 || kMode == kCvtF16Only) bits ^= cvt_f16x2(lo, hi);
      if constexpr (kMode == kCvtBf16 || kMode == kCvtBf16Only) bits ^= cvt_bf16x2(lo, hi);
      if constexpr (kMode == kIntBf16 || kMode == kIntBf16Only) bits ^= int_bf16x2(lo, hi);
      if constexpr (kMode == kTruncBf16) bits ^= trunc_bf16x2(lo, hi);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) a[i] = e[i] * c2 - 1.f;
  }
  int const t = blockIdx.x * blockDim.x + threadIdx.x;
  out[t] = sum;
  out_bits[t] = bits;
}

using Kernel = void (*)(float*, uint32_t*, int, float, float, float);

int main() {
  Kernel const kernels[kNumModes] = {probe<0>, probe<1>, probe<2>, probe<3>,
                                     probe<4>, probe<5>, probe<6>, probe<7>};
  char const* names[kNumModes] = {"exp_only",       "exp+cvt_f16x2", "exp+cvt_bf16x2",
                                  "exp+iadd_prmt_bf16", "exp+prmt_trunc_bf16", "cvt_f16x2_only",
                                  "cvt_bf16x2_only",    "iadd_prmt_bf16_only"};
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int const threads = 512, blocks = sms * 4, iters = 4096;
  float* out;
  uint32_t* bits;
  cudaMalloc(&out, sizeof(float) * threads * blocks);
  cudaMalloc(&bits, sizeof(uint32_t) * threads * blocks);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  printf("{\"sms\": %d, \"blocks\": %d, \"threads\": %d, \"iters\": %d, \"modes\": {\n", sms,
         blocks, threads, iters);
  for (int m = 0; m < kNumModes; ++m) {
    float best = 1e30f;
    for (int rep = 0; rep < 7; ++rep) {
      cudaEventRecord(e0);
      kernels[m]<<<blocks, threads>>>(out, bits, iters, 0.9f, 0.1f, 0.5f);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0.f;
      cudaEventElapsedTime(&ms, e0, e1);
      if (rep > 0 && ms < best) best = ms;
    }
    // warp-iterations per SM sub-partition: blocks * threads / 32 / (sms * 4)
    double const warp_iters = double(blocks) * threads / 32.0 / (sms * 4.0) * iters;
    printf("  \"%s\": {\"ms\": %.4f, \"ns_per_warp_iter_per_smsp\": %.4f}%s\n", names[m], best,
           best * 1e6 / warp_iters, m + 1 < kNumModes ? "," : "");
  }
  cudaError_t err = cudaDeviceSynchronize();
  printf("}, \"error\": \"%s\"}\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
