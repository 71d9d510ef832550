// INT4 and INT8 weights x int8 activations: y = x @ dequant(W)^T with each 32-block of a
// row of x quantized to int8 codes q and a float scale d (x ~ d * q), so that for one weight
// group (scale s, bias b, unsigned codes c: 0..15 or 0..255):
//
//   sum_k (s * c_k + b) * x_k  ~  s * sum_blocks d * (sum_k c_k * q_k)  +  b * sum_blocks d * sum_k q_k
//
// The inner sums are exact integer dot products (u8 codes x s8 codes: vpdpbusd on AVX-512
// VNNI; on AVX2 maddubs + madd for 4 bits, 16-bit widening + madd for 8); the second term
// is a short float dot over groups, with sum(d * q) precomputed per group when x is
// quantized (quantize_row_q8).
//
// 4-bit layout: a weight row is K/2 bytes, byte i holding codes 2i (low nibble) and 2i + 1
// (high). The tiles take a chunk of bytes at a time (64 = 128 codes; AVX2 in two halves),
// mask the low nibbles into one register and the high nibbles into another; x is packed so
// that the same chunk of q holds the even-k codes, then the odd-k ones. An int32 lane then
// sums the products for 8 consecutive k, whose scales are known: the d of its 32-block and
// the s of its weight group.
//
// 8-bit layout: a weight row is K bytes in k order, and so is q. A chunk is 64 bytes on
// AVX-512 (one vpdpbusd: lanes of 4 consecutive k) and 32 on AVX2 (one x block).
//
// Tiles: AVX-512 VNNI and AVX2 take four output rows a tile for 4 bits (two for 8 and 6),
// both the same float sequence on the same exact integer sums; from 16 rows of x on, 4-bit
// passes go to the AMX tile where the CPU has one (amx.cpp), which repeats it too. Scalar
// takes two output rows.
//
// Every row of x runs the same operations in the same order whatever the tile's other rows
// are, so a row's result does not depend on M, nor (rows are split, sums are not) on threads.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <utility>

#include <unistd.h>

#include "amx.h"
#include "kernels.h"
#include "scratch.h"

// gcc 12's AVX-512 headers also trip -Wuninitialized on their _mm512_undefined_*() values
// (in the reductions and conversions the quantizer uses).
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace specmlx {
namespace {

// The L2 size the loop blocking plans for (bytes; 1 MiB, as on the cores this was tuned on).
constexpr size_t kL2Bytes = size_t(1) << 20;

// `count` (<= L) scales or biases from index i on, zero past them: the tail of a row must
// not be read past the array's end.
template <int L>
SPECMLX_F16C inline std::array<float, L> scales_from(const void* p, size_t i, ScaleType t, int count) {
  std::array<float, L> out{};
  if (t == ScaleType::f32 && count == L) {
    std::copy_n(static_cast<const float*>(p) + i, L, out.begin());
  } else {
    for (int l = 0; l < count; ++l) {
      out[l] = scale_f16c(p, i + l, t);
    }
  }
  return out;
}

// One tile: output rows n0 and n1 (n1 == n0: a lone row, computed twice and stored once)
// for x rows m0 .. m0 + MT - 1.
using TileFn = void (*)(const QmmJob&, int n0, int n1, int m0);

// How far ahead in each of a tile's two weight streams (rows n0 and n1 run on through
// memory, see qmm_rows_q8) the weights are asked for. The hardware prefetchers follow the
// streams either way; asking ahead as well keeps the tiles from waiting on memory at
// several rows of x (bench/results/row_pairing.md). With one row of x the packed four-row
// tile and the AVX-512 two-row tile do not ask (kPrefetchRows): the prefetchers alone
// keep up with a tile that does so little a cache line, and the prefetch instructions
// cost more than they bring there, while at two and four rows they are needed
// (bench/results/ARCHIVE.md, "no prefetch at one row"). The AVX2 tiles ask at every M: the
// two-row tile (8 and 6 bits), the unpacked four-row tile, and the packed four-row tile,
// which on a CPU whose one core reads DRAM slowly decodes faster with them and elsewhere
// no slower (bench/results/ARCHIVE.md, "the AVX2 tile prefetches at one row").
constexpr int kPrefetchBytes = 4 << 10;
constexpr int kPackedPrefetchBytes = 4 << 10;  // one stream per tile: its own distance
constexpr int kPrefetchRows = 2;  // the fewest rows of x an AVX-512 tile prefetches for

// Where a packed tile's prefetches land. Its rows of x are re-read from L1 once a tile; when
// a tile's weights, those rows and the stream asked ahead overflow L1 (a 1.5B's down
// projection: K = 8960, ~20 KB of weights a tile against ~10 KB of x a row), weights
// prefetched into L1 evict x, and asking for them into L2 only is faster there (while
// for gate/up, K = 1536, L2 alone is slower; bench/results/ARCHIVE.md, "down's prefetch
// into L2"). One row asks for nothing (kPrefetchRows).
enum class Stream { l1, l2 };

size_t l1d_bytes() {
  static const size_t bytes = [] {
    const long n = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return n > 0 ? size_t(n) : size_t(32) << 10;
  }();
  return bytes;
}

Stream packed_stream(const QmmJob& j, int mt) {
  const size_t x_bytes = size_t(mt) * (j.ldq + 4 * (size_t(j.ldd) + j.ldg));
  const size_t tile = packed_tile_bytes(j.K, j.group_size, j.stype);
  return tile + x_bytes + kPackedPrefetchBytes <= l1d_bytes() * 3 / 4 ? Stream::l1 : Stream::l2;
}

// Prefetch one chunk's worth of both streams, kPrefetchBytes ahead. Forced inline: GCC takes
// a function of prefetches alone for one without effects, and dropped a call to it made
// from another inlined helper (a tried variant of the tiles).
template <int Bytes>
inline __attribute__((always_inline)) void prefetch_streams(const uint8_t* w0, const uint8_t* w1, int chunk) {
  const size_t at = kPrefetchBytes + size_t(Bytes) * chunk;
  for (int off = 0; off < Bytes; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w0) + at + off, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1) + at + off, _MM_HINT_T0);
  }
}

bool has_vnni512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl");
}

std::atomic<bool> g_vbmi_on{true};

} // namespace

bool vbmi_available() {
  static const bool vbmi = has_vnni512() && __builtin_cpu_supports("avx512vbmi");
  return vbmi;
}

bool vbmi_enabled() {
  return vbmi_available() && g_vbmi_on.load(std::memory_order_relaxed);
}

void set_vbmi(bool on) {
  g_vbmi_on.store(on, std::memory_order_relaxed);
}

