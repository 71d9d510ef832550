// How fast two threads read the 1.5B's gate, up and down matrices (28 layers, 4.5 bits a
// weight at g64 bf16) in the orders the four-row int8 tile can take them, loads only: the
// memory side of the packed layout (bench/results/README.md, round 25).
//
//   A rows+side    four strided rows of codes (n, n + R/4, ...) and their scales and biases
//                  from two more arrays: MLX's layout, twelve streams a tile
//   B tile-major   per tile of four adjacent rows, each chunk's codes then its scales and
//                  biases: native.pack_layers' layout, one stream a tile
//   C codes only   A without scales and biases
//   D rows+pairs   A with scales and biases interleaved in one array per row
//
//   c++ -O2 -march=native -pthread -o /tmp/tile_streams bench/tile_streams.cpp
//   /tmp/tile_streams [REPEATS RANGE_ROWS PREFETCH_A PREFETCH_B]   defaults 10 64 512 2048
//
// Rows are taken RANGE_ROWS at a time off a shared counter, as the kernel's threads take
// them (use a divisor of 1536 and 8960: 64, 128, 256); the modes interleave in each repeat.
// Prints each mode's median GB/s.
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
using Clock = std::chrono::steady_clock;
static int PF = 512, PFB = 2048;
struct Mat { int N, K; uint8_t *w, *s, *b, *t; };
static __m512i sink[2];
void tileA(const Mat& m, const int* n, __m512i& acc, bool side, bool merged = false) {
  const int rb = m.K / 2, chunks = rb / 64, g = m.K / 64;
  const uint8_t* r[4]; for (int i = 0; i < 4; ++i) r[i] = m.w + size_t(n[i]) * rb;
  for (int c = 0; c < chunks; ++c) {
    for (int i = 0; i < 4; ++i) {
      if (PF) _mm_prefetch((const char*)r[i] + PF + c * 64, _MM_HINT_T0);
      acc = _mm512_add_epi8(acc, _mm512_loadu_si512(r[i] + c * 64));
    }
    if (merged && c % 2 == 1) {
      for (int i = 0; i < 4; ++i) {
        const size_t at = (size_t(n[i]) * g + (c - 1) * 2) * 4;
        acc = _mm512_add_epi8(acc, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(m.s + at))));
      }
    } else if (side && c % 2 == 1) {  // every 2 chunks = 256 codes = 4 groups: 8 B of scales, 8 B of biases per row
      for (int i = 0; i < 4; ++i) {
        const size_t at = (size_t(n[i]) * g + (c - 1) * 2) * 2;
        acc = _mm512_add_epi8(acc, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)(m.s + at))));
        acc = _mm512_add_epi8(acc, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)(m.b + at))));
      }
    }
  }
}
void tileB(const Mat& m, int n0, __m512i& acc) {
  const int rb = m.K / 2, chunks = rb / 64;
  const size_t tile_bytes = size_t(4) * (rb + m.K / 64 * 4);
  const uint8_t* p = m.t + size_t(n0 / 4) * tile_bytes;
  for (int c = 0; c < chunks; ++c) {
    for (int i = 0; i < 4; ++i) {
      if (PFB) _mm_prefetch((const char*)p + PFB + i * 64, _MM_HINT_T0);
      acc = _mm512_add_epi8(acc, _mm512_loadu_si512(p + i * 64));
    }
    p += 256;
    acc = _mm512_add_epi8(acc, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)));  // 4 rows x 2 groups x (s,b) bf16 = 32 B
    p += 32;
  }
}
int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 10;
  const int range_rows = argc > 2 ? atoi(argv[2]) : 64;
  if (argc > 3) PF = atoi(argv[3]);
  if (argc > 4) PFB = atoi(argv[4]);
  // one layer: gate, up (8960 x 1536), down (1536 x 8960); 28 layers -> ~580 MB per mode
  std::vector<Mat> mats;
  for (int l = 0; l < 28; ++l) for (int k = 0; k < 3; ++k) {
    Mat m; m.N = k < 2 ? 8960 : 1536; m.K = k < 2 ? 1536 : 8960;
    size_t cb = size_t(m.N) * m.K / 2, sb = size_t(m.N) * m.K / 64 * 2;
    m.w = (uint8_t*)aligned_alloc(64, cb); m.s = (uint8_t*)aligned_alloc(64, 2 * sb); m.b = (uint8_t*)aligned_alloc(64, sb);
    m.t = (uint8_t*)aligned_alloc(64, cb + 2 * sb);
    memset(m.w, 1, cb); memset(m.s, 2, 2 * sb); memset(m.b, 3, sb); memset(m.t, 4, cb + 2 * sb);
    mats.push_back(m);
  }
  double bytes_all = 0, bytes_codes = 0;
  for (auto& m : mats) { bytes_codes += double(m.N) * m.K / 2; bytes_all += double(m.N) * m.K / 2 + 2.0 * m.N * m.K / 64 * 2; }
  const char* names[4] = {"A rows+side", "B tile-major", "C codes only", "D rows+pairs"};
  std::vector<double> best[4];
  std::atomic<int> gen{0}, done{0}, next{0};
  const Mat* cur = nullptr; int cur_mode = 0; std::atomic<bool> stop{false};
  auto work = [&](int tid) {
    const Mat& m = *cur; const int ranges = m.N / range_rows;
    __m512i acc = _mm512_setzero_si512();
    for (int r; (r = next.fetch_add(1)) < ranges;)
      if (cur_mode == 1) {
        for (int n = r * range_rows; n < (r + 1) * range_rows; n += 4) tileB(m, n, acc);
      } else {
        const int part = range_rows / 4;
        for (int a = r * range_rows; a < r * range_rows + part; ++a) {
          const int n[4] = {a, a + part, a + 2 * part, a + 3 * part};
          tileA(m, n, acc, cur_mode == 0, cur_mode == 3);
        }
      }
    sink[tid] = _mm512_add_epi8(sink[tid], acc);
  };
  std::thread worker([&] {
    int seen = 0;
    while (true) {
      while (gen.load(std::memory_order_acquire) == seen) _mm_pause();
      seen = gen.load();
      if (stop) return;
      work(1);
      done.fetch_add(1, std::memory_order_release);
    }
  });
  for (int rep = 0; rep < reps; ++rep) for (int mode = 0; mode < 4; ++mode) {
    auto t0 = Clock::now();
    for (auto& m : mats) {
      cur = &m; cur_mode = mode; next = 0; done = 0;
      gen.fetch_add(1, std::memory_order_release);
      work(0);
      while (done.load(std::memory_order_acquire) == 0) _mm_pause();
    }
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best[mode].push_back((mode == 2 ? bytes_codes : bytes_all) / s / 1e9);
  }
  stop = true; gen.fetch_add(1); worker.join();
  for (int mode = 0; mode < 4; ++mode) {
    auto v = best[mode]; std::sort(v.begin(), v.end());
    printf("%-14s median %.1f GB/s  (min %.1f max %.1f)\n", names[mode], v[v.size() / 2], v[0], v.back());
  }
}
