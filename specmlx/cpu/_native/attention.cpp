// Attention over a KV cache for decode and verify shapes. MLX's CPU
// fast.scaled_dot_product_attention takes many times what reading its K and V takes at
// decode shapes, where the work is small (bench/results/attention.md). Here one pass over
// a KV head's keys serves every query row that reads them (its GQA heads x Lq), and a
// second pass over its values does the same. Why and how: README.md, "Attention".
//
// Row independence, bitwise: a query row's scores, exps, sum and output are computed by
// the same operations in the same order whatever rows run with it, how many threads run,
// how long the cache buffer is and which slots its keys sit in. A row's keys are taken by
// position, not slot: blocks of keys start at positions that are multiples of 16, a row
// runs from the block of its first key to its own last key (slots of a block outside its
// range get -inf, whose exp is exactly 0, and the value pass never reads them), and the
// sum over lanes is a fixed tree. So a verify pass over k rows gives each row the bits a
// one-row decode step gives it, on a sliding window's ring buffer too (rotated in one,
// in time order in the other).
#include "attention.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "kernels.h"
#include "scratch.h"
#include "strided.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"
#include "rope.h"
#include "thread_pool.h"
#include "vexp.h"

namespace specmlx {
namespace {

// Keys per score block; S rows are padded to whole blocks. Inside a block, scores are
// summed 4 keys at a time for up to 4 query rows (the rows share each load of a key).
constexpr int kBlock = 16;
constexpr int kSub = 4;
constexpr int kMaxRowGroup = 4;
// Keys per value block: 32 rows of D <= 128 floats stay in L1 while every query row of a
// tile reads them.
constexpr int kValueBlock = 32;
// Scores a work item keeps (4 MiB): a prefill chunk's rows are cut into parts below it.
constexpr size_t kMaxScores = size_t(1) << 20;
// Waking a parked worker costs more than a small share of work saves (thread_pool.cpp):
// split only when each thread gets this many multiply-adds.
constexpr size_t kMinWorkPerThread = size_t(1) << 20;

struct Call {
  const float* q;  // (B, Hq, Lq, D), row-contiguous
  const float* k;  // strides below, in floats; the D axis is contiguous
  const float* v;
  float* out;  // (B, Hq, Lq, D)
  const float* sinks;  // (Hq,) or null
  int B, Hq, Hkv, Lq, Lk, D;
  int64_t ksb, ksh, ksl, vsb, vsh, vsl;
  float scale;
  bool causal;
  int window;  // 0: none
  int64_t key_start;  // the position of the oldest key, in slot `rotation`
  int rotation;
  // (Lq, Lk), optional: row i reads the key in slot j only where mask[i * Lk + j], within
  // its range (a tree's rows: the context and their own ancestors).
  const bool* mask = nullptr;

  bool masked(int i, int64_t p) const {
    return mask != nullptr && !mask[int64_t(i) * Lk + slot(p)];
  }

  // The positions query row i (0 <= i < Lq) reads: [first, last].
  std::pair<int64_t, int64_t> range(int i) const {
    if (!causal) {
      return {key_start, key_start + Lk - 1};
    }
    const int64_t last = key_start + Lk - Lq + i;
    return {window > 0 ? std::max(key_start, last - window + 1) : key_start, last};
  }
  // The slot of position p (key_start <= p < key_start + Lk).
  int slot(int64_t p) const {
    const int64_t j = p - key_start + rotation;
    return int(j < Lk ? j : j - Lk);
  }
};

// How far ahead the score and value passes fetch a head's keys and values, in their own
// blocks: over a cache that comes from DRAM (28 layers of 1500 positions: 86 MB) the
// hardware prefetchers leave the passes waiting on memory. 2 blocks (16 and 32 KB ahead)
// gained the most of 2, 4 and 8 (bench/results/ARCHIVE.md, "fewer nodes a step").
constexpr int kAheadBlocks = 2;

// Every line of `rows` rows of D floats, `ld` apart, into L1.
inline void prefetch_rows(const float* p, int rows, int64_t ld, int D) {
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < D; d += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(p + r * ld + d), _MM_HINT_T0);
    }
  }
}

int64_t block_floor(int64_t p, int block) {
  return p / block * block;  // positions are >= 0
}

// ---- AVX-512 ----