namespace {

// The q8 tiles that run under isa: AVX-512 without VNNI (Skylake-X) takes the AVX2 ones.
Isa q8_isa(Isa isa) {
  static const bool vnni = has_vnni512();
  return isa == Isa::avx512 && !vnni ? Isa::avx2 : isa;
}

// ---------------------------------------------------------------------------------------
// Scalar: k order, one lane of 8 codes at a time, as the vector tiles sum them.
constexpr int kScalarMaxRows = 4;

void tile_q8_scalar(const QmmJob& j, int n0, int n1, int m0, int mt) {
  const int bytes = j.K * j.bits / 8, groups = j.K / j.group_size;
  for (int r = 0; r < (n1 == n0 ? 1 : 2); ++r) {
    const int n = r == 0 ? n0 : n1;
    const uint8_t* w = reinterpret_cast<const uint8_t*>(j.w) + size_t(n) * bytes;
    const size_t srow = size_t(n) * groups;
    for (int m = 0; m < mt; ++m) {
      const int8_t* q = j.xq + size_t(m0 + m) * j.ldq;
      const float* d = j.xd + size_t(m0 + m) * j.ldd;
      const float* xs = j.xs + size_t(m0 + m) * j.ldg;
      float acc = 0.0f;
      for (int k0 = 0; k0 < j.K; k0 += 8) {
        int dot = 0;
        for (int k = k0; k < k0 + 8; ++k) {
          dot += code_at(w, k, j.bits) * q[k];
        }
        acc += float(dot) * (scale_at(j.scales, srow + k0 / j.group_size, j.stype) * d[k0 / kQ8Block]);
      }
      for (int g = 0; g < groups; ++g) {
        acc += scale_at(j.biases, srow + g, j.stype) * xs[g];
      }
      j.y[size_t(m0 + m) * j.N + n] = acc;
    }
  }
}

// 6 bits: the codes of a chunk (48 bytes, 64 codes) widened to one byte each, in k order,
// so that the 8-bit tile takes them as its own. Each 128-bit lane takes its 12 bytes
// (three dwords), each dword then the 3 bytes of its 4 codes, and each code moves up to its
// byte. AVX-512 F/BW only (vpermb and vpmultishiftqb would need VBMI).
SPECMLX_VNNI512 inline __attribute__((always_inline)) __m512i widen6_512(__m512i b) {
  const __m512i dwords = _mm512_setr_epi32(0, 1, 2, 2, 3, 4, 5, 5, 6, 7, 8, 8, 9, 10, 11, 11);
  const __m512i bytes =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1));
  const __m512i w = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, b), bytes);
  constexpr int kOrAnd = 0xF8;  // ternary logic: a | (b & c)
  __m512i r = _mm512_and_si512(w, _mm512_set1_epi32(0x3F));
  r = _mm512_ternarylogic_epi32(r, _mm512_slli_epi32(w, 2), _mm512_set1_epi32(0x3F00), kOrAnd);
  r = _mm512_ternarylogic_epi32(r, _mm512_slli_epi32(w, 4), _mm512_set1_epi32(0x3F0000), kOrAnd);
  return _mm512_ternarylogic_epi32(r, _mm512_slli_epi32(w, 6), _mm512_set1_epi32(0x3F000000), kOrAnd);
}

// The same bytes in 3 instructions with VBMI (Ice Lake, Zen 4 on; not Cascade Lake, which
// has VNNI): vpermb gives each qword the 6 bytes of its 8 codes, vpmultishiftqb moves
// code i's bits 6i .. 6i + 5 of the qword down to its byte, and a mask drops the bits
// above. The widening is most of a 6-bit tile's work: a 6-bit head is compute-bound on
// two cores without it. Written in assembly so that the tiles keep one target attribute:
// only the VBMI tiles (pick_vnni512, vbmi_enabled) execute it.
SPECMLX_VNNI512 inline __attribute__((always_inline)) __m512i widen6_vbmi(__m512i b) {
  alignas(64) static constexpr uint8_t kSource[64] = {
      0,  1,  2,  3,  4,  5,  5,  5,  6,  7,  8,  9,  10, 11, 11, 11, 12, 13, 14, 15, 16, 17,
      17, 17, 18, 19, 20, 21, 22, 23, 23, 23, 24, 25, 26, 27, 28, 29, 29, 29, 30, 31, 32, 33,
      34, 35, 35, 35, 36, 37, 38, 39, 40, 41, 41, 41, 42, 43, 44, 45, 46, 47, 47, 47};
  const __m512i source = _mm512_load_si512(kSource);
  const __m512i shifts = _mm512_set1_epi64(0x2A241E18120C0600);  // 0, 6, ..., 42
  __m512i gathered, moved;
  asm("vpermb %1, %2, %0" : "=v"(gathered) : "v"(b), "v"(source));
  asm("vpmultishiftqb %1, %2, %0" : "=v"(moved) : "v"(gathered), "v"(shifts));
  return _mm512_and_si512(moved, _mm512_set1_epi8(0x3F));
}

// A chunk's codes as bytes: 6 bits widened (with VBMI where the tile is a VBMI one).
template <int BITS, bool VBMI>
SPECMLX_VNNI512 inline __attribute__((always_inline)) __m512i codes_512(__m512i loaded) {
  if constexpr (BITS == 6 && VBMI) {
    return widen6_vbmi(loaded);
  } else if constexpr (BITS == 6) {
    return widen6_512(loaded);
  } else {
    return loaded;
  }
}

// ---------------------------------------------------------------------------------------
// AVX-512 VNNI, 8 bits (and 6, widened to 8 as they load): two output rows a tile. A chunk is 64 bytes, 64 codes (1-2
// groups); per row of x and output row one vpdpbusd leaves 16 int32 lanes of 4-code sums,
// a 128-bit quarter of them being half an x block. (4 bits take the four-row tile below.)
// The two output rows' lanes are then folded into one register (unpack low/high and add,
// within quarters: lanes alternate between the rows, each sum inside one block), so the
// float work (convert, s * d, FMA) is done once per row pair, not per row. Even lanes
// accumulate the first output row, odd lanes the second; MT rows of x share every chunk.
constexpr int kVnniMaxRows = 8;  // 8 accumulators + 4 code registers + temporaries

// Scales and biases are read 8 at a time from index i (zero past the `valid` ones: a row's
// last groups must not read past the array), widened in registers. A template on the
// type: a branch on it in the chunk loop cost as much as the scales' own instructions.
template <ScaleType ST>
SPECMLX_VNNI512 inline __attribute__((always_inline)) __m256 halves8_512(const void* p, size_t i, __mmask8 valid) {
  if constexpr (ST == ScaleType::f32) {
    return _mm256_maskz_loadu_ps(valid, static_cast<const float*>(p) + i);
  } else if constexpr (ST == ScaleType::f16) {
    return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(valid, static_cast<const uint16_t*>(p) + i));
  } else {  // bf16: a shift of each into the top of a float (exact)
    const __m128i h = _mm_maskz_loadu_epi16(valid, static_cast<const uint16_t*>(p) + i);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Which of a pair of 8-scale registers (row 0's, then row 1's at 16 on) lane l of a chunk
// takes, the chunk starting `first` groups into them: quarter q holds the QC = 16 codes
// from QC * q on, so group first + QC * q / GS; lanes alternate between the two output rows.
template <int GS, int QC>
SPECMLX_VNNI512 inline __m512i pair_lanes(int first) {
  return _mm512_add_epi32(
      _mm512_set1_epi32(first),
      _mm512_setr_epi32(0, 16, 0, 16, QC / GS, 16 + QC / GS, QC / GS, 16 + QC / GS, 2 * QC / GS,
                        16 + 2 * QC / GS, 2 * QC / GS, 16 + 2 * QC / GS, 3 * QC / GS, 16 + 3 * QC / GS,
                        3 * QC / GS, 16 + 3 * QC / GS));
}

// One chunk of both output rows against MT rows of x: the integer dots, the fold of the
// two rows into one register and the float step acc += float(dot) * (sc * d). q and d
// point at the chunk's codes and block scales of the tile's first row of x.
template <int MT>
SPECMLX_VNNI512 inline __attribute__((always_inline)) void chunk_512(
    __m512 (&acc)[MT], __m512i b0, __m512i b1, __m512 sc, const int8_t* q, size_t ldq, const float* d,
    size_t ldd) {
  const __m512i zero = _mm512_setzero_si512();
  // x's block scales of a chunk spread over its halves, one block each. (Kept per block,
  // not per lane: at K = 8960 a few rows of x then still fit in L1 beside the weights
  // streaming through.)
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  // Every loop over acc is unrolled: with a loop left over it, GCC keeps acc in memory
  // and stores each accumulator once per chunk.
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    const int8_t* qm = q + size_t(m) * ldq;
    const __m512i xl = _mm512_loadu_si512(qm);
    const __m512 dm = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_loadu_ps(d + size_t(m) * ldd)));
    const __m512i i0 = _mm512_dpbusd_epi32(zero, b0, xl), i1 = _mm512_dpbusd_epi32(zero, b1, xl);
    const __m512i both = _mm512_add_epi32(_mm512_unpacklo_epi32(i0, i1), _mm512_unpackhi_epi32(i0, i1));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), _mm512_mul_ps(sc, dm), acc[m]);
  }
}

