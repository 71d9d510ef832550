// INT4 weights x int8 activations on AMX (Sapphire Rapids and later): the four-row VNNI
// tile's sums and float sequence (kernels_q8.cpp), computed 16 x 16 at a time.
//
// One tdpbusd multiplies a 16-row tile of unsigned weight codes (16 output rows, one
// 32-block each: 32 bytes) by a tile of x's signed codes (the same block of 16 rows of x,
// in the 4-byte-interleaved order AMX takes) into 16 x 16 exact int32 block sums, where
// VNNI needs 8 instructions and two folds for 4 x 1. The float step after it is the
// quad tile's, per output row and row of x: a_(b % 4) = fma(float(I_b), s * d, a_(b % 4)),
// then the biases, then (a_0 + a_2) + (a_1 + a_3); so a row's result is the same bits
// whichever tile computed it, and prefill can use AMX while decode and verify (a few rows)
// stay on VNNI.
//
// Linux hands out AMX's tile data (8 KiB of state a thread) only on request:
// arch_prctl(ARCH_REQ_XCOMP_PERM) once per process.
#include "amx.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cpuid.h>
#include <cstring>
#include <memory>

#include "scratch.h"

#pragma GCC diagnostic ignored "-Wuninitialized"

namespace specmlx {
namespace {

constexpr int kTile = 16;       // output rows, and rows of x, of one tile
constexpr int kBlockB = 512;    // bytes of x's tile for one block: 8 rows of 16 x 4 codes
constexpr int kChunkBytes = 64; // weight bytes unpacked at a time: 4 blocks of a row

bool cpu_and_os_grant_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    return false;
  }
  const bool tile = d & (1u << 24), int8 = d & (1u << 25);
  if (!tile || !int8 || !__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
    return false;
  }
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

std::atomic<bool> g_amx_on{true};

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: two tiles of weights (16 output rows x 32 bytes: one block); tmm2, tmm3: two
// of x (8 rows x 64 bytes: the block of 16 rows of x); tmm4..7: their four products
// (16 x 16 int32). Each tile loaded feeds two products: tile loads, not tdpbusd, bound a
// tile that loads both operands per product (README.md, "int8 activations", AMX).
SPECMLX_AMX void configure_tiles() {
  TileConfig cfg;
  for (int t : {0, 1}) {
    cfg.rows[t] = kTile, cfg.colsb[t] = 32;
  }
  for (int t : {2, 3}) {
    cfg.rows[t] = 8, cfg.colsb[t] = 64;
  }
  for (int t : {4, 5, 6, 7}) {
    cfg.rows[t] = kTile, cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Where block b's tiles are kept, in units of one tile (512 bytes): blocks in the order
// the accumulators take them (b = 0, 4, 8, ..., then 1, 5, ...), so that each of a tile's
// passes reads its weights and x as two runs through memory, which the prefetchers follow
// (with the blocks in k order, every weight tile was 16 rows apart and tileloadd waited on
// L2).
inline int block_slot(int b, int blocks) {
  int slot = b / 4;
  for (int q = 0; q < b % 4; ++q) {
    slot += (blocks - q + 3) / 4;
  }
  return slot;
}

// Rows n .. n + count - 1 of the weights, unpacked for tileloadd: block b of them (16 rows
// of [16 low nibbles, 16 high nibbles] of its 16 bytes: codes k = 2i and 2i + 1 of byte i)
// at slot block_slot(b); rows past count are zero.
SPECMLX_AMX void unpack_weights(const QmmJob& j, int n, int count, uint8_t* out) {
  const int bytes = j.K / 2, blocks = j.K / kQ8Block, chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  const int tail = bytes - (chunks - 1) * kChunkBytes;
  const __mmask64 tail_mask = tail == kChunkBytes ? ~__mmask64(0) : (__mmask64(1) << tail) - 1;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  int slot[4];
  for (int q = 0; q < 4; ++q) {
    slot[q] = block_slot(q, blocks);
  }
  for (int r = 0; r < kTile; ++r) {
    const size_t row = size_t(r) * kQ8Block;
    if (r >= count) {
      for (int b = 0; b < blocks; ++b) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + size_t(slot[b % 4] + b / 4) * kBlockB + row),
                            _mm256_setzero_si256());
      }
      continue;
    }
    const uint8_t* w = reinterpret_cast<const uint8_t*>(j.w) + size_t(n + r) * bytes;
    for (int c = 0; c < chunks; ++c) {
      const __m512i v = c + 1 < chunks ? _mm512_loadu_si512(w + c * kChunkBytes)
                                       : _mm512_maskz_loadu_epi8(tail_mask, w + c * kChunkBytes);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const __m512i pair[2] = {_mm512_permutex2var_epi64(lo, first, hi), _mm512_permutex2var_epi64(lo, second, hi)};
      for (int q = 0; q < 4 && 4 * c + q < blocks; ++q) {
        const __m256i block = q % 2 == 0 ? _mm512_castsi512_si256(pair[q / 2]) : _mm512_extracti64x4_epi64(pair[q / 2], 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + size_t(slot[q] + c) * kBlockB + row), block);
      }
    }
  }
}