// Lane i of the result: the sum of a[i]'s 16 lanes, by a fixed tree of unpacks, shuffles
// and adds (45 instructions for 16 dot products, against ~8 for one horizontal sum). Every
// lane gets the same tree, ((e0 + e2) + (e1 + e3)) within each 128-bit quarter and then
// (Q0 + Q2) + (Q1 + Q3), so a dot product's bits do not depend on the lane it lands in.
SPECMLX_AVX512 inline __m512 sum_lanes16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: sums 4i .. 4i+3, a quarter of each
    u[i] = _mm512_add_ps(
        _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  }
  const __m512 w01 = _mm512_add_ps(
      _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w23 = _mm512_add_ps(
      _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(
      _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[r][j] = q[r] . k_j for 4 rows and the 16 keys k_j = k + j * ldk: 4 keys at a time, 16
// accumulators (row-major), so each load of a key chunk feeds 4 FMAs.
SPECMLX_AVX512 void scores_avx512(const float* const* q, const float* k, int64_t ldk, int D, float* const* s) {
  const float *q0 = q[0], *q1 = q[1], *q2 = q[2], *q3 = q[3];
  for (int j0 = 0; j0 < kBlock; j0 += kSub) {
    const float* k0 = k + j0 * ldk;
    const float *k1 = k0 + ldk, *k2 = k1 + ldk, *k3 = k2 + ldk;
    __m512 a[16];
    for (__m512& x : a) {
      x = _mm512_setzero_ps();
    }
    for (int c = 0; c < D; c += 16) {
      const __m512 x[4] = {
          _mm512_loadu_ps(k0 + c), _mm512_loadu_ps(k1 + c), _mm512_loadu_ps(k2 + c), _mm512_loadu_ps(k3 + c)};
      const __m512 y[4] = {
          _mm512_loadu_ps(q0 + c), _mm512_loadu_ps(q1 + c), _mm512_loadu_ps(q2 + c), _mm512_loadu_ps(q3 + c)};
      for (int r = 0; r < 4; ++r) {
        for (int j = 0; j < 4; ++j) {
          a[4 * r + j] = _mm512_fmadd_ps(y[r], x[j], a[4 * r + j]);
        }
      }
    }
    alignas(64) float out[16];
    _mm512_store_ps(out, sum_lanes16(a));
    for (int r = 0; r < 4; ++r) {
      std::copy(out + 4 * r, out + 4 * r + 4, s[r] + j0);
    }
  }
}

// s (n floats, a multiple of 16) := exp(s - top), top = max(max s, sink); returns the sum
// plus exp(sink - top): a sink (-inf where there is none) joins the denominator only.
SPECMLX_AVX512 float exp_row_avx512(float* s, int n, float sink) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int i = 0; i < n; i += 16) {
    m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
  }
  const float peak = std::max(lanes_max(m), sink);
  const __m512 top = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), top));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  return lanes_sum(sum) + std::exp(sink - peak);
}