template <int MT, int GS, int BITS, ScaleType ST, bool VBMI>
SPECMLX_VNNI512 void tile_q8_vnni512(const QmmJob& j, int n0, int n1, int m0) {
  constexpr int kCodes = 64, kBytes = kCodes * BITS / 8, kGroups = std::max(1, kCodes / GS), kQC = kCodes / 4;
  // A pair of chunks takes its scales in one load per row: 2 * kCodes / GS groups (4 at
  // most, GS = 32), or the one group both chunks lie in.
  constexpr int kPairGroups = std::max(1, 2 * kCodes / GS);
  const int bytes = j.K * BITS / 8, groups = j.K / GS;
  const int chunks = (j.K + kCodes - 1) / kCodes;
  const int tail = bytes - (chunks - 1) * kBytes;  // bytes in the last chunk
  // A full load takes 64 bytes: a 6-bit chunk's 48 and 16 of the next, so a row's last
  // 6-bit chunk is always loaded masked (the matrix's last row ends there).
  const int full_chunks = tail == 64 ? chunks : chunks - 1;
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n0) * bytes;
  const uint8_t* w1 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n1) * bytes;
  const size_t s0 = size_t(n0) * groups, s1 = size_t(n1) * groups;
  const int8_t* xq = j.xq + size_t(m0) * j.ldq;
  const float* xd = j.xd + size_t(m0) * j.ldd;

  __m512 acc[MT];
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
  }
  const __m512i first = pair_lanes<GS, kQC>(0), second = pair_lanes<GS, kQC>(kCodes / GS);
  const __mmask8 pair_valid = __mmask8((1u << kPairGroups) - 1);
  int c = 0;
  for (; c + 1 < full_chunks; c += 2) {
    const int g0 = c * kCodes / GS;
    const __m512 r0 = _mm512_castps256_ps512(halves8_512<ST>(j.scales, s0 + g0, pair_valid));
    const __m512 r1 = _mm512_castps256_ps512(halves8_512<ST>(j.scales, s1 + g0, pair_valid));
    for (int h = 0; h < 2; ++h) {
      if constexpr (MT >= kPrefetchRows) {
        prefetch_streams<kBytes>(w0, w1, c + h);
      }
      const __m512i b0 = codes_512<BITS, VBMI>(_mm512_loadu_si512(w0 + (c + h) * kBytes));
      const __m512i b1 = codes_512<BITS, VBMI>(_mm512_loadu_si512(w1 + (c + h) * kBytes));
      const __m512 sc = _mm512_permutex2var_ps(r0, h == 0 ? first : second, r1);
      chunk_512<MT>(acc, b0, b1, sc, xq + (c + h) * kCodes, j.ldq, xd + (c + h) * kCodes / kQ8Block, j.ldd);
    }
  }
  // A last odd chunk, and a partial one (masked loads: they stream from DRAM more slowly,
  // so only there).
  const __mmask64 tail_mask = tail == 64 ? ~__mmask64(0) : (__mmask64(1) << tail) - 1;
  for (; c < chunks; ++c) {
    if constexpr (MT >= kPrefetchRows) {
      prefetch_streams<kBytes>(w0, w1, c);
    }
    const bool full = c < full_chunks;
    const uint8_t* p0 = w0 + c * kBytes;
    const uint8_t* p1 = w1 + c * kBytes;
    const __m512i b0 = codes_512<BITS, VBMI>(full ? _mm512_loadu_si512(p0) : _mm512_maskz_loadu_epi8(tail_mask, p0));
    const __m512i b1 = codes_512<BITS, VBMI>(full ? _mm512_loadu_si512(p1) : _mm512_maskz_loadu_epi8(tail_mask, p1));
    const int g0 = c * kCodes / GS, count = std::min(kGroups, groups - g0);
    const __mmask8 valid = __mmask8((1u << count) - 1);
    const __m512 sc = _mm512_permutex2var_ps(
        _mm512_castps256_ps512(halves8_512<ST>(j.scales, s0 + g0, valid)), first,
        _mm512_castps256_ps512(halves8_512<ST>(j.scales, s1 + g0, valid)));
    chunk_512<MT>(acc, b0, b1, sc, xq + c * kCodes, j.ldq, xd + c * kCodes / kQ8Block, j.ldd);
  }
  // The bias term: b . (sum of d * q per group), 8 groups per step, in the same
  // alternating lanes; xs is zero-padded.
  const __m512i pick = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int g = 0; g < groups; g += 8) {
    const __mmask8 valid = __mmask8((1u << std::min(8, groups - g)) - 1);
    const __m512 bv = _mm512_permutex2var_ps(
        _mm512_castps256_ps512(halves8_512<ST>(j.biases, s0 + g, valid)), pick,
        _mm512_castps256_ps512(halves8_512<ST>(j.biases, s1 + g, valid)));
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const __m256 xs = _mm256_loadu_ps(j.xs + size_t(m0 + m) * j.ldg + g);
      acc[m] = _mm512_fmadd_ps(bv, _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(xs)), acc[m]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    float* y = j.y + size_t(m0 + m) * j.N;
    y[n0] = _mm512_mask_reduce_add_ps(0x5555, acc[m]);
    if (n1 != n0) {
      y[n1] = _mm512_mask_reduce_add_ps(0xAAAA, acc[m]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// AVX-512 VNNI, 4 bits: four output rows a tile. Per row of x and chunk, eight vpdpbusd
// leave each output row's 16 lanes of 8-code sums; two folds (unpack 32-bit low/high and
// add, then 64-bit) sum each 32-block's four lanes in one int32 lane: lane 4q + r holds
// output row r's whole sum over the chunk's block q. The float step (convert, s * d, FMA)
// is then done once per four rows and every product of a block is in one sum, so a row's
// result is a fixed sequence of float operations on exact integer block sums: the AMX tile
// (amx.cpp) computes the same sums and repeats the sequence, bitwise.
//
// The sequence, per output row n and row of x m: four float32 accumulators a_0..a_3 from
// zero; for each block b in k order, a_(b % 4) = fma(float(I_b), s_(n, g(b)) * d_(m, b),
// a_(b % 4)), I_b the block's integer dot product; then for each weight group g in order,
// a_(g % 4) = fma(bias_(n, g), xs_(m, g), a_(g % 4)); y = (a_0 + a_2) + (a_1 + a_3).
constexpr int kQuadMaxRows = 8;  // 8 accumulators + 8 code registers + temporaries

// Four scales or biases from index i (zero past the `valid` ones) as float, exactly.
template <ScaleType ST>
SPECMLX_VNNI512 inline __attribute__((always_inline)) __m128 four_512(const void* p, size_t i, __mmask8 valid) {
  if constexpr (ST == ScaleType::f32) {
    return _mm_maskz_loadu_ps(valid, static_cast<const float*>(p) + i);
  } else if constexpr (ST == ScaleType::f16) {
    return _mm_cvtph_ps(_mm_maskz_loadu_epi16(valid, static_cast<const uint16_t*>(p) + i));
  } else {
    const __m128i h = _mm_maskz_loadu_epi16(valid, static_cast<const uint16_t*>(p) + i);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
  }
}

// Four values of each of four rows (row starts s[r], from index g), row r in lanes 4r..4r+3.
template <ScaleType ST>
SPECMLX_VNNI512 inline __attribute__((always_inline)) __m512 rows4_512(
    const void* p, const size_t (&s)[4], size_t g, __mmask8 valid) {
  __m512 v = _mm512_castps128_ps512(four_512<ST>(p, s[0] + g, valid));
  v = _mm512_insertf32x4(v, four_512<ST>(p, s[1] + g, valid), 1);
  v = _mm512_insertf32x4(v, four_512<ST>(p, s[2] + g, valid), 2);
  return _mm512_insertf32x4(v, four_512<ST>(p, s[3] + g, valid), 3);
}

// Lane 4q + r of a chunk's scale (or bias) register: row r's value for block q's group,
// out of values laid out PerRow a row (rows4_512: 4; a packed chunk: its groups), i.e.
// index r * PerRow + q * 32 / GS; with GS = 32 (biases: one per step) the q-th.
template <int GS, int PerRow>
SPECMLX_VNNI512 inline __m512i block_lanes() {
  alignas(64) static constexpr std::array<int32_t, 16> index = [] {
    std::array<int32_t, 16> a{};
    for (int q = 0; q < 4; ++q) {
      for (int r = 0; r < 4; ++r) {
        a[4 * q + r] = r * PerRow + q * 32 / GS;
      }
    }
    return a;
  }();
  return _mm512_load_si512(index.data());
}

template <int GS>
SPECMLX_VNNI512 inline __m512i quad_lanes() {
  return block_lanes<GS, 4>();
}

// Packed (PACKED: j.packed, laid out by pack_quad: rows n[r] = 4t + r), each chunk's codes
// and scales and then the biases come from one stream, in the order the tile reads them:
// the same values, so the same result, bitwise.
constexpr int scale_bytes(ScaleType t) {
  return t == ScaleType::f32 ? 4 : 2;
}

// One packed chunk (128 codes): four rows' 64 code bytes, then their scales, per_chunk a
// row; what pack_quad writes and the tile steps by.
constexpr int packed_chunk_bytes(int group_size, ScaleType t) {
  return 4 * 64 + 4 * std::max(1, 128 / group_size) * scale_bytes(t);
}

// n values (4, 8 or 16) of a packed side block as floats in lanes 0..n-1, exactly.
template <ScaleType ST, int N>
SPECMLX_VNNI512 inline __attribute__((always_inline)) __m512 packed_values(const uint8_t* p) {
  constexpr __mmask16 kLanes = __mmask16((1u << N) - 1);
  if constexpr (ST == ScaleType::f32) {
    return _mm512_maskz_loadu_ps(kLanes, p);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(kLanes, p);
    if constexpr (ST == ScaleType::f16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// What a four-row tile (AVX-512 VNNI or AVX2) reads for output rows n[0..3] and the rows
// of x from m0: its 128-code chunks, the rows' codes and scale offsets (unpacked), or its
// packed tile.
template <int GS, ScaleType ST>
struct QuadRows {
  static constexpr int kCodes = 128, kBytes = 64, kGroups = std::max(1, kCodes / GS);
  static constexpr int kChunkBytes = packed_chunk_bytes(GS, ST);
  int groups, chunks, tail;  // tail: bytes in the last chunk, 16..64
  const uint8_t* w[4];
  size_t s[4];
  const uint8_t* pk;
  const int8_t* xq;
  const float* xd;

  QuadRows(const QmmJob& j, const int (&n)[4], int m0, bool packed)
      : groups(j.K / GS),
        chunks((j.K + kCodes - 1) / kCodes),
        tail(j.K / 2 - (chunks - 1) * kBytes),
        pk(packed ? j.packed + size_t(n[0] / 4) * packed_tile_bytes(j.K, GS, ST) : nullptr),
        xq(j.xq + size_t(m0) * j.ldq),
        xd(j.xd + size_t(m0) * j.ldd) {
    for (int r = 0; r < 4; ++r) {
      w[r] = reinterpret_cast<const uint8_t*>(j.w) + size_t(n[r]) * (j.K / 2);
      s[r] = size_t(n[r]) * groups;
    }
  }
};

// A four-row tile's last step for row `row` of x: h holds a_0 + a_2 (lanes 0..3) and
// a_1 + a_3 (lanes 4..7) for output rows n[0..3]; y gets their sums.
SPECMLX_AVX2_Q8 inline __attribute__((always_inline)) void store_quad(
    const QmmJob& j, const int (&n)[4], int row, __m256 h) {
  alignas(16) float out[4];
  _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  float* y = j.y + size_t(row) * j.N;
  for (int r = 0; r < 4; ++r) {
    y[n[r]] = out[r];
  }
}

template <int MT, int GS, ScaleType ST, bool PACKED, Stream S = Stream::l1>
SPECMLX_VNNI512 void tile4_q8_vnni512(const QmmJob& j, const int (&n)[4], int m0) {
  constexpr _mm_hint kHint = S == Stream::l1 ? _MM_HINT_T0 : _MM_HINT_T1;
  using T = QuadRows<GS, ST>;
  constexpr int kCodes = T::kCodes, kBytes = T::kBytes, kGroups = T::kGroups, kChunkBytes = T::kChunkBytes;
  const auto [groups, chunks, tail, w, s, pk, xq, xd] = T(j, n, m0, PACKED);
  const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i scale_lanes = quad_lanes<GS>();

  __m512 acc[MT];
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm512_setzero_ps();
  }
  const __mmask64 tail_mask = tail == kBytes ? ~__mmask64(0) : (__mmask64(1) << tail) - 1;
  for (int c = 0; c < chunks; ++c) {
    const bool full = c + 1 < chunks || tail == kBytes;
    __m512i lo[4], hi[4];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      __m512i b;
      if constexpr (PACKED) {  // codes zero-padded to whole chunks
        const uint8_t* p = pk + size_t(c) * kChunkBytes + r * kBytes;
        if constexpr (MT >= kPrefetchRows) {
          _mm_prefetch(reinterpret_cast<const char*>(p) + kPackedPrefetchBytes, kHint);
        }
        b = _mm512_loadu_si512(p);
      } else {
        const uint8_t* p = w[r] + c * kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        b = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(tail_mask, p);
      }
      lo[r] = _mm512_and_si512(b, low4);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    }
    const int g0 = c * kCodes / GS;
    __m512 sc;
    if constexpr (PACKED) {
      const uint8_t* p = pk + size_t(c) * kChunkBytes + 4 * kBytes;
      if constexpr (MT >= kPrefetchRows) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPackedPrefetchBytes, kHint);
      }
      sc = _mm512_permutexvar_ps(block_lanes<GS, kGroups>(), packed_values<ST, 4 * kGroups>(p));
    } else {
      const __mmask8 valid = __mmask8((1u << std::min(kGroups, groups - g0)) - 1);
      sc = _mm512_permutexvar_ps(scale_lanes, rows4_512<ST>(j.scales, s, g0, valid));
    }
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const int8_t* qm = xq + size_t(m) * j.ldq + c * kCodes;
      const __m512i xl = _mm512_loadu_si512(qm), xh = _mm512_loadu_si512(qm + kBytes);
      const __m512 dm = _mm512_permutexvar_ps(
          quarters, _mm512_castps128_ps512(_mm_loadu_ps(xd + size_t(m) * j.ldd + c * kCodes / kQ8Block)));
      __m512i i[4];
      #pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        i[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo[r], xl), hi[r], xh);
      }
      const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(i[0], i[1]), _mm512_unpackhi_epi32(i[0], i[1]));
      const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(i[2], i[3]), _mm512_unpackhi_epi32(i[2], i[3]));
      const __m512i sums = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(sc, dm), acc[m]);
    }
  }
  // The bias term, four groups a step: lane 4q + r takes row r's group g + q.
  const __m512i bias_lanes = quad_lanes<32>();
  for (int g = 0; g < groups; g += 4) {
    __m512 bv;
    if constexpr (PACKED) {  // lane 4q + r already: row r's group g + q, zero past the last
      bv = packed_values<ST, 16>(pk + size_t(chunks) * kChunkBytes + size_t(g / 4) * 16 * scale_bytes(ST));
    } else {
      const __mmask8 valid = __mmask8((1u << std::min(4, groups - g)) - 1);
      bv = _mm512_permutexvar_ps(bias_lanes, rows4_512<ST>(j.biases, s, g, valid));
    }
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const __m128 xs = _mm_loadu_ps(j.xs + size_t(m0 + m) * j.ldg + g);
      acc[m] = _mm512_fmadd_ps(bv, _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(xs)), acc[m]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc[m]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m]), 1)));
    store_quad(j, n, m0 + m, h);
  }
}

