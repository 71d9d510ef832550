// Two builds of the int8-activation kernels (kernels_q8.cpp) in one process, through
// their driver qmm_rows_q8, interleaved: µs per call at M = 1..4, the pair ratio A / B,
// and whether the outputs are bitwise equal. Driven by bench/tile_ab.py, which compiles
// this file with each build's sources renamed into namespaces va and vb (VA, VB name them).
//
//   tile_ab BITS N K THREADS ROUNDS
//
// BITS 4 runs the packed four-row tiles, 8 the 8-bit tiles; the matrix is N x K, g64, fp16
// scales, random codes. Small N stays in cache (the kernel's compute), large N streams
// from DRAM (what a model's step does). THREADS 1 or 2 (each thread half the rows).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#define specmlx va
#include VA
#undef specmlx
#define specmlx vb
#include VB
#undef specmlx

struct Data {
  std::vector<uint8_t> w, packed;
  std::vector<uint16_t> scales, biases;
  std::vector<int8_t> xq;
  std::vector<float> xd, xs, y;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Job, typename Isa, typename Rows>
double median_seconds(Rows rows, Isa isa, Data& d, int bits, int M, int N, int K, int threads, int reps) {
  Job j{};
  j.w = reinterpret_cast<const uint32_t*>(d.w.data());
  j.scales = d.scales.data();
  j.biases = d.biases.data();
  j.stype = decltype(j.stype)(2);  // ScaleType::f16
  j.y = d.y.data();
  j.M = M, j.N = N, j.K = K, j.group_size = 64, j.bits = bits;
  j.xq = d.xq.data(), j.xd = d.xd.data(), j.xs = d.xs.data();
  j.ldq = K, j.ldd = K / 32, j.ldg = K / 64;
  j.packed = bits == 4 ? d.packed.data() : nullptr;
  std::vector<double> seconds;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (threads == 2) {
      std::thread other([&] { rows(isa, j, N / 2, N); });
      rows(isa, j, 0, N / 2);
      other.join();
    } else {
      rows(isa, j, 0, N);
    }
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return median(seconds);
}

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: tile_ab BITS N K THREADS ROUNDS\n");
    return 2;
  }
  const int bits = std::atoi(argv[1]), N = std::atoi(argv[2]), K = std::atoi(argv[3]);
  const int threads = std::atoi(argv[4]), rounds = std::atoi(argv[5]);
  if ((bits != 4 && bits != 8) || N % 8 || K % 128 || threads < 1 || threads > 2 || rounds < 1) {
    std::fprintf(stderr, "BITS 4 or 8, N a multiple of 8, K of 128, THREADS 1 or 2\n");
    return 2;
  }
  std::mt19937 rng(0);
  Data d;
  d.w.resize(size_t(N) * K * bits / 8);
  for (auto& b : d.w) b = uint8_t(rng());
  d.scales.assign(size_t(N) * K / 64, 0x2c00);  // 1/16
  d.biases.assign(size_t(N) * K / 64, 0xbc00);  // -1
  if (bits == 4) {  // both builds read the packed layout the same way
    d.packed.resize(size_t(N / 4) * va::packed_tile_bytes(K, 64, va::ScaleType::f16));
    va::pack_quad(d.w.data(), reinterpret_cast<const uint8_t*>(d.scales.data()),
                  reinterpret_cast<const uint8_t*>(d.biases.data()), N, K, 64, va::ScaleType::f16, d.packed.data());
  }
  d.xq.resize(size_t(4) * K);
  for (auto& q : d.xq) q = int8_t(int(rng() % 255) - 127);
  d.xd.assign(size_t(4) * K / 32, 0.01f);
  d.xs.assign(size_t(4) * K / 64, 0.3f);
  d.y.resize(size_t(4) * N);
  const double gb = double(bits == 4 ? d.packed.size() : d.w.size() + 4 * d.scales.size()) / 1e9;
  const int reps = std::max(3, int(2e8 / (double(N) * K)));  // ~0.1 s of work a timing
  std::printf("%d-bit %dx%d, %d thread(s), %d rounds of %d calls, %.1f MB\n", bits, N, K, threads, rounds, reps, gb * 1e3);
  for (int M = 1; M <= 4; ++M) {
    std::vector<double> a, b, ratio;
    std::vector<float> ya, yb;
    for (int r = 0; r < rounds; ++r) {
      a.push_back(median_seconds<va::QmmJob>(va::qmm_rows_q8, va::Isa::avx2, d, bits, M, N, K, threads, reps));
      ya.assign(d.y.begin(), d.y.begin() + size_t(M) * N);
      b.push_back(median_seconds<vb::QmmJob>(vb::qmm_rows_q8, vb::Isa::avx2, d, bits, M, N, K, threads, reps));
      yb.assign(d.y.begin(), d.y.begin() + size_t(M) * N);
      ratio.push_back(a.back() / b.back());
    }
    const bool same = std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)) == 0;
    std::printf("M %d: A %.1f us, B %.1f us (%.1f GB/s); A / B median %.3f (%.3f-%.3f); outputs %s\n", M,
                median(a) * 1e6, median(b) * 1e6, gb / median(b), median(ratio),
                *std::min_element(ratio.begin(), ratio.end()), *std::max_element(ratio.begin(), ratio.end()),
                same ? "bitwise equal" : "DIFFER");
  }
}