// acc[0, 16 NC) += sum over j < count of p[j] * v_j[0, 16 NC), v_j = v + j * ldv, in j
// order per lane. NC is a constant so that the accumulators live in registers.
template <int NC>
SPECMLX_AVX512 void values_chunks_avx512(const float* p, int count, const float* v, int64_t ldv, float* acc) {
  __m512 a[NC];
  for (int c = 0; c < NC; ++c) {
    a[c] = _mm512_loadu_ps(acc + 16 * c);
  }
  for (int j = 0; j < count; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const float* vj = v + j * ldv;
    for (int c = 0; c < NC; ++c) {
      a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * c), a[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    _mm512_storeu_ps(acc + 16 * c, a[c]);
  }
}

template <size_t... I>
constexpr auto values_table_avx512(std::index_sequence<I...>) {
  return std::array{&values_chunks_avx512<int(I) + 1>...};
}

// acc += sum over j < count of p[j] * v_j, up to 256 floats of D at a time.
SPECMLX_AVX512 void values_avx512(const float* p, int count, const float* v, int64_t ldv, int D, float* acc) {
  static constexpr auto table = values_table_avx512(std::make_index_sequence<16>{});
  for (int c0 = 0; c0 < D; c0 += 256) {
    table[std::min(16, (D - c0) / 16) - 1](p, count, v + c0, ldv, acc + c0);
  }
}

// ---- AVX2 + FMA ----

// Lane i: the sum of a[i]'s 8 lanes, by the AVX-512 tree on 256 bits (the same for every
// lane: ((e0 + e2) + (e1 + e3)) per half, then the halves).
SPECMLX_AVX2 inline __m256 sum_lanes8(const __m256* a) {
  __m256 t[4];
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
  const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[r][j] = q[r] . k_j for 2 rows and 16 keys, 4 keys at a time (8 accumulators).
SPECMLX_AVX2 void scores_avx2(const float* const* q, const float* k, int64_t ldk, int D, float* const* s) {
  const float *q0 = q[0], *q1 = q[1];
  for (int j0 = 0; j0 < kBlock; j0 += kSub) {
    const float* k0 = k + j0 * ldk;
    const float *k1 = k0 + ldk, *k2 = k1 + ldk, *k3 = k2 + ldk;
    __m256 a[8];
    for (__m256& x : a) {
      x = _mm256_setzero_ps();
    }
    for (int c = 0; c < D; c += 8) {
      const __m256 x[4] = {
          _mm256_loadu_ps(k0 + c), _mm256_loadu_ps(k1 + c), _mm256_loadu_ps(k2 + c), _mm256_loadu_ps(k3 + c)};
      const __m256 y0 = _mm256_loadu_ps(q0 + c), y1 = _mm256_loadu_ps(q1 + c);
      for (int j = 0; j < 4; ++j) {
        a[j] = _mm256_fmadd_ps(y0, x[j], a[j]);
        a[4 + j] = _mm256_fmadd_ps(y1, x[j], a[4 + j]);
      }
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, sum_lanes8(a));
    std::copy(out, out + 4, s[0] + j0);
    std::copy(out + 4, out + 8, s[1] + j0);
  }
}

SPECMLX_AVX2 float exp_row_avx2(float* s, int n, float sink) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int i = 0; i < n; i += 8) {
    m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
  }
  const float peak = std::max(lanes_max(m), sink);
  const __m256 top = _mm256_set1_ps(peak);
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), top));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  return lanes_sum(sum) + std::exp(sink - peak);
}

template <int NC>
SPECMLX_AVX2 void values_chunks_avx2(const float* p, int count, const float* v, int64_t ldv, float* acc) {
  __m256 a[NC];
  for (int c = 0; c < NC; ++c) {
    a[c] = _mm256_loadu_ps(acc + 8 * c);
  }
  for (int j = 0; j < count; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = v + j * ldv;
    for (int c = 0; c < NC; ++c) {
      a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), a[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    _mm256_storeu_ps(acc + 8 * c, a[c]);
  }
}

template <size_t... I>
constexpr auto values_table_avx2(std::index_sequence<I...>) {
  return std::array{&values_chunks_avx2<int(I) + 1>...};
}

// Up to 96 floats of D at a time (12 accumulators of the 16 ymm registers).
SPECMLX_AVX2 void values_avx2(const float* p, int count, const float* v, int64_t ldv, int D, float* acc) {
  static constexpr auto table = values_table_avx2(std::make_index_sequence<12>{});
  for (int c0 = 0; c0 < D; c0 += 96) {
    table[std::min(12, (D - c0) / 8) - 1](p, count, v + c0, ldv, acc + c0);
  }
}

// ---- scalar ----

void scores_scalar(const float* const* q, const float* k, int64_t ldk, int D, float* const* s) {
  for (int j = 0; j < kBlock; ++j) {
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) {
      dot += q[0][d] * k[j * ldk + d];
    }
    s[0][j] = dot;
  }
}

float exp_row_scalar(float* s, int n, float sink) {
  const float top = std::max(*std::max_element(s, s + n), sink);
  double sum = std::exp(sink - top);
  for (int i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - top);
    sum += s[i];
  }
  return float(sum);
}

void values_scalar(const float* p, int count, const float* v, int64_t ldv, int D, float* acc) {
  for (int j = 0; j < count; ++j) {
    for (int d = 0; d < D; ++d) {
      acc[d] += p[j] * v[j * ldv + d];
    }
  }
}

struct Kernels {
  int rows;  // query rows per scores call
  void (*scores)(const float* const*, const float*, int64_t, int, float* const*);
  float (*exp_row)(float*, int, float);
  void (*values)(const float*, int, const float*, int64_t, int, float*);
};

Kernels kernels_for(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return {4, scores_avx512, exp_row_avx512, values_avx512};
    case Isa::avx2:
      return {2, scores_avx2, exp_row_avx2, values_avx2};
    case Isa::scalar:
      break;
  }
  return {1, scores_scalar, exp_row_scalar, values_scalar};
}