// ---------------------------------------------------------------------------------------
// AVX2. 4 bits: 32 bytes (64 codes) of a row at a time; maddubs multiplies u8 codes by s8
// codes and adds neighbours into int16 (at most 2 * 15 * 127, and low + high nibbles at
// most twice that: no saturation), madd with ones adds neighbouring int16 into the same
// 8-code int32 lanes as vpdpbusd. 8-bit codes would saturate maddubs (2 * 255 * 127 >
// 32767), so there a chunk (32 codes, one x block) is widened to int16, codes and q alike,
// and madd sums pairs into int32 (at most 2 * 255 * 127): lanes of 4-code sums after adding
// the two halves. Only 16 ymm registers: the two-row tile keeps 2 * 4 accumulators.
constexpr int kAvx2MaxRows = 4;

// As halves8_512, without masked loads: a partial step (a row's last) goes through memory.
SPECMLX_AVX2_Q8 inline __attribute__((always_inline)) __m256 biases8_256(const void* p, size_t i, ScaleType t, int count) {
  if (count == 8 && t == ScaleType::f16) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  }
  if (count == 8 && t == ScaleType::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
  return _mm256_loadu_ps(scales_from<8>(p, i, t, count).data());
}

SPECMLX_AVX2_Q8 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 6 bits: a chunk's 24 bytes (32 codes) as int16 in k order, codes 0-15 and 16-31: the
// form the 8-bit tile's codes take for madd. Each int16 lane takes the 16-bit window of
// the 3-byte group that holds its code (b0 << 8, b0 | b1 << 8, b1 | b2 << 8, b2: the code
// at bit 8, 6, 4, 2) and shifts it down with one unsigned multiply-high. Both halves are
// 16-byte loads inside the chunk (at 0 and at 8), each shuffled per lane from its own
// bytes: 8 instructions a chunk where widening to bytes and then to int16 took ~15 and a
// copy of the row's last chunk, which left 6-bit heads well behind 8-bit ones on AVX2
// (bench/results/ARCHIVE.md, "6-bit codes fast on AVX2").
SPECMLX_AVX2_Q8 inline __attribute__((always_inline)) __m256i widen6_half(const uint8_t* p, __m256i windows) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i down = _mm256_setr_epi16(
      1 << 8, 1 << 10, 1 << 12, 1 << 14, 1 << 8, 1 << 10, 1 << 12, 1 << 14,
      1 << 8, 1 << 10, 1 << 12, 1 << 14, 1 << 8, 1 << 10, 1 << 12, 1 << 14);
  return _mm256_and_si256(_mm256_mulhi_epu16(_mm256_shuffle_epi8(b, windows), down), _mm256_set1_epi16(0x3F));
}

