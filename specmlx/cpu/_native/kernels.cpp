// The INT4 (and INT8) kernels. Every ISA-specific function carries a target attribute, so the file
// is compiled for baseline x86-64 and the AVX2/AVX-512 code runs only after detect_isa()
// found the CPU supports it (never -march=native: the .so must run on any x86-64).
//
// Layout recap (MLX affine, 4 bits): row n of W is K/8 uint32 words; code k sits in bits
// 4*(k%8)..4*(k%8)+3 of word k/8, and dequantizes to scales[n][k/gs] * code + biases[n][k/gs].
// With 8 bits a row is K/4 words, i.e. simply K bytes in k order.
#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

namespace specmlx {
namespace {

// x rows kept hot in L2 while a thread sweeps its output rows (floats; 1 MiB).
constexpr size_t kL2Floats = size_t(1) << 18;

// One tile: output rows n0 and n1 (n1 == n0: a lone row, computed twice and stored once)
// for x rows m0 .. m0 + MT - 1.
using TileFn = void (*)(const QmmJob&, int n0, int n1, int m0);

// ---------------------------------------------------------------------------------------
// Scalar: plain multiply-adds on unpacked x, for CPUs without AVX2 and as the reference
// for the vector paths' layouts.
constexpr int kScalarMaxRows = 4;

void tile_scalar(const QmmJob& j, int n0, int n1, int m0, int mt) {
  const int per_word = 32 / j.bits, words = j.K / per_word, groups = j.K / j.group_size;
  const int gwords = j.group_size / per_word;
  const uint32_t mask = (1u << j.bits) - 1;
  for (int r = 0; r < (n1 == n0 ? 1 : 2); ++r) {
    const int n = r == 0 ? n0 : n1;
    const uint32_t* w = j.w + size_t(n) * words;
    float acc[kScalarMaxRows] = {};
    for (int g = 0; g < groups; ++g) {
      const size_t si = size_t(n) * groups + g;
      const float s = scale_at(j.scales, si, j.stype), b = scale_at(j.biases, si, j.stype);
      for (int i = 0; i < gwords; ++i) {
        const uint32_t word = w[g * gwords + i];
        const int k = (g * gwords + i) * per_word;
        for (int c = 0; c < per_word; ++c) {
          const float v = s * float((word >> (j.bits * c)) & mask) + b;
          for (int m = 0; m < mt; ++m) {
            acc[m] += v * j.x[size_t(m0 + m) * j.ldx + k + c];
          }
        }
      }
    }
    for (int m = 0; m < mt; ++m) {
      j.y[size_t(m0 + m) * j.N + n] = acc[m];
    }
  }
}

// ---------------------------------------------------------------------------------------
// Vector layout shared by AVX2 (L = 8 lanes) and AVX-512 (L = 16): a group of G = gs/8
// words is cut into blocks of B = min(G, L) words. A block is loaded (or broadcast C = L/B
// times) into one register, so lane l holds word l % B; shifting lane l right by
// 4 * (l / B) and then by 4*C per step v yields codes for k = 8*(l % B) + v*C + l / B.
// pack_index (qmm.cpp) stores x in exactly that order, so each step is one full vector of
// codes against one contiguous vector of x: no shuffles of x in the inner loop.
template <int L, int G>
struct Layout {
  static constexpr int B = G < L ? G : L;  // words per block
  static constexpr int C = L / B;          // copies of the block in a register
  static constexpr int NB = G / B;         // blocks per group
  static constexpr int NV = 8 / C;         // vectors (shift steps) per block
  static constexpr int GS = 8 * G;         // group size in codes
};

// ---------------------------------------------------------------------------------------
// AVX-512: the 16-entry table fits one zmm register, so vpermps turns 16 codes into 16
// dequantized weights in one instruction (it reads only the low 4 bits of each index,
// which saves masking). Two output rows share every x load; MT x rows share every weight.
constexpr int kAvx512MaxRows = 8;  // 2 * 8 accumulators + tables/codes fit 32 registers

template <int C>
SPECMLX_AVX512 inline __m512i load_block16(const uint32_t* p) {
  if constexpr (C == 1) {
    return _mm512_loadu_si512(p);
  } else if constexpr (C == 2) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

template <int MT, int G>
SPECMLX_AVX512 void tile_avx512(const QmmJob& j, int n0, int n1, int m0) {
  using Lay = Layout<16, G>;
  const int words = j.K / 8, groups = j.K / Lay::GS;
  const uint32_t* w0 = j.w + size_t(n0) * words;
  const uint32_t* w1 = j.w + size_t(n1) * words;
  const size_t s0 = size_t(n0) * groups, s1 = size_t(n1) * groups;
  const float* x = j.x + size_t(m0) * j.ldx;
  const __m512 iota =
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) int spread_lanes[16];
  for (int l = 0; l < 16; ++l) {
    spread_lanes[l] = 4 * (l / Lay::B);
  }
  const __m512i spread = _mm512_load_si512(spread_lanes);

  __m512 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) {
    acc0[m] = _mm512_setzero_ps();
    acc1[m] = _mm512_setzero_ps();
  }
  for (int g = 0; g < groups; ++g) {
    const __m512 t0 = _mm512_fmadd_ps(_mm512_set1_ps(scale_f16c(j.scales, s0 + g, j.stype)), iota,
                                      _mm512_set1_ps(scale_f16c(j.biases, s0 + g, j.stype)));
    const __m512 t1 = _mm512_fmadd_ps(_mm512_set1_ps(scale_f16c(j.scales, s1 + g, j.stype)), iota,
                                      _mm512_set1_ps(scale_f16c(j.biases, s1 + g, j.stype)));
    const float* xg = x + size_t(g) * Lay::GS;
    for (int b = 0; b < Lay::NB; ++b) {
      __m512i q0 = load_block16<Lay::C>(w0 + g * G + b * Lay::B);
      __m512i q1 = load_block16<Lay::C>(w1 + g * G + b * Lay::B);
      if constexpr (Lay::C > 1) {
        q0 = _mm512_srlv_epi32(q0, spread);
        q1 = _mm512_srlv_epi32(q1, spread);
      }
      for (int v = 0; v < Lay::NV; ++v) {
        const __m512 f0 = _mm512_permutexvar_ps(q0, t0);
        const __m512 f1 = _mm512_permutexvar_ps(q1, t1);
        const float* xv = xg + (b * Lay::NV + v) * 16;
        for (int m = 0; m < MT; ++m) {
          const __m512 xm = _mm512_loadu_ps(xv + size_t(m) * j.ldx);
          acc0[m] = _mm512_fmadd_ps(f0, xm, acc0[m]);
          acc1[m] = _mm512_fmadd_ps(f1, xm, acc1[m]);
        }
        q0 = _mm512_srli_epi32(q0, 4 * Lay::C);
        q1 = _mm512_srli_epi32(q1, 4 * Lay::C);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float* y = j.y + size_t(m0 + m) * j.N;
    y[n0] = _mm512_reduce_add_ps(acc0[m]);
    if (n1 != n0) {
      y[n1] = _mm512_reduce_add_ps(acc1[m]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// AVX2: vpermps on 8 lanes holds only half of the 16-entry table (a lookup would need two
// permutes and a blend), so codes are masked, converted and scaled with one FMA instead:
// four cheap ops per 8 weights. Only 16 ymm registers: 2 * 4 accumulators.
constexpr int kAvx2MaxRows = 4;

SPECMLX_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int C>
SPECMLX_AVX2 inline __m256i load_block8(const uint32_t* p) {
  if constexpr (C == 1) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

template <int MT, int G>
SPECMLX_AVX2 void tile_avx2(const QmmJob& j, int n0, int n1, int m0) {
  using Lay = Layout<8, G>;
  const int words = j.K / 8, groups = j.K / Lay::GS;
  const uint32_t* w0 = j.w + size_t(n0) * words;
  const uint32_t* w1 = j.w + size_t(n1) * words;
  const size_t s0 = size_t(n0) * groups, s1 = size_t(n1) * groups;
  const float* x = j.x + size_t(m0) * j.ldx;
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);  // used when C == 2

  __m256 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) {
    acc0[m] = _mm256_setzero_ps();
    acc1[m] = _mm256_setzero_ps();
  }
  for (int g = 0; g < groups; ++g) {
    const __m256 sc0 = _mm256_set1_ps(scale_f16c(j.scales, s0 + g, j.stype));
    const __m256 bi0 = _mm256_set1_ps(scale_f16c(j.biases, s0 + g, j.stype));
    const __m256 sc1 = _mm256_set1_ps(scale_f16c(j.scales, s1 + g, j.stype));
    const __m256 bi1 = _mm256_set1_ps(scale_f16c(j.biases, s1 + g, j.stype));
    const float* xg = x + size_t(g) * Lay::GS;
    for (int b = 0; b < Lay::NB; ++b) {
      __m256i q0 = load_block8<Lay::C>(w0 + g * G + b * Lay::B);
      __m256i q1 = load_block8<Lay::C>(w1 + g * G + b * Lay::B);
      if constexpr (Lay::C > 1) {
        q0 = _mm256_srlv_epi32(q0, spread);
        q1 = _mm256_srlv_epi32(q1, spread);
      }
      for (int v = 0; v < Lay::NV; ++v) {
        const __m256 f0 =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low4)), sc0, bi0);
        const __m256 f1 =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low4)), sc1, bi1);
        const float* xv = xg + (b * Lay::NV + v) * 8;
        for (int m = 0; m < MT; ++m) {
          const __m256 xm = _mm256_loadu_ps(xv + size_t(m) * j.ldx);
          acc0[m] = _mm256_fmadd_ps(f0, xm, acc0[m]);
          acc1[m] = _mm256_fmadd_ps(f1, xm, acc1[m]);
        }
        q0 = _mm256_srli_epi32(q0, 4 * Lay::C);
        q1 = _mm256_srli_epi32(q1, 4 * Lay::C);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float* y = j.y + size_t(m0 + m) * j.N;
    y[n0] = hsum256(acc0[m]);
    if (n1 != n0) {
      y[n1] = hsum256(acc1[m]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// 8 bits: codes are bytes in k order, so x needs no packing; widen 16 (8) bytes to
// int32 lanes, convert, scale with one FMA. A 256-entry table would not fit a register,
// and 8-bit weights are twice the bytes, so these tiles are bound by memory anyway.
template <int MT>
SPECMLX_AVX512 void tile8_avx512(const QmmJob& j, int n0, int n1, int m0) {
  const int gs = j.group_size, groups = j.K / gs;
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n0) * j.K;
  const uint8_t* w1 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n1) * j.K;
  const size_t s0 = size_t(n0) * groups, s1 = size_t(n1) * groups;
  const float* x = j.x + size_t(m0) * j.ldx;
  __m512 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) {
    acc0[m] = _mm512_setzero_ps();
    acc1[m] = _mm512_setzero_ps();
  }
  for (int g = 0; g < groups; ++g) {
    const __m512 sc0 = _mm512_set1_ps(scale_f16c(j.scales, s0 + g, j.stype));
    const __m512 bi0 = _mm512_set1_ps(scale_f16c(j.biases, s0 + g, j.stype));
    const __m512 sc1 = _mm512_set1_ps(scale_f16c(j.scales, s1 + g, j.stype));
    const __m512 bi1 = _mm512_set1_ps(scale_f16c(j.biases, s1 + g, j.stype));
    for (int k = g * gs; k < (g + 1) * gs; k += 16) {
      const __m512 f0 = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w0 + k)))),
          sc0, bi0);
      const __m512 f1 = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w1 + k)))),
          sc1, bi1);
      for (int m = 0; m < MT; ++m) {
        const __m512 xm = _mm512_loadu_ps(x + size_t(m) * j.ldx + k);
        acc0[m] = _mm512_fmadd_ps(f0, xm, acc0[m]);
        acc1[m] = _mm512_fmadd_ps(f1, xm, acc1[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float* y = j.y + size_t(m0 + m) * j.N;
    y[n0] = _mm512_reduce_add_ps(acc0[m]);
    if (n1 != n0) {
      y[n1] = _mm512_reduce_add_ps(acc1[m]);
    }
  }
}

template <int MT>
SPECMLX_AVX2 void tile8_avx2(const QmmJob& j, int n0, int n1, int m0) {
  const int gs = j.group_size, groups = j.K / gs;
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n0) * j.K;
  const uint8_t* w1 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n1) * j.K;
  const size_t s0 = size_t(n0) * groups, s1 = size_t(n1) * groups;
  const float* x = j.x + size_t(m0) * j.ldx;
  __m256 acc0[MT], acc1[MT];
  for (int m = 0; m < MT; ++m) {
    acc0[m] = _mm256_setzero_ps();
    acc1[m] = _mm256_setzero_ps();
  }
  for (int g = 0; g < groups; ++g) {
    const __m256 sc0 = _mm256_set1_ps(scale_f16c(j.scales, s0 + g, j.stype));
    const __m256 bi0 = _mm256_set1_ps(scale_f16c(j.biases, s0 + g, j.stype));
    const __m256 sc1 = _mm256_set1_ps(scale_f16c(j.scales, s1 + g, j.stype));
    const __m256 bi1 = _mm256_set1_ps(scale_f16c(j.biases, s1 + g, j.stype));
    for (int k = g * gs; k < (g + 1) * gs; k += 8) {
      const __m256 f0 = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w0 + k)))),
          sc0, bi0);
      const __m256 f1 = _mm256_fmadd_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w1 + k)))),
          sc1, bi1);
      for (int m = 0; m < MT; ++m) {
        const __m256 xm = _mm256_loadu_ps(x + size_t(m) * j.ldx + k);
        acc0[m] = _mm256_fmadd_ps(f0, xm, acc0[m]);
        acc1[m] = _mm256_fmadd_ps(f1, xm, acc1[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float* y = j.y + size_t(m0 + m) * j.N;
    y[n0] = hsum256(acc0[m]);
    if (n1 != n0) {
      y[n1] = hsum256(acc1[m]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Tables of instantiations: [group size 32/64/128][MT - 1] for 4 bits, [MT - 1] for 8.
template <template <int, int> class K, int G, int... MT>
constexpr std::array<TileFn, sizeof...(MT)> tiles_for(std::integer_sequence<int, MT...>) {
  return {&K<MT + 1, G>::run...};
}

template <int MT, int G>
struct Avx512Tile {
  static void run(const QmmJob& j, int n0, int n1, int m0) {
    tile_avx512<MT, G>(j, n0, n1, m0);
  }
};
template <int MT, int G>
struct Avx2Tile {
  static void run(const QmmJob& j, int n0, int n1, int m0) {
    tile_avx2<MT, G>(j, n0, n1, m0);
  }
};

template <int MT, int G>
struct Avx512Tile8 {
  static void run(const QmmJob& j, int n0, int n1, int m0) {
    tile8_avx512<MT>(j, n0, n1, m0);
  }
};
template <int MT, int G>
struct Avx2Tile8 {
  static void run(const QmmJob& j, int n0, int n1, int m0) {
    tile8_avx2<MT>(j, n0, n1, m0);
  }
};

template <template <int, int> class K, int MaxRows>
TileFn pick_tile8(int mt) {
  static constexpr auto table = tiles_for<K, 0>(std::make_integer_sequence<int, MaxRows>{});
  return table[mt - 1];
}

template <template <int, int> class K, int MaxRows>
TileFn pick_tile(int group_size, int mt) {
  using Seq = std::make_integer_sequence<int, MaxRows>;
  static constexpr auto g32 = tiles_for<K, 4>(Seq{});
  static constexpr auto g64 = tiles_for<K, 8>(Seq{});
  static constexpr auto g128 = tiles_for<K, 16>(Seq{});
  const auto& table = group_size == 32 ? g32 : group_size == 64 ? g64 : g128;
  return table[mt - 1];
}

int max_rows(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return kAvx512MaxRows;
    case Isa::avx2:
      return kAvx2MaxRows;
    case Isa::scalar:
      return kScalarMaxRows;
  }
  return 1;
}

} // namespace

Isa detect_isa() {
  __builtin_cpu_init();
  const bool f16c = __builtin_cpu_supports("f16c");
  if (__builtin_cpu_supports("avx512f") && f16c) {
    return Isa::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    return Isa::avx2;
  }
  return Isa::scalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    case Isa::scalar:
      return "scalar";
  }
  return "?";
}

int isa_lanes(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return 16;
    case Isa::avx2:
      return 8;
    case Isa::scalar:
      return 1;
  }
  return 1;
}

void qmm_rows(Isa isa, const QmmJob& j, int n0, int n1) {
  const int tile_rows = max_rows(isa);
  // Block x rows so that one block stays in L2 while the output rows sweep past it; a
  // row pair's weights (a few KiB) stay in L1 across the block's tiles. Row a is paired
  // with row a + half, not a + 1, so that the weights stream on through memory in two runs
  // the hardware prefetchers follow (as in qmm_rows_q8).
  const int block = std::max<int>(tile_rows, int(kL2Floats / size_t(j.ldx)) / tile_rows * tile_rows);
  const int half = (n1 - n0 + 1) / 2;
  for (int mb = 0; mb < j.M; mb += block) {
    const int mb_end = std::min(j.M, mb + block);
    for (int a = n0; a < n0 + half; ++a) {
      const int b = a + half < n1 ? a + half : a;  // a lone middle row of an odd range
      for (int m0 = mb; m0 < mb_end; m0 += tile_rows) {
        const int mt = std::min(tile_rows, mb_end - m0);
        switch (isa) {
          case Isa::avx512:
            (j.bits == 4 ? pick_tile<Avx512Tile, kAvx512MaxRows>(j.group_size, mt)
                         : pick_tile8<Avx512Tile8, kAvx512MaxRows>(mt))(j, a, b, m0);
            break;
          case Isa::avx2:
            (j.bits == 4 ? pick_tile<Avx2Tile, kAvx2MaxRows>(j.group_size, mt)
                         : pick_tile8<Avx2Tile8, kAvx2MaxRows>(mt))(j, a, b, m0);
            break;
          case Isa::scalar:
            tile_scalar(j, a, b, m0, mt);
            break;
        }
      }
    }
  }
}

} // namespace specmlx