// Rows [r0, r1) of one tile: the query rows that read KV head `kvh` of batch `b`, ordered
// (GQA head, query position). Three passes over the tile's rows: scores block by block
// (each block of keys read from memory once for all rows), exp and sum per row, then values
// block by block. Blocks cover positions [16 m, 16 m + 16): a row's scores sit at the same
// lanes whichever rows share its tile and wherever its keys sit in the buffer.
void attend(const Kernels& kern, const Call& c, int tile, int r0, int r1) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local size_t cap = 0;
  const int b = tile / c.Hkv, kvh = tile % c.Hkv, group = c.Hq / c.Hkv, D = c.D;
  const int rows = r1 - r0;
  auto row_index = [&](int r) {  // (b, head, i) of the tile's row r, as a row of q and out
    const int head = kvh * group + r / c.Lq, i = r % c.Lq;
    return (size_t(b) * c.Hq + head) * c.Lq + i;
  };
  int64_t lowest = INT64_MAX, highest = -1;
  for (int r = r0; r < r1; ++r) {
    const auto [lo, hi] = c.range(r % c.Lq);
    lowest = std::min(lowest, lo), highest = std::max(highest, hi);
  }
  const int64_t first = block_floor(lowest, kBlock);  // the position of the scores' slot 0
  const int lds = int(block_floor(highest - first + kBlock, kBlock));
  float* qs = scratch(buf, cap, size_t(rows) * (2 * D + lds + 1) + kBlock * D);
  float* acc = qs + size_t(rows) * D;
  float* s = acc + size_t(rows) * D;
  float* inv = s + size_t(rows) * lds;  // 1 / sum of exps, per row
  float* kpad = inv + rows;
  const float* kb = c.k + b * c.ksb + kvh * c.ksh;
  const float* vb = c.v + b * c.vsb + kvh * c.vsh;
  const int64_t end = c.key_start + c.Lk;  // past the newest key's position

  for (int r = r0; r < r1; ++r) {
    const float* q = c.q + row_index(r) * D;
    float* qr = qs + size_t(r - r0) * D;
    for (int d = 0; d < D; ++d) {
      qr[d] = q[d] * c.scale;
    }
    std::fill(acc + size_t(r - r0) * D, acc + size_t(r - r0 + 1) * D, 0.0f);
  }

  for (int64_t j0 = first; j0 <= highest; j0 += kBlock) {
    if (const int64_t a = j0 + kAheadBlocks * kBlock;
        a >= c.key_start && a + kBlock <= end && c.slot(a) + kBlock <= c.Lk) {
      prefetch_rows(kb + c.slot(a) * c.ksl, kBlock, c.ksl, D);
    }
    const float* kj = nullptr;
    int64_t ldk = c.ksl;
    if (j0 >= c.key_start && j0 + kBlock <= end && c.slot(j0) + kBlock <= c.Lk) {
      kj = kb + c.slot(j0) * c.ksl;
    } else {  // a block past either end of the keys, or across the ring's seam: copied
      std::fill(kpad, kpad + kBlock * D, 0.0f);
      for (int64_t p = std::max(j0, c.key_start); p < std::min(j0 + kBlock, end); ++p) {
        const float* key = kb + c.slot(p) * c.ksl;
        std::copy(key, key + D, kpad + (p - j0) * D);
      }
      kj = kpad;
      ldk = D;
    }
    for (int g = r0; g < r1; g += kern.rows) {
      const float* qp[kMaxRowGroup];
      float* sp[kMaxRowGroup];
      bool needed = false;
      for (int i = 0; i < kern.rows; ++i) {
        // A short last group repeats its last row: the same bits to the same place.
        const int r = std::min(g + i, r1 - 1);
        const auto [lo, hi] = c.range(r % c.Lq);
        qp[i] = qs + size_t(r - r0) * D;
        sp[i] = s + size_t(r - r0) * lds + (j0 - first);
        needed |= j0 <= hi && j0 + kBlock > lo;
      }
      if (needed) {
        kern.scores(qp, kj, ldk, D, sp);
      }
    }
    for (int r = r0; r < r1; ++r) {  // keys outside a row's range weigh nothing
      const auto [lo, hi] = c.range(r % c.Lq);
      float* sr = s + size_t(r - r0) * lds + (j0 - first);
      for (int j = 0; j < kBlock; ++j) {
        if (j0 + j < lo || j0 + j > hi || c.masked(r % c.Lq, j0 + j)) {
          sr[j] = -INFINITY;
        }
      }
    }
  }

  // A tree's rows (mask): each row's kept keys' scores moved together, in position order,
  // from its first position on, so that its softmax sums them in the lanes, and its values
  // take them in the order, of the chain of its ancestors (a left-out key between them
  // shifted the lanes the later ones summed in, and with them the sum's rounding: a tree's
  // path then read other bits than the same tokens verified as a chain). kept[r - r0]: the
  // positions the moved scores came from.
  std::vector<std::vector<int64_t>> kept(c.mask != nullptr ? rows : 0);
  for (int r = r0; r < r1 && c.mask != nullptr; ++r) {
    const auto [lo, hi] = c.range(r % c.Lq);
    float* sr = s + size_t(r - r0) * lds - first;  // indexed by position
    auto& from = kept[r - r0];
    for (int64_t p = lo; p <= hi; ++p) {
      if (!c.masked(r % c.Lq, p)) {
        sr[lo + int64_t(from.size())] = sr[p];  // never ahead of p: in place
        from.push_back(p);
      }
    }
    std::fill(sr + lo + int64_t(from.size()), sr + hi + 1, -INFINITY);
  }

  for (int r = r0; r < r1; ++r) {
    const auto [lo, hi] = c.range(r % c.Lq);
    const int64_t from = block_floor(lo, kBlock);
    const int n = int(block_floor(hi - from + kBlock, kBlock));
    const float sink = c.sinks ? c.sinks[kvh * group + (r / c.Lq)] : -INFINITY;
    inv[r - r0] = 1.0f / kern.exp_row(s + size_t(r - r0) * lds + (from - first), n, sink);
  }

  for (int64_t j0 = first; j0 <= highest; j0 += kValueBlock) {
    if (const int64_t a = j0 + kAheadBlocks * kValueBlock;
        a >= c.key_start && a + kValueBlock <= end && c.slot(a) + kValueBlock <= c.Lk) {
      prefetch_rows(vb + c.slot(a) * c.vsl, kValueBlock, c.vsl, D);
    }
    for (int r = r0; r < r1 && c.mask == nullptr; ++r) {
      const auto [lo, hi] = c.range(r % c.Lq);
      const float* sr = s + size_t(r - r0) * lds - first;  // indexed by position
      // The row's keys of this block in position order, in runs of consecutive slots.
      for (int64_t p = std::max(j0, lo), stop = std::min(j0 + kValueBlock, hi + 1); p < stop;) {
        const int j = c.slot(p), count = int(std::min<int64_t>(stop - p, c.Lk - j));
        kern.values(sr + p, count, vb + j * c.vsl, c.vsl, D, acc + size_t(r - r0) * D);
        p += count;
      }
    }
  }

  for (int r = r0; r < r1 && c.mask != nullptr; ++r) {  // a tree's rows: their kept keys
    const int64_t lo = c.range(r % c.Lq).first;
    const float* sr = s + size_t(r - r0) * lds - first + lo;  // the moved scores
    const auto& from = kept[r - r0];
    for (size_t k = 0; k < from.size();) {  // in runs of consecutive slots
      const int j = c.slot(from[k]);
      size_t count = 1;
      while (k + count < from.size() && from[k + count] == from[k] + int64_t(count) &&
             c.slot(from[k + count]) == j + int(count)) {
        ++count;
      }
      kern.values(sr + k, int(count), vb + j * c.vsl, c.vsl, D, acc + size_t(r - r0) * D);
      k += count;
    }
  }

  for (int r = r0; r < r1; ++r) {
    const float* a = acc + size_t(r - r0) * D;
    float* o = c.out + row_index(r) * D;
    for (int d = 0; d < D; ++d) {
      o[d] = a[d] * inv[r - r0];
    }
  }
}