// The shuffle that gives each int16 lane its window, for the 8 codes from byte `at` of a
// lane's 16 loaded bytes: codes 0-7 of a 16-code half at 0, 8-15 at 6 (the half at 0), or at
// 4 and 10 (the half loaded from byte 8).
SPECMLX_AVX2_Q8 inline __m128i six_windows(int a) {
  return _mm_setr_epi8(-1, a, a, a + 1, a + 1, a + 2, a + 2, -1, -1, a + 3, a + 3, a + 4, a + 4, a + 5, a + 5, -1);
}

SPECMLX_AVX2_Q8 inline __attribute__((always_inline)) void widen6_chunk(
    const uint8_t* p, __m256i first, __m256i second, __m256i& lo, __m256i& hi) {
  lo = widen6_half(p, first);
  hi = widen6_half(p + 8, second);
}

// The four-row tile on AVX2, for 4-bit weights (packed or not): the same integer sums and
// the same float sequence as tile4_q8_vnni512 (above), so the same results, bitwise. A
// 128-code chunk runs as two halves of 32 bytes a row; half h holds blocks 2h and 2h + 1,
// whose lanes 4q + r are lanes 0..7 (h = 0) and 8..15 (h = 1) of the AVX-512 tile's
// accumulator: acc[m][h] is that half of it, and the last step adds the halves as the
// AVX-512 tile adds its 256-bit halves. One packed stream a tile instead of the two-row
// tile's four (two rows of codes, two of scales) and a lane reduction before the float
// work: half the float operations a code.
constexpr int kAvx2QuadMaxRows = 4;  // 2 accumulators a row of x, 8 code registers

// n (4, 8 or 16) values of type ST from p as floats, exactly: v[0] takes values 0..7 (0..3
// of 4 in its low half), v[1] values 8..15.
template <ScaleType ST, int N>
SPECMLX_AVX2_Q8 inline __attribute__((always_inline)) void values256(const uint8_t* p, __m256 (&v)[2]) {
  if constexpr (N == 4) {
    if constexpr (ST == ScaleType::f32) {
      v[0] = _mm256_castps128_ps256(_mm_loadu_ps(reinterpret_cast<const float*>(p)));
    } else {
      const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      v[0] = _mm256_castps128_ps256(ST == ScaleType::f16 ? _mm_cvtph_ps(h)
                                                        : _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)));
    }
  } else {
    #pragma GCC unroll 2
    for (int i = 0; i < N / 8; ++i) {
      if constexpr (ST == ScaleType::f32) {
        v[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * i);
      } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + i);
        v[i] = ST == ScaleType::f16 ? _mm256_cvtph_ps(h)
                                    : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
    }
  }
}

// Half h of a chunk's scale register: lane 4q' + r takes row r's scale for block 2h + q'
// (block_lanes' index r * PerRow + q * 32 / GS), picked from values256's two registers.
template <int GS, int PerRow>
SPECMLX_AVX2_Q8 inline __attribute__((always_inline)) __m256 half_lanes(const __m256 (&v)[2], int h) {
  alignas(32) static constexpr std::array<std::array<int32_t, 8>, 2> index = [] {
    std::array<std::array<int32_t, 8>, 2> a{};
    for (int half = 0; half < 2; ++half) {
      for (int q = 0; q < 2; ++q) {
        for (int r = 0; r < 4; ++r) {
          a[half][4 * q + r] = r * PerRow + (2 * half + q) * 32 / GS;
        }
      }
    }
    return a;
  }();
  const __m256i i = _mm256_load_si256(reinterpret_cast<const __m256i*>(index[h].data()));
  if constexpr (4 * PerRow <= 8) {
    return _mm256_permutevar8x32_ps(v[0], i);
  } else {  // 16 values: lanes whose index is 8 or more come from v[1]
    const __m256i seven = _mm256_set1_epi32(7);
    const __m256 from_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(i, seven));
    const __m256i at = _mm256_and_si256(i, seven);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(v[0], at), _mm256_permutevar8x32_ps(v[1], at), from_hi);
  }
}

// Lanes 4q' + r of half h: value 2h + q' of four, for every r (a chunk's x scales, or four
// groups' x sums).
SPECMLX_AVX2_Q8 inline __attribute__((always_inline)) __m256 spread_half(const float* p, int h) {
  const __m256i i = h == 0 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) : _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), i);
}

