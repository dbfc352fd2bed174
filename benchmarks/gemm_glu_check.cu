// The paired SwiGLU configuration on a GPU, without TVM or torch: against a naive float32
// reference of silu(x Wg^T) * (x Wu^T) (the interleave done here, on the host), at Llama's
// 2048 x 5632 x 2048 and at extents that leave partial tiles (M 77, 333, 1000, 4099; I 136 to
// 1000), both weight layouts; a guard region after D must stay untouched, and a bias must be
// refused. Build (here, ~50 s on 2 cores) and run (on an sm_90 GPU):
//
//   CI=$(python -c "import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / 'source')")
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG -DCUTLASS_ENABLE_TENSOR_CORE_MMA=1 -w \
//     -gencode=arch=compute_90a,code=sm_90a -Iworker/kernels_glu -Iworker/kernels \
//     -I$CI/include -I$CI/tools/util/include -o gemm_glu_check benchmarks/gemm_glu_check.cu
//   ./gemm_glu_check     # prints ALL OK (exit 0) or FAILURES with the first wrong element
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cmath>
#include "gemm_sm90_glu.cuh"

using namespace stackfuse::gemm;
using H = cutlass::half_t;
using BF = cutlass::bfloat16_t;
using PP = Config<H, true, 128, 128, 64, 1, 2, Pingpong, cutlass::gemm::PersistentScheduler, SwiGluPaired, false>;
using CO = Config<H, true, 128, 256, 64, 2, 1, Cooperative, cutlass::gemm::PersistentScheduler, SwiGluPaired, false>;
using PPN = Config<BF, false, 128, 128, 64, 1, 2, Pingpong, cutlass::gemm::PersistentScheduler, SwiGluPaired, false>;

template <class T>
__global__ void ref_kernel(const T* x, const T* wg, const T* wu, float* out, int M, int I, int K) {
  int i = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  if (i >= I) return;
  float g = 0, u = 0;
  for (int k = 0; k < K; ++k) {
    float a = float(x[(long)m * K + k]);
    g += a * float(wg[(long)i * K + k]);
    u += a * float(wu[(long)i * K + k]);
  }
  out[(long)m * I + i] = g / (1.f + expf(-g)) * u;
}

void* my_alloc(size_t b, int, void*) { void* p; return cudaMalloc(&p, b) == cudaSuccess ? p : nullptr; }
void my_free(void* p, int, void*) { cudaFree(p); }