void run(const Call& c) {
  const Kernels kern = kernels_for(active_isa());
  auto& pool = ThreadPool::instance();
  const int tiles = c.B * c.Hkv, rows = c.Hq / c.Hkv * c.Lq;
  // Rows' ranges move up with their position: row 0 starts lowest, row Lq - 1 ends highest.
  const size_t span = size_t(c.range(c.Lq - 1).second - c.range(0).first + 1);
  const size_t per_row = c.causal && c.window > 0 ? std::min<size_t>(span, c.window) : span;
  const size_t work = size_t(c.B) * c.Hq * c.Lq * per_row * c.D * 2;
  const int n_threads = int(std::clamp<size_t>(work / kMinWorkPerThread, 1, pool.size()));
  // With fewer tiles than threads, a tile's rows are split, and so are those of a long
  // prefill chunk whose scores would not fit kMaxScores: every row still computes the same
  // bits, whichever part it falls in.
  const size_t lds = span + 2 * kBlock;
  const int parts = std::min<size_t>(
      rows, std::max<size_t>((n_threads + tiles - 1) / tiles, (rows * lds + kMaxScores - 1) / kMaxScores));
  const int items = tiles * parts;
  const int used = std::min(n_threads, items);
  pool.run(used, [&](int t) {
    for (int item = int(int64_t(items) * t / used); item < int(int64_t(items) * (t + 1) / used); ++item) {
      const int tile = item / parts, part = item % parts;
      attend(kern, c, tile, rows * part / parts, rows * (part + 1) / parts);
    }
  });
}

} // namespace