template <int MT, int GS, ScaleType ST, bool PACKED, Stream S = Stream::l1>
SPECMLX_AVX2_Q8 void tile4_q8_avx2(const QmmJob& j, const int (&n)[4], int m0) {
  constexpr _mm_hint kHint = S == Stream::l1 ? _MM_HINT_T0 : _MM_HINT_T1;
  using T = QuadRows<GS, ST>;
  constexpr int kCodes = T::kCodes, kBytes = T::kBytes, kGroups = T::kGroups, kChunkBytes = T::kChunkBytes;
  const auto [groups, chunks, tail, w, s, pk, xq, xd] = T(j, n, m0, PACKED);
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);

  __m256 acc[MT][2];
  #pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  }
  for (int c = 0; c < chunks; ++c) {
    __m256 sv[2];
    if constexpr (PACKED) {
      const uint8_t* p = pk + size_t(c) * kChunkBytes;
      for (int r = 0; r < 5; ++r) {  // the four rows' codes, then the scales
        _mm_prefetch(reinterpret_cast<const char*>(p) + r * kBytes + kPackedPrefetchBytes, kHint);
      }
      values256<ST, 4 * kGroups>(p + 4 * kBytes, sv);
    } else {  // the packed chunk's values, gathered from the rows
      alignas(32) float v[16] = {};
      const int g0 = c * kCodes / GS, count = std::min(kGroups, groups - g0);
      for (int r = 0; r < 4; ++r) {
        const auto row = scales_from<kGroups>(j.scales, s[r] + g0, ST, count);
        std::copy(row.begin(), row.end(), v + r * kGroups);
        _mm_prefetch(reinterpret_cast<const char*>(w[r] + c * kBytes) + kPrefetchBytes, _MM_HINT_T0);
      }
      sv[0] = _mm256_load_ps(v);
      sv[1] = _mm256_load_ps(v + 8);
    }
    #pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i lo[4], hi[4];
      #pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        __m256i b;
        if constexpr (PACKED) {  // codes zero-padded to whole chunks
          b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pk + size_t(c) * kChunkBytes + r * kBytes + 32 * h));
        } else {
          const int have = c + 1 < chunks ? 32 : std::clamp(tail - 32 * h, 0, 32);
          const uint8_t* p = w[r] + c * kBytes + 32 * h;
          b = have == 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
              : have == 16 ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                           : _mm256_setzero_si256();
        }
        lo[r] = _mm256_and_si256(b, low4);
        hi[r] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
      }
      const __m256 sc = half_lanes<GS, kGroups>(sv, h);
      #pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const int8_t* qm = xq + size_t(m) * j.ldq + c * kCodes + 32 * h;
        const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qm));
        const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qm + kBytes));
        __m256i i[4];
        #pragma GCC unroll 4
        for (int r = 0; r < 4; ++r) {  // int32 lanes of 8 codes; lanes 0..3 block 2h, 4..7 block 2h + 1
          i[r] = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], xl), _mm256_maddubs_epi16(hi[r], xh)), ones);
        }
        const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(i[0], i[1]), _mm256_unpackhi_epi32(i[0], i[1]));
        const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(i[2], i[3]), _mm256_unpackhi_epi32(i[2], i[3]));
        const __m256i sums = _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
        const __m256 dm = spread_half(xd + size_t(m) * j.ldd + c * kCodes / kQ8Block, h);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(sc, dm), acc[m][h]);
      }
    }
  }
  // The bias term, four groups a step: lane 4q + r takes row r's group g + q.
  for (int g = 0; g < groups; g += 4) {
    __m256 bv[2];
    if constexpr (PACKED) {
      values256<ST, 16>(pk + size_t(chunks) * kChunkBytes + size_t(g / 4) * 16 * scale_bytes(ST), bv);
    } else {
      alignas(32) float v[16] = {};
      for (int q = 0; q < 4 && g + q < groups; ++q) {
        for (int r = 0; r < 4; ++r) {
          v[4 * q + r] = scale_f16c(j.biases, s[r] + g + q, ST);
        }
      }
      bv[0] = _mm256_load_ps(v);
      bv[1] = _mm256_load_ps(v + 8);
    }
    #pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const float* xs = j.xs + size_t(m0 + m) * j.ldg + g;
      acc[m][0] = _mm256_fmadd_ps(bv[0], spread_half(xs, 0), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(bv[1], spread_half(xs, 1), acc[m][1]);
    }
  }
  #pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const __m256 h = _mm256_add_ps(acc[m][0], acc[m][1]);
    store_quad(j, n, m0 + m, h);
  }
}