template <class Cfg, class T>
bool check(const char* name, int M, int I, int K, bool kmajor, bool timeit) {
  std::vector<T> x((size_t)M * K), wg((size_t)I * K), wu((size_t)I * K), wgu((size_t)2 * I * K);
  srand(M + I + K);
  auto rnd = [] { return (rand() / (float)RAND_MAX - 0.5f) * 2.f; };
  for (auto& v : x) v = T(rnd());
  for (auto& v : wg) v = T(rnd() / sqrtf((float)K) * 2.f);
  for (auto& v : wu) v = T(rnd() / sqrtf((float)K) * 2.f);
  // Wgu [2I, K]: row 16j+i = Wg[8j+i] (i<8), Wu[8j+i-8] (i>=8); [K, 2I] when !kmajor
  for (int r = 0; r < 2 * I; ++r) {
    int j = r / 16, i = r % 16;
    const T* src = i < 8 ? &wg[(size_t)(8 * j + i) * K] : &wu[(size_t)(8 * j + i - 8) * K];
    for (int k = 0; k < K; ++k) {
      if (kmajor) wgu[(size_t)r * K + k] = src[k];
      else wgu[(size_t)k * 2 * I + r] = src[k];
    }
  }
  T *dx, *dwg, *dwu, *dwgu, *dd; float* dref;
  size_t guard = 4096;
  cudaMalloc(&dx, x.size() * sizeof(T)); cudaMalloc(&dwg, wg.size() * sizeof(T));
  cudaMalloc(&dwu, wu.size() * sizeof(T)); cudaMalloc(&dwgu, wgu.size() * sizeof(T));
  cudaMalloc(&dd, ((size_t)M * I + guard) * sizeof(T)); cudaMalloc(&dref, (size_t)M * I * 4);
  cudaMemcpy(dx, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice);
  cudaMemcpy(dwg, wg.data(), wg.size() * sizeof(T), cudaMemcpyHostToDevice);
  cudaMemcpy(dwu, wu.data(), wu.size() * sizeof(T), cudaMemcpyHostToDevice);
  cudaMemcpy(dwgu, wgu.data(), wgu.size() * sizeof(T), cudaMemcpyHostToDevice);
  cudaMemset(dd, 0x7b, ((size_t)M * I + guard) * sizeof(T));
  ref_kernel<<<dim3((I + 127) / 128, M), 128>>>(dx, dwg, dwu, dref, M, I, K);
  Problem p{};
  p.a = dx; p.b = dwgu; p.d = dd; p.m = M; p.n = 2 * I; p.k = K; p.l = 1;
  p.device_id = 0; p.swizzle = 1; p.alloc = my_alloc; p.free = my_free;
  cudaError_t ce;
  Status st = launch<Cfg>(p, 0, &ce);
  cudaError_t e2 = cudaDeviceSynchronize();
  if (st != Status::kOk || e2 != cudaSuccess) {
    printf("%s M=%d I=%d K=%d: status %d %s %s\n", name, M, I, K, (int)st, cudaGetErrorString(ce), cudaGetErrorString(e2));
    return false;
  }
  std::vector<T> d((size_t)M * I + guard); std::vector<float> ref((size_t)M * I);
  cudaMemcpy(d.data(), dd, d.size() * sizeof(T), cudaMemcpyDeviceToHost);
  cudaMemcpy(ref.data(), dref, ref.size() * 4, cudaMemcpyDeviceToHost);
  double maxerr = 0, maxref = 0; size_t bad = 0, first_bad = (size_t)-1;
  for (size_t i = 0; i < ref.size(); ++i) {
    double err = fabs((double)float(d[i]) - ref[i]);
    maxref = fmax(maxref, fabs(ref[i]));
    if (!(err <= 2e-2 + 2e-2 * fabs(ref[i]))) { if (!bad) first_bad = i; ++bad; }
    if (!(err <= maxerr)) maxerr = err;
  }
  T sentinel; memset(&sentinel, 0x7b, sizeof(T));
  size_t guard_bad = 0;
  for (size_t i = ref.size(); i < d.size(); ++i) guard_bad += memcmp(&d[i], &sentinel, sizeof(T)) != 0;
  printf("%s M=%d I=%d K=%d %s: max abs err %.3g (max |ref| %.3g), %zu bad", name, M, I, K,
         kmajor ? "[2I,K]" : "[K,2I]", maxerr, maxref, bad);
  if (bad) printf(" (first at m=%zu i=%zu: got %f want %f)", first_bad / I, first_bad % I, float(d[first_bad]), ref[first_bad]);
  printf(", %zu guard elements written\n", guard_bad);
  // a bias, a C or a beta is refused
  Problem q = p; q.bias = dx;
  printf("   with a bias: status %d (1 = unsupported)\n", (int)launch<Cfg>(q, 0, &ce));
  if (timeit) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 10; ++i) launch<Cfg>(p, 0, &ce);
    cudaEventRecord(a);
    int iters = 100;
    for (int i = 0; i < iters; ++i) launch<Cfg>(p, 0, &ce);
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); ms /= iters;
    printf("   time %.1f us, %.0f TFLOP/s\n", ms * 1e3, 2.0 * M * 2 * I * K / (ms * 1e-3) / 1e12);
  }
  cudaFree(dx); cudaFree(dwg); cudaFree(dwu); cudaFree(dwgu); cudaFree(dd); cudaFree(dref);
  return bad == 0 && guard_bad == 0;
}

int main() {
  bool ok = true;
  ok &= check<PP, H>("pingpong_128x128_c1x2 fp16", 2048, 5632, 2048, true, true);
  ok &= check<CO, H>("coop_128x256 fp16", 2048, 5632, 2048, true, true);
  ok &= check<PP, H>("pingpong_128x128_c1x2 fp16", 1000, 344, 200, true, false);
  ok &= check<CO, H>("coop_128x256 fp16", 77, 136, 64, true, false);
  ok &= check<CO, H>("coop_128x256 fp16", 4099, 1000, 96, true, false);
  ok &= check<PPN, BF>("pingpong_128x128_c1x2 bf16 n-major", 2048, 5632, 2048, false, true);
  ok &= check<PPN, BF>("pingpong_128x128_c1x2 bf16 n-major", 333, 200, 136, false, false);
  printf(ok ? "ALL OK\n" : "FAILURES\n");
  return ok ? 0 : 1;
}