void Attention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(q);
  encoder.set_input_array(k);
  encoder.set_input_array(v);
  const bool has_sinks = inputs.size() > (has_mask_ ? 4 : 3);
  if (has_sinks) {
    encoder.set_input_array(inputs[3]);
  }
  if (has_mask_) {
    encoder.set_input_array(inputs.back());
  }
  encoder.set_output_array(out);
  if (out.size() == 0) {
    return;
  }
  Call call{
      q.data<float>(),
      k.data<float>(),
      v.data<float>(),
      out.data<float>(),
      has_sinks ? inputs[3].data<float>() : nullptr,
      q.shape(0),
      q.shape(1),
      k.shape(1),
      q.shape(2),
      k.shape(2),
      q.shape(3),
      k.strides()[0],
      k.strides()[1],
      k.strides()[2],
      v.strides()[0],
      v.strides()[1],
      v.strides()[2],
      scale_,
      causal_,
      window_,
      key_start_,
      rotation_,
      has_mask_ ? inputs.back().data<bool>() : nullptr};
  // q is gathered row-contiguous if it is not; k and v are read in place through their
  // strides unless their D axis is not contiguous. MLX keeps the buffers alive until the
  // stream has run this task.
  const bool k_dense = k.strides()[3] == 1 || k.shape(3) == 1;
  const bool v_dense = v.strides()[3] == 1 || v.shape(3) == 1;
  encoder.dispatch([call, q, k, v, k_dense, v_dense]() mutable {
    thread_local std::vector<float> qbuf, kbuf, vbuf;
    call.q = row_major(q, qbuf);
    const int64_t L = call.Lk, D = call.D, H = call.Hkv;
    if (!k_dense) {
      call.k = row_major(k, kbuf);
      call.ksb = H * L * D, call.ksh = L * D, call.ksl = D;
    }
    if (!v_dense) {
      call.v = row_major(v, vbuf);
      call.vsb = H * L * D, call.vsh = L * D, call.vsl = D;
    }
    run(call);
  });
}

void Attention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[specmlx] the native attention has no GPU kernel");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Attention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && window_ == o.window_ && key_start_ == o.key_start_ &&
      rotation_ == o.rotation_ && has_mask_ == o.has_mask_;
}

mx::array scaled_dot_product_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    const std::optional<mx::array>& sinks,
    int window,
    int64_t key_start,
    int rotation,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] attention runs on CPU streams only");
  }
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) {
    throw std::invalid_argument("[specmlx] attention takes float32 q, k and v");
  }
  if (q.ndim() != 4 || k.ndim() != 4 || k.shape() != v.shape()) {
    throw std::invalid_argument("[specmlx] attention takes q (B, Hq, Lq, D) and k, v (B, Hkv, Lk, D)");
  }
  const int D = q.shape(3);
  if (k.shape(0) != q.shape(0) || k.shape(3) != D || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    throw std::invalid_argument("[specmlx] attention: k and v must match q's batch and D, Hq a multiple of Hkv");
  }
  if (D % kHeadDimStep != 0 || D <= 0 || D > kMaxHeadDim) {
    throw std::invalid_argument("[specmlx] attention takes head sizes that are multiples of 16 up to 512");
  }
  if (k.shape(2) == 0 || (causal && q.shape(2) > k.shape(2))) {
    throw std::invalid_argument("[specmlx] attention needs at least one key for every query row");
  }
  if (window < 0 || (window > 0 && !causal) || key_start < 0 || rotation < 0 || rotation >= k.shape(2)) {
    throw std::invalid_argument(
        "[specmlx] attention: window >= 0 (causal only), key_start >= 0 and 0 <= rotation < Lk");
  }
  std::vector<mx::array> inputs = {q, k, v};  // q as it is: see eval_cpu
  if (sinks) {
    if (sinks->dtype() != mx::float32 || sinks->ndim() != 1 || sinks->shape(0) != q.shape(1)) {
      throw std::invalid_argument("[specmlx] attention takes float32 sinks of shape (Hq,)");
    }
    inputs.push_back(mx::contiguous(*sinks, false, stream));
  }
  if (mask) {
    if (mask->dtype() != mx::bool_ || mask->ndim() != 2 || mask->shape(0) != q.shape(2) ||
        mask->shape(1) != k.shape(2)) {
      throw std::invalid_argument("[specmlx] attention takes a bool mask of shape (Lq, Lk)");
    }
    inputs.push_back(mx::contiguous(*mask, false, stream));
  }
  return mx::array(
      q.shape(),
      mx::float32,
      std::make_shared<Attention>(stream, scale, causal, window, key_start, rotation, mask.has_value()),
      std::move(inputs));
}