// a += float(sums) * (s * d) for one block: the quad tile's float step, 16 x 16; sc holds
// the block's group's scale of each output row, `groups` apart.
SPECMLX_AMX inline __attribute__((always_inline)) void block_step(
    float (&a)[kTile][kTile], const int32_t* sums, const float* xd, const float* sc, int groups) {
  const __m512 d = _mm512_loadu_ps(xd);
  #pragma GCC unroll 16
  for (int r = 0; r < kTile; ++r) {
    const __m512 i = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kTile));
    _mm512_store_ps(a[r], _mm512_fmadd_ps(i, _mm512_mul_ps(_mm512_set1_ps(sc[size_t(r) * groups]), d), _mm512_load_ps(a[r])));
  }
}

// a += bias * xs for the groups g = q mod 4, in order.
SPECMLX_AMX inline void bias_steps(float (&a)[kTile][kTile], const float* xs, const float* bs, int groups, int q) {
  __m512 v[kTile];
  #pragma GCC unroll 16
  for (int r = 0; r < kTile; ++r) {
    v[r] = _mm512_load_ps(a[r]);
  }
  for (int g = q; g < groups; g += 4) {
    const __m512 x = _mm512_loadu_ps(xs + size_t(g) * kTile);
    #pragma GCC unroll 16
    for (int r = 0; r < kTile; ++r) {
      v[r] = _mm512_fmadd_ps(_mm512_set1_ps(bs[size_t(r) * groups + g]), x, v[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < kTile; ++r) {
    _mm512_store_ps(a[r], v[r]);
  }
}

// count scales or biases from p[i] on as float32 (exactly) into out.
template <ScaleType ST>
SPECMLX_AMX void widen(const void* p, size_t i, int count, float* out) {
  for (int g = 0; g < count; g += 16) {
    const __mmask16 valid = __mmask16(count - g >= 16 ? 0xFFFF : (1u << (count - g)) - 1);
    __m512 v;
    if constexpr (ST == ScaleType::f32) {
      v = _mm512_maskz_loadu_ps(valid, static_cast<const float*>(p) + i + g);
    } else {
      const __m256i h = _mm256_maskz_loadu_epi16(valid, static_cast<const uint16_t*>(p) + i + g);
      v = ST == ScaleType::f16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    _mm512_mask_storeu_ps(out + g, valid, v);
  }
}

// Two 16-row tiles of output rows (count of them from n: up to 32) against every x tile,
// two x tiles at a time. Accumulator a_q of the quad tile's sequence sees only blocks
// b = q mod 4 and then groups g = q mod 4, each in order; so here the four run one after
// another.
template <int GS, ScaleType ST>
SPECMLX_AMX void tile_rows_amx(const QmmJob& j, int n, int count, uint8_t* wt, float* sc, float* bs) {
  const int blocks = j.K / kQ8Block, groups = j.K / GS, x_tiles = (j.M + kTile - 1) / kTile;
  const bool two_n = count > kTile;
  const size_t w_tile = size_t(kTile) * j.K;  // bytes of one tile of unpacked weights
  unpack_weights(j, n, std::min(count, kTile), wt);
  if (two_n) {
    unpack_weights(j, n + kTile, count - kTile, wt + w_tile);
  }
  for (int r = 0; r < 2 * kTile; ++r) {
    if (r < count) {
      widen<ST>(j.scales, size_t(n + r) * groups, groups, sc + size_t(r) * groups);
      widen<ST>(j.biases, size_t(n + r) * groups, groups, bs + size_t(r) * groups);
    } else {
      std::fill_n(sc + size_t(r) * groups, groups, 0.0f);
      std::fill_n(bs + size_t(r) * groups, groups, 0.0f);
    }
  }
  asm volatile("" ::: "memory");  // tileloadd reads wt: the stores above come first
  alignas(64) int32_t sums[4][kTile * kTile];
  alignas(64) float part[2][2][4][kTile][kTile];  // [n tile][x tile][q][output row][row of x]
  for (int t = 0; t < x_tiles; t += 2) {
    const bool two_x = t + 1 < x_tiles;
    const int8_t* xb = j.xb + size_t(t) * blocks * kBlockB;
    const size_t x_tile = size_t(blocks) * kBlockB;
    const float* xd[2] = {j.xdt + size_t(t) * blocks * kTile, j.xdt + size_t(t + 1) * blocks * kTile};
    const float* xs[2] = {j.xst + size_t(t) * j.ldg * kTile, j.xst + size_t(t + 1) * j.ldg * kTile};
    std::memset(part, 0, sizeof part);
    for (int q = 0; q < 4; ++q) {
      const size_t first = size_t(block_slot(q, blocks)) * kBlockB;
      for (int b = q, i = 0; b < blocks; b += 4, ++i) {
        const size_t at = first + size_t(i) * kBlockB;
        _tile_loadd(0, wt + at, kQ8Block);
        _tile_loadd(2, xb + at, 64);
        _tile_zero(4);
        _tile_dpbusd(4, 0, 2);
        if (two_x) {
          _tile_loadd(3, xb + x_tile + at, 64);
          _tile_zero(5);
          _tile_dpbusd(5, 0, 3);
        }
        if (two_n) {
          _tile_loadd(1, wt + w_tile + at, kQ8Block);
          _tile_zero(6);
          _tile_dpbusd(6, 1, 2);
          if (two_x) {
            _tile_zero(7);
            _tile_dpbusd(7, 1, 3);
          }
        }
        _tile_stored(4, sums[0], 64);
        if (two_x) {
          _tile_stored(5, sums[1], 64);
        }
        if (two_n) {
          _tile_stored(6, sums[2], 64);
          if (two_x) {
            _tile_stored(7, sums[3], 64);
          }
        }
        const int g = b * kQ8Block / GS;
        for (int nt = 0; nt < (two_n ? 2 : 1); ++nt) {
          for (int xt = 0; xt < (two_x ? 2 : 1); ++xt) {
            block_step(part[nt][xt][q], sums[2 * nt + xt], xd[xt] + size_t(b) * kTile,
                       sc + size_t(nt) * kTile * groups + g, groups);
          }
        }
      }
      for (int nt = 0; nt < (two_n ? 2 : 1); ++nt) {
        for (int xt = 0; xt < (two_x ? 2 : 1); ++xt) {
          bias_steps(part[nt][xt][q], xs[xt], bs + size_t(nt) * kTile * groups, groups, q);
        }
      }
    }
    for (int xt = 0; xt < (two_x ? 2 : 1); ++xt) {
      const int rows_x = std::min(kTile, j.M - (t + xt) * kTile);
      for (int r = 0; r < count; ++r) {
        const float(*p)[kTile][kTile] = part[r / kTile][xt];
        const int rr = r % kTile;
        alignas(64) float y[kTile];
        _mm512_store_ps(y, _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(p[0][rr]), _mm512_load_ps(p[2][rr])),
                                         _mm512_add_ps(_mm512_load_ps(p[1][rr]), _mm512_load_ps(p[3][rr]))));
        for (int m = 0; m < rows_x; ++m) {
          j.y[size_t((t + xt) * kTile + m) * j.N + n + r] = y[m];
        }
      }
    }
  }
}

template <int GS>
void rows_amx(const QmmJob& j, int n, int count, uint8_t* wt, float* sc, float* bs) {
  with_scale_type(j.stype, [&](auto st) { tile_rows_amx<GS, st.value>(j, n, count, wt, sc, bs); });
}

} // namespace

bool amx_available() {
  static const bool granted = cpu_and_os_grant_amx();
  return granted;
}

bool amx_enabled() {
  return amx_available() && g_amx_on.load(std::memory_order_relaxed);
}

void set_amx(bool on) {
  g_amx_on.store(on, std::memory_order_relaxed);
}

bool amx_rows(const QmmJob& j, Isa isa) {
  return j.bits == 4 && j.M >= kAmxMinRows && isa == Isa::avx512 && amx_enabled();
}

void prepare_x_amx(QmmJob& j) {
  thread_local std::unique_ptr<int8_t[]> b_buf;
  thread_local std::unique_ptr<float[]> f_buf;
  thread_local size_t b_cap = 0, f_cap = 0;
  const int blocks = j.K / kQ8Block, tiles = (j.M + kTile - 1) / kTile;
  int8_t* xb = scratch(b_buf, b_cap, size_t(tiles) * blocks * kBlockB);
  float* xd = scratch(f_buf, f_cap, size_t(tiles) * kTile * (blocks + j.ldg));
  float* xs = xd + size_t(tiles) * blocks * kTile;
  // x's codes of block b in tdpbusd's order: position p < 16 is code k = 32b + 2p, the
  // even ones (the weights' low nibbles), p >= 16 the odd ones; in quantize_row_q8's chunk
  // layout those are 16 bytes at 16 * (b % 4) and 16 at 64 + 16 * (b % 4) of chunk b / 4.
  // Position p of row m goes to row p / 4, byte 4 m + p % 4 of the block's tile.
  for (int t = 0; t < tiles; ++t) {
    for (int b = 0; b < blocks; ++b) {
      int8_t* tile = xb + (size_t(t) * blocks + block_slot(b, blocks)) * kBlockB;
      for (int m = 0; m < kTile; ++m) {
        const int row = t * kTile + m;
        uint32_t words[8] = {};
        if (row < j.M) {
          const int8_t* q = j.xq + size_t(row) * j.ldq + (b / 4) * 128 + 16 * (b % 4);
          std::memcpy(words, q, 16);
          std::memcpy(words + 4, q + 64, 16);
        }
        for (int p = 0; p < 8; ++p) {
          std::memcpy(tile + p * 64 + 4 * m, words + p, 4);
        }
        xd[(size_t(t) * blocks + b) * kTile + m] = row < j.M ? j.xd[size_t(row) * j.ldd + b] : 0.0f;
      }
    }
    for (int g = 0; g < j.ldg; ++g) {
      for (int m = 0; m < kTile; ++m) {
        const int row = t * kTile + m;
        xs[(size_t(t) * j.ldg + g) * kTile + m] = row < j.M ? j.xs[size_t(row) * j.ldg + g] : 0.0f;
      }
    }
  }
  j.xb = xb;
  j.xdt = xd;
  j.xst = xs;
}

SPECMLX_AMX void qmm_rows_amx(const QmmJob& j, int n0, int n1) {
  thread_local std::unique_ptr<uint8_t[]> w_buf;
  thread_local std::unique_ptr<float[]> s_buf;
  thread_local size_t w_cap = 0, s_cap = 0;
  const int groups = j.K / j.group_size;
  uint8_t* wt = scratch(w_buf, w_cap, size_t(2 * kTile) * j.K);
  float* sc = scratch(s_buf, s_cap, size_t(4) * kTile * groups);
  float* bs = sc + size_t(2 * kTile) * groups;
  configure_tiles();
  for (int n = n0; n < n1; n += 2 * kTile) {
    const int count = std::min(2 * kTile, n1 - n);
    switch (j.group_size) {
      case 32:
        rows_amx<32>(j, n, count, wt, sc, bs);
        break;
      case 64:
        rows_amx<64>(j, n, count, wt, sc, bs);
        break;
      default:
        rows_amx<128>(j, n, count, wt, sc, bs);
        break;
    }
  }
  _tile_release();
}

} // namespace specmlx
