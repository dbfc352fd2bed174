// Host check of the paired SwiGLU epilogue's pairing (worker/kernels_glu/gemm_sm90_glu.cuh), for
// every thread of the tiled MMA of several configurations: the accumulator coordinates the
// epilogue reads as (gate, gate + 1, up, up + 1) for each store are (m, n), (m, n + 1),
// (m, n + 8), (m, n + 9) with n even and n % 16 < 8, and the stores cover every element of the
// tile's [TileM, TileN / 2] output exactly once. The loop is the epilogue's, on the host.
// Prints "ALL OK" and exits 0 when every configuration passes (tests/worker/test_gemm.py).
#include <cstdio>
#include <vector>

#include "gemm_sm90_glu.cuh"

using namespace stackfuse::gemm;
using namespace cute;
using H = cutlass::half_t;

template <class Cfg>
bool check(const char* name) {
  using TiledMma = typename Cfg::Mainloop::TiledMma;
  using Tile = typename Cfg::TileShape;
  using Epi = SwiGluPairedEpilogue<H>;
  constexpr int TM = size<0>(Tile{}), TN = size<1>(Tile{});
  TiledMma tiled_mma;
  int M = 10 * TM, N = 10 * TN, mc = 1, nc = 2;  // the tile at block (1, 2)
  std::vector<int> hits(TM * (TN / 2), 0);
  int bad = 0;
  auto acc = partition_fragment_C(tiled_mma, take<0, 2>(Tile{}));  // as the mainloop's
  for (int t = 0; t < int(size(tiled_mma)); ++t) {
    auto thr = tiled_mma.get_thread_slice(t);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(Tile{}),
                           make_coord(mc, nc));
    Tensor tCcD = thr.partition_C(cD);
    for (int mn = 0; mn < size<2>(acc); ++mn)
      for (int mm = 0; mm < size<1>(acc); ++mm)
        for (int v = 0; v < size<0, 2>(acc); v += 2)
          for (int r = 0; r < 2; ++r) {
            auto g0 = tCcD(make_coord(make_coord(0, r, v), mm, mn));
            auto g1 = tCcD(make_coord(make_coord(1, r, v), mm, mn));
            auto u0 = tCcD(make_coord(make_coord(0, r, v + 1), mm, mn));
            auto u1 = tCcD(make_coord(make_coord(1, r, v + 1), mm, mn));
            int m = get<0>(g0), n = get<1>(g0);
            bool ok = get<0>(g1) == m && get<1>(g1) == n + 1 && get<0>(u0) == m &&
                      get<1>(u0) == n + 8 && get<0>(u1) == m && get<1>(u1) == n + 9 &&
                      n % 2 == 0 && n % 16 < 8;
            int lm = m - mc * TM, o = Epi::output_column(n) - Epi::output_column(nc * TN);
            if (!ok || lm < 0 || lm >= TM || o < 0 || o + 1 >= TN / 2) {
              if (!bad) printf("%s: thread %d, (%d, %d, %d, %d): gate (%d, %d)\n", name, t, r, v, mm, mn, m, n);
              ++bad;
              continue;
            }
            hits[lm * (TN / 2) + o] += 1;
            hits[lm * (TN / 2) + o + 1] += 1;
          }
  }
  int once = 0;
  for (int h : hits) once += h == 1;
  printf("%s: %d threads, %d wrong pairs, %d of %d output elements written once\n", name,
         int(size(tiled_mma)), bad, once, int(hits.size()));
  return bad == 0 && once == int(hits.size());
}

template <class E, bool K, int TM, int TN, int CM, int CN, class S>
using Paired = Config<E, K, TM, TN, 64, CM, CN, S, cutlass::gemm::PersistentScheduler,
                      SwiGluPaired, false>;

int main() {
  bool ok = true;
  ok &= check<Paired<H, true, 128, 128, 1, 2, Pingpong>>("pingpong_128x128_c1x2");
  ok &= check<Paired<H, true, 128, 192, 2, 1, Pingpong>>("pingpong_128x192");
  ok &= check<Paired<H, true, 64, 256, 2, 1, Pingpong>>("pingpong_64x256");
  ok &= check<Paired<H, true, 128, 256, 2, 1, Cooperative>>("coop_128x256");
  ok &= check<Paired<H, false, 256, 128, 1, 2, Cooperative>>("coop_256x128_c1x2 [K, N]");
  ok &= check<Paired<cutlass::bfloat16_t, true, 128, 128, 2, 1, Cooperative>>("coop_128x128 bf16");
  printf(ok ? "ALL OK\n" : "FAILURES\n");
  return ok ? 0 : 1;
}