bool take_cache_buffer(const mx::array& in, mx::array& out, bool reuse) {
  const auto& data = in.data_shared_ptr();
  if (reuse && data.use_count() == 1 && data->is_owned() && in.flags().row_contiguous) {
    out.copy_shared_buffer(in);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return true;
}

void copy_cache(const mx::array& in, float* out) {
  thread_local std::vector<float> scratch;
  const float* src = row_major(in, scratch);
  std::copy(src, src + in.size(), out);
}

void cached_attention_rows(const CachedJob& j) {
  thread_local std::unique_ptr<float[]> rows;
  thread_local size_t rows_cap = 0;
  const int B = j.B, L = j.L, Hq = j.Hq, Hkv = j.Hkv, S = j.S, D = j.D;
  const int64_t sb = int64_t(Hkv) * S * D, sh = int64_t(S) * D;
  Call call{nullptr, nullptr, nullptr, nullptr, nullptr, B, Hq, Hkv, L, j.offset + L, D,
            sb, sh, D, sb, sh, D, j.scale, j.causal, 0, 0, 0};
  RopeJob rope{
      nullptr, 0, 0, 0, 1, nullptr, 0, 0, 0, 0, 0, 0, D, j.rope_dims, j.rope_traditional, j.rope_base, j.rope_scale,
      j.offset};
  // q rotated into (B, Hq, L, D), the layout the attention reads; with L = 1 that is the
  // output's own layout, so the attention writes there directly.
  float* qr = scratch(rows, rows_cap, size_t(B) * Hq * L * D * (L > 1 ? 2 : 1));
  RopeJob rq = rope;
  rq.x = j.q;
  rq.stride_b = int64_t(L) * Hq * D, rq.stride_h = D, rq.stride_t = int64_t(Hq) * D;
  rq.out = qr, rq.out_b = int64_t(Hq) * L * D, rq.out_h = int64_t(L) * D, rq.out_t = D;
  rq.B = B, rq.H = Hq, rq.T = L;
  rope_rows(rq);
  // k rotated straight into its cache slots; v copied into its own.
  RopeJob rk = rope;
  rk.x = j.k;
  rk.stride_b = int64_t(L) * Hkv * D, rk.stride_h = D, rk.stride_t = int64_t(Hkv) * D;
  rk.out = j.k_cache + int64_t(j.offset) * D, rk.out_b = sb, rk.out_h = sh, rk.out_t = D;
  rk.B = B, rk.H = Hkv, rk.T = L;
  rope_rows(rk);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < L; ++t) {
      for (int h = 0; h < Hkv; ++h) {
        const float* src = j.v + ((int64_t(b) * L + t) * Hkv + h) * D;
        std::copy(src, src + D, j.v_cache + b * sb + h * sh + int64_t(j.offset + t) * D);
      }
    }
  }
  call.q = qr, call.k = j.k_cache, call.v = j.v_cache;
  float* heads = L > 1 ? qr + size_t(B) * Hq * L * D : j.out;
  call.out = heads;
  run(call);
  if (L > 1) {  // (B, Hq, L, D) to (B, L, Hq, D)
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < Hq; ++h) {
        for (int t = 0; t < L; ++t) {
          const float* src = heads + ((int64_t(b) * Hq + h) * L + t) * D;
          std::copy(src, src + D, j.out + ((int64_t(b) * L + t) * Hq + h) * D);
        }
      }
    }
  }
}

void CachedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto &q = inputs[0], &k = inputs[1], &v = inputs[2], &k_cache = inputs[3], &v_cache = inputs[4];
  auto &out = outputs[0], &k_out = outputs[1], &v_out = outputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const bool copy_k = take_cache_buffer(k_cache, k_out, reuse_), copy_v = take_cache_buffer(v_cache, v_out, reuse_);
  // The caches are held by the task only where it copies them: a reference would keep the
  // next step from taking their buffers while this task waits to run.
  std::optional<mx::array> k_from, v_from;
  if (copy_k) {
    k_from = k_cache;
  }
  if (copy_v) {
    v_from = v_cache;
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  CachedJob job{nullptr, nullptr, nullptr, k_out.data<float>(), v_out.data<float>(), out.data<float>(),
                q.shape(0), q.shape(1), n_heads_, k_cache.shape(1), k_cache.shape(2), k_cache.shape(3), offset_,
                rope_dims_, rope_traditional_, rope_base_, rope_scale_, scale_, causal_};
  encoder.dispatch([job, q, k, v, k_from, v_from]() mutable {
    thread_local std::vector<float> qbuf, kbuf, vbuf;
    if (k_from) {
      copy_cache(*k_from, job.k_cache);
    }
    if (v_from) {
      copy_cache(*v_from, job.v_cache);
    }
    job.q = row_major(q, qbuf), job.k = row_major(k, kbuf), job.v = row_major(v, vbuf);
    cached_attention_rows(job);
  });
}

void CachedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[specmlx] the native cached attention has no GPU kernel");
}

bool CachedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CachedAttention&>(other);
  return n_heads_ == o.n_heads_ && offset_ == o.offset_ && rope_dims_ == o.rope_dims_ &&
      rope_traditional_ == o.rope_traditional_ && rope_base_ == o.rope_base_ && rope_scale_ == o.rope_scale_ &&
      scale_ == o.scale_ && causal_ == o.causal_ && reuse_ == o.reuse_;
}

std::vector<mx::array> cached_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& k_cache,
    const mx::array& v_cache,
    int n_heads,
    int offset,
    int rope_dims,
    bool rope_traditional,
    float rope_base,
    float rope_scale,
    float scale,
    bool causal,
    bool reuse,
    mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] cached attention runs on CPU streams only");
  }
  for (const auto* a : {&q, &k, &v, &k_cache, &v_cache}) {
    if (a->dtype() != mx::float32) {
      throw std::invalid_argument("[specmlx] cached attention takes float32 arrays");
    }
  }
  if (k_cache.ndim() != 4 || v_cache.shape() != k_cache.shape() || q.ndim() != 3 || k.ndim() != 3 ||
      v.ndim() != 3) {
    throw std::invalid_argument(
        "[specmlx] cached attention takes q, k, v (B, L, H*D) and caches (B, Hkv, S, D) of one shape");
  }
  const int B = q.shape(0), L = q.shape(1), Hkv = k_cache.shape(1), S = k_cache.shape(2), D = k_cache.shape(3);
  if (n_heads <= 0 || Hkv <= 0 || n_heads % Hkv != 0 || k_cache.shape(0) != B || q.shape(2) != n_heads * D ||
      k.shape() != mx::Shape{B, L, Hkv * D} || v.shape() != k.shape()) {
    throw std::invalid_argument("[specmlx] cached attention: q, k, v and the caches' shapes do not agree");
  }
  if (D % kHeadDimStep != 0 || D <= 0 || D > kMaxHeadDim) {
    throw std::invalid_argument("[specmlx] cached attention takes head sizes that are multiples of 16 up to 512");
  }
  if (L <= 0 || offset < 0 || int64_t(offset) + L > S) {
    throw std::invalid_argument("[specmlx] cached attention needs room for the new positions in the cache");
  }
  if (rope_dims <= 0 || rope_dims % 2 != 0 || rope_dims > D) {
    throw std::invalid_argument("[specmlx] rope dims must be even, positive and at most D");
  }
  return mx::array::make_arrays(
      {q.shape(), k_cache.shape(), v_cache.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<CachedAttention>(
          stream, n_heads, offset, rope_dims, rope_traditional, rope_base, rope_scale, scale, causal, reuse),
      {q, k, v, k_cache, v_cache});
}

} // namespace specmlx