// The two-row tile for 8 and 6 bits. ST, the scales' type, a template parameter: see
// halves8_512. 6 bits run as 8 once widened.
template <int MT, int GS, int BITS, ScaleType ST>
SPECMLX_AVX2_Q8 void tile_q8_avx2(const QmmJob& j, int n0, int n1, int m0) {
  static_assert(BITS == 6 || BITS == 8, "4 bits run on tile4_q8_avx2");
  constexpr int kCodes = 32, kBytes = kCodes * BITS / 8;
  const int bytes = j.K * BITS / 8, groups = j.K / GS;
  const int chunks = j.K / kCodes;  // K is a multiple of a group
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n0) * bytes;
  const uint8_t* w1 = reinterpret_cast<const uint8_t*>(j.w) + size_t(n1) * bytes;
  const size_t s0 = size_t(n0) * groups, s1 = size_t(n1) * groups;
  const int16_t* xw = j.xw;  // rows m0 .. m0 + MT - 1 of x (qmm_rows_q8)
  const float* xd = j.xd + size_t(m0) * j.ldd;
  const __m256i six_lo = _mm256_setr_m128i(six_windows(0), six_windows(6));
  const __m256i six_hi = _mm256_setr_m128i(six_windows(4), six_windows(10));

  __m256 acc0[MT], acc1[MT];  // the loops over them unrolled, as in tile_q8_vnni512
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    acc0[m] = _mm256_setzero_ps();
    acc1[m] = _mm256_setzero_ps();
  }
  __m256 sc0 = _mm256_setzero_ps(), sc1 = _mm256_setzero_ps();
  for (int c = 0; c < chunks; ++c) {
    if (c % 2 == 0) {  // a cache line is two chunks (8 bits; 6 bits: a little less)
      prefetch_streams<2 * kBytes>(w0, w1, c / 2);
    }
    // Two registers of codes per row: the chunk's first and last 16 codes widened to int16.
    __m256i lo0, hi0, lo1, hi1;
    if constexpr (BITS == 6) {  // K is a multiple of 32 (of a group): every chunk is full
      widen6_chunk(w0 + c * kBytes, six_lo, six_hi, lo0, hi0);
      widen6_chunk(w1 + c * kBytes, six_lo, six_hi, lo1, hi1);
    } else {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + c * kBytes));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + c * kBytes));
      lo0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(b0));
      hi0 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(b0, 1));
      lo1 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(b1));
      hi1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(b1, 1));
    }
    // A chunk lies in one group: one scale for all lanes, read once a group.
    if (c % (GS / kCodes) == 0) {
      sc0 = _mm256_set1_ps(scale_f16c(j.scales, s0 + c * kCodes / GS, ST));
      sc1 = _mm256_set1_ps(scale_f16c(j.scales, s1 + c * kCodes / GS, ST));
    }
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const int16_t* q = xw + size_t(m) * j.ldq + c * kCodes;
      const float* dm = xd + size_t(m) * j.ldd + c * kCodes / kQ8Block;  // the chunk's blocks
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16));
      const __m256 d = _mm256_set1_ps(dm[0]);
      const __m256i i0 = _mm256_add_epi32(_mm256_madd_epi16(lo0, xl), _mm256_madd_epi16(hi0, xh));
      const __m256i i1 = _mm256_add_epi32(_mm256_madd_epi16(lo1, xl), _mm256_madd_epi16(hi1, xh));
      acc0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(sc0, d), acc0[m]);
      acc1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(sc1, d), acc1[m]);
    }
  }
  for (int g = 0; g < groups; g += 8) {
    const int count = std::min(8, groups - g);
    const __m256 bv0 = biases8_256(j.biases, s0 + g, ST, count);
    const __m256 bv1 = biases8_256(j.biases, s1 + g, ST, count);
    #pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      const __m256 xs = _mm256_loadu_ps(j.xs + size_t(m0 + m) * j.ldg + g);
      acc0[m] = _mm256_fmadd_ps(bv0, xs, acc0[m]);
      acc1[m] = _mm256_fmadd_ps(bv1, xs, acc1[m]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    float* y = j.y + size_t(m0 + m) * j.N;
    y[n0] = hsum256(acc0[m]);
    if (n1 != n0) {
      y[n1] = hsum256(acc1[m]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Tables of instantiations: [bits 4/6/8][group size 32/64/128][MT - 1], each entry picking
// the tile for the job's scale type (a template parameter of the tiles).
template <int MT, int GS, int BITS, bool VBMI>
void run_vnni512(const QmmJob& j, int n0, int n1, int m0) {
  with_scale_type(j.stype, [&](auto st) { tile_q8_vnni512<MT, GS, BITS, st.value, VBMI>(j, n0, n1, m0); });
}
template <int MT, int GS, bool PACKED, Stream S, bool AVX2>
void run_quad(const QmmJob& j, const int (&n)[4], int m0) {
  with_scale_type(j.stype, [&](auto st) {
    if constexpr (AVX2) {
      tile4_q8_avx2<MT, GS, st.value, PACKED, S>(j, n, m0);
    } else {
      tile4_q8_vnni512<MT, GS, st.value, PACKED, S>(j, n, m0);
    }
  });
}
template <int MT, int GS, int BITS>
void run_avx2(const QmmJob& j, int n0, int n1, int m0) {
  with_scale_type(j.stype, [&](auto st) { tile_q8_avx2<MT, GS, BITS, st.value>(j, n0, n1, m0); });
}

template <int GS, int BITS, bool VBMI, int... MT>
constexpr std::array<TileFn, sizeof...(MT)> vnni512_tiles(std::integer_sequence<int, MT...>) {
  return {&run_vnni512<MT + 1, GS, BITS, VBMI>...};
}
template <int GS, int BITS, int... MT>
constexpr std::array<TileFn, sizeof...(MT)> avx2_tiles(std::integer_sequence<int, MT...>) {
  return {&run_avx2<MT + 1, GS, BITS>...};
}

template <int BITS, bool VBMI = false>
TileFn pick_vnni512(int group_size, int mt) {
  if constexpr (BITS == 6 && !VBMI) {
    if (vbmi_enabled()) {
      return pick_vnni512<6, true>(group_size, mt);
    }
  }
  using Seq = std::make_integer_sequence<int, kVnniMaxRows>;
  static constexpr auto g32 = vnni512_tiles<32, BITS, VBMI>(Seq{});
  static constexpr auto g64 = vnni512_tiles<64, BITS, VBMI>(Seq{});
  static constexpr auto g128 = vnni512_tiles<128, BITS, VBMI>(Seq{});
  return (group_size == 32 ? g32 : group_size == 64 ? g64 : g128)[mt - 1];
}

using QuadFn = void (*)(const QmmJob&, const int (&)[4], int m0);
template <int GS, bool PACKED, Stream S, bool AVX2, int... MT>
constexpr std::array<QuadFn, sizeof...(MT)> quad_tiles(std::integer_sequence<int, MT...>) {
  return {&run_quad<MT + 1, GS, PACKED, S, AVX2>...};
}
template <bool PACKED, Stream S, bool AVX2>
QuadFn pick_quad(int group_size, int mt) {
  using Seq = std::make_integer_sequence<int, AVX2 ? kAvx2QuadMaxRows : kQuadMaxRows>;
  static constexpr auto g32 = quad_tiles<32, PACKED, S, AVX2>(Seq{});
  static constexpr auto g64 = quad_tiles<64, PACKED, S, AVX2>(Seq{});
  static constexpr auto g128 = quad_tiles<128, PACKED, S, AVX2>(Seq{});
  return (group_size == 32 ? g32 : group_size == 64 ? g64 : g128)[mt - 1];
}
// The four-row tile for the ISA its q8 tiles run (tiles: avx512 or avx2).
template <bool PACKED, Stream S = Stream::l1>
QuadFn pick_quad(Isa tiles, int group_size, int mt) {
  return tiles == Isa::avx2 ? pick_quad<PACKED, S, true>(group_size, mt) : pick_quad<PACKED, S, false>(group_size, mt);
}

template <int BITS>
TileFn pick_avx2(int group_size, int mt) {
  using Seq = std::make_integer_sequence<int, kAvx2MaxRows>;
  static constexpr auto g32 = avx2_tiles<32, BITS>(Seq{});
  static constexpr auto g64 = avx2_tiles<64, BITS>(Seq{});
  static constexpr auto g128 = avx2_tiles<128, BITS>(Seq{});
  return (group_size == 32 ? g32 : group_size == 64 ? g64 : g128)[mt - 1];
}

int round_up(int v, int to) {
  return (v + to - 1) / to * to;
}

// ---------------------------------------------------------------------------------------
// Quantizing x. Every version computes the same codes: max |x| is exact in any order, and
// the scale, its inverse, the products and their rounding (to nearest even, the default
// MXCSR mode, by cvtss2si / cvtps2dq) are the same float32 operations.
struct Block {
  float scale;
  int sum;  // of the codes
};

inline float block_inverse(float amax) {
  return amax > 0.0f ? 1.0f / (amax / 127.0f) : 0.0f;
}

Block quantize_block(const float* x, int8_t* even, int8_t* odd, int step) {
  float amax = 0.0f;
  for (int i = 0; i < kQ8Block; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
  }
  const float inv = block_inverse(amax);
  int sum = 0;
  for (int i = 0; i < kQ8Block; i += 2) {
    const int c0 = std::clamp(_mm_cvtss_si32(_mm_set_ss(x[i] * inv)), -127, 127);
    const int c1 = std::clamp(_mm_cvtss_si32(_mm_set_ss(x[i + 1] * inv)), -127, 127);
    even[i / 2 * step] = int8_t(c0);
    odd[i / 2 * step] = int8_t(c1);
    sum += c0 + c1;
  }
  return {amax / 127.0f, sum};
}

// The vector versions store the block's codes split (even k to `even`, odd k to `odd`, 16
// each) or, with split false, in k order from `even` on.
SPECMLX_VNNI512 Block quantize_block512(const float* x, int8_t* even, int8_t* odd, bool split) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(block_inverse(amax));
  const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
  const __m512i ca = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), lim), neg);
  const __m512i cb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), lim), neg);
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  if (split) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(even), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(ca, evens, cb)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(odd), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(ca, odds, cb)));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(even), _mm512_cvtepi32_epi8(ca));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(even + 16), _mm512_cvtepi32_epi8(cb));
  }
  return {amax / 127.0f, _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb))};
}

SPECMLX_AVX2_Q8 Block quantize_block256(const float* x, int8_t* even, int8_t* odd, bool split) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(block_inverse(amax));
  const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
  alignas(32) int codes[kQ8Block];
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256i c = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lim), neg);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i), c);
    sum = _mm256_add_epi32(sum, c);
  }
  for (int i = 0; i < kQ8Block; i += 2) {
    if (split) {
      even[i / 2] = int8_t(codes[i]);
      odd[i / 2] = int8_t(codes[i + 1]);
    } else {
      even[i] = int8_t(codes[i]);
      even[i + 1] = int8_t(codes[i + 1]);
    }
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return {amax / 127.0f, _mm_cvtsi128_si32(t)};
}

} // namespace

int q8_chunk(Isa isa) {
  switch (q8_isa(isa)) {
    case Isa::avx512:
      return 128;
    case Isa::avx2:  // the four-row tile's layout, two halves at a time
      return 128;
    case Isa::scalar:
      return 1;
  }
  return 1;
}

const char* q8_kernel_name(Isa isa) {
  switch (q8_isa(isa)) {
    case Isa::avx512:
      return vbmi_enabled() ? "vnni512+vbmi" : "vnni512";
    case Isa::avx2:
      return "avx2";
    case Isa::scalar:
      return "scalar";
  }
  return "?";
}

// Rows padded to whole chunks, plus one cache line: real rows are multiples of 1 KiB, and
// the tiles read up to 8 of them at the same offset (see row_stride in qmm.cpp).
int q8_row_bytes(int K, Isa) {
  return round_up(K, 128) + 64;
}

int q8_row_scales(int K, Isa isa) {
  return q8_row_bytes(K, isa) / kQ8Block;
}

int q8_row_groups(int K, int group_size) {
  return round_up(K / group_size, 16);  // the bias step reads 16 groups at a time
}

void quantize_row_q8(const float* x, int K, int group_size, int bits, Isa isa, int8_t* q, float* d, float* s) {
  const int chunk = bits == 4 ? q8_chunk(isa) : 1;  // 8- and 6-bit codes, and so q, are in k order
  const Isa kernel = q8_isa(isa);
  std::fill_n(q, q8_row_bytes(K, isa), int8_t(0));
  std::fill_n(d, q8_row_scales(K, isa), 0.0f);
  std::fill_n(s, q8_row_groups(K, group_size), 0.0f);
  for (int k0 = 0; k0 < K; k0 += kQ8Block) {
    // A block lies inside one chunk (chunks are 1 or a multiple of 64 codes): its even k
    // go to 16 consecutive bytes of the chunk's first half, its odd k to the second half.
    int8_t* even = q + k0;
    int8_t* odd = q + k0 + 1;
    int step = 2;
    if (chunk > 1) {
      const int r = k0 % chunk;
      even = q + (k0 - r) + r / 2;
      odd = even + chunk / 2;
      step = 1;
    }
    const bool split = chunk > 1;
    const Block b = kernel == Isa::avx512 ? quantize_block512(x + k0, even, odd, split)
        : kernel == Isa::avx2             ? quantize_block256(x + k0, even, odd, split)
                                          : quantize_block(x + k0, even, odd, step);
    d[k0 / kQ8Block] = b.scale;
    s[k0 / group_size] += b.scale * float(b.sum);
  }
}

size_t packed_tile_bytes(int K, int group_size, ScaleType t) {
  const int chunks = (K + 127) / 128, groups = K / group_size;
  return size_t(chunks) * packed_chunk_bytes(group_size, t) + size_t((groups + 3) / 4) * 16 * scale_bytes(t);
}

void pack_quad(const uint8_t* w, const uint8_t* scales, const uint8_t* biases, int N, int K, int group_size,
               ScaleType t, uint8_t* out) {
  const int chunks = (K + 127) / 128, groups = K / group_size, per_chunk = std::max(1, 128 / group_size);
  const int e = scale_bytes(t), row_bytes = K / 2;
  const size_t tile = packed_tile_bytes(K, group_size, t);
  std::fill_n(out, size_t(N / 4) * tile, uint8_t(0));
  for (int n0 = 0; n0 + 4 <= N; n0 += 4) {
    uint8_t* p = out + size_t(n0 / 4) * tile;
    for (int c = 0; c < chunks; ++c, p += packed_chunk_bytes(group_size, t)) {
      const int take = std::min(64, row_bytes - c * 64);
      for (int r = 0; r < 4; ++r) {
        std::copy_n(w + size_t(n0 + r) * row_bytes + c * 64, take, p + r * 64);
        for (int i = 0; i < per_chunk && c * per_chunk + i < groups; ++i) {
          std::copy_n(scales + (size_t(n0 + r) * groups + c * per_chunk + i) * e, e,
                      p + 256 + (r * per_chunk + i) * e);
        }
      }
    }
    for (int g = 0; g < groups; g += 4, p += 16 * e) {
      for (int q = 0; q < 4 && g + q < groups; ++q) {
        for (int r = 0; r < 4; ++r) {
          std::copy_n(biases + (size_t(n0 + r) * groups + g + q) * e, e, p + (4 * q + r) * e);
        }
      }
    }
  }
}

bool quad_tiles(Isa isa) {
  return q8_isa(isa) != Isa::scalar;
}

// Rows m0 .. m0 + mt - 1 of x's codes as int16, for the AVX2 8- and 6-bit tiles (vpmaddwd
// takes int16): widened here once per x tile, weight block and thread (one of each at decode
// and verify), where each tile had widened its rows again for every pair of output rows,
// two of its ~14 instructions a chunk and row.
const int16_t* widen_rows(const QmmJob& j, int m0, int mt) {
  thread_local std::unique_ptr<int16_t[]> buf;
  thread_local size_t cap = 0;
  const size_t n = size_t(mt) * j.ldq;
  int16_t* out = scratch(buf, cap, n);
  std::copy_n(j.xq + size_t(m0) * j.ldq, n, out);
  return out;
}

void qmm_rows_q8(Isa isa, const QmmJob& job, int n0, int n1) {
  if (job.xb != nullptr) {  // prepare_x_amx laid x out for AMX
    return qmm_rows_amx(job, n0, n1);
  }
  const Isa tiles = q8_isa(isa);
  QmmJob j = job;
  const bool quad = quad_tiles(isa) && j.bits == 4;
  const int tile_rows = quad ? (tiles == Isa::avx2 ? kAvx2QuadMaxRows : kQuadMaxRows)
      : tiles == Isa::avx512 ? kVnniMaxRows
      : tiles == Isa::avx2   ? kAvx2MaxRows
                             : kScalarMaxRows;
  const int out_rows = quad ? 4 : 2;  // output rows a tile computes
  // With more rows of x than one tile takes (prefill), output rows go in blocks whose
  // weights (codes, scales, biases) fit in half of L2; each x tile (a few rows of q and d:
  // L1-sized for K up to a few thousand) sweeps one block before the next comes in, so
  // each weight is read from memory once, not M / MT times. With one tile (decode, verify)
  // the block is the whole range.
  //
  // A tile takes row n with rows n + part, n + 2 part ... of its block (part: the block's
  // rows over the tile's), not with n + 1: each of its weight streams (and each scale and
  // bias stream) then runs on through memory, row after row, which the hardware
  // prefetchers follow. Adjacent rows read interleaved runs of one row each that then jump
  // ahead; the prefetchers lose them (a weights-only read in that order ran at a third of a
  // sequential one, bench/results/row_pairing.md). A row's result does not depend on its
  // partners; past the block's end a tile repeats its first row.
  const size_t weight_bytes = size_t(j.K) * j.bits / 8 + 8 * size_t(j.K / j.group_size);
  const int block = j.M <= tile_rows
      ? n1 - n0
      : std::max(out_rows, int(kL2Bytes / 2 / weight_bytes) / out_rows * out_rows);
  for (int nb = n0; nb < n1; nb += block) {
    const int nb_end = std::min(n1, nb + block);
    const int part = (nb_end - nb + out_rows - 1) / out_rows;
    for (int m0 = 0; m0 < j.M; m0 += tile_rows) {
      const int mt = std::min(tile_rows, j.M - m0);
      if (tiles == Isa::avx2 && !quad) {
        j.xw = widen_rows(j, m0, mt);
      }
      if (quad && j.packed != nullptr) {  // tiles of four adjacent rows, one stream each
        const QuadFn tile = packed_stream(j, mt) == Stream::l1 ? pick_quad<true, Stream::l1>(tiles, j.group_size, mt)
                                                               : pick_quad<true, Stream::l2>(tiles, j.group_size, mt);
        for (int a = nb; a < nb_end; a += 4) {
          tile(j, {a, a + 1, a + 2, a + 3}, m0);
        }
        continue;
      }
      for (int a = nb; a < nb + part; ++a) {
        if (quad) {
          int n[4];
          for (int r = 0; r < 4; ++r) {
            n[r] = a + r * part < nb_end ? a + r * part : a;
          }
          pick_quad<false>(tiles, j.group_size, mt)(j, n, m0);
          continue;
        }
        const int b = a + part < nb_end ? a + part : a;  // a lone middle row of an odd block
        switch (tiles) {
          case Isa::avx512:
            (j.bits == 6 ? pick_vnni512<6> : pick_vnni512<8>)(j.group_size, mt)(j, a, b, m0);
            break;
          case Isa::avx2:
            (j.bits == 6 ? pick_avx2<6> : pick_avx2<8>)(j.group_size, mt)(j, a, b, m0);
            break;
          case Isa::scalar:
            tile_q8_scalar(j, a, b, m0, mt);
            break;
        }
      }
    }
  }
}

} // namespace specmlx
