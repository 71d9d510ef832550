// INT4/INT8 x fp32 matrix kernels: y = x @ dequant(W)^T for MLX's affine 4/8-bit layouts,
// and INT4 x int8 kernels for activations quantized per 32-block (kernels_q8.cpp).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mlx/dtype.h"
#include "mlx/types/half_types.h"

// Functions built for one ISA (the file stays baseline x86-64; see detect_isa).
#define SPECMLX_F16C __attribute__((target("f16c")))
#define SPECMLX_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPECMLX_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define SPECMLX_AVX2_Q8 __attribute__((target("avx2,fma,f16c")))
#define SPECMLX_VNNI512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define SPECMLX_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

namespace specmlx {

enum class ScaleType { f32, bf16, f16 };

// The ScaleType of an array of scales (float32, bfloat16 or float16).
inline ScaleType scale_type(mlx::core::Dtype t) {
  return t == mlx::core::float32 ? ScaleType::f32 : t == mlx::core::bfloat16 ? ScaleType::bf16 : ScaleType::f16;
}
enum class Isa { scalar, avx2, avx512 };

// tile(std::integral_constant<ScaleType, t>{}): a kernel templated on the scales' type,
// called for the type t of a job's scales.
template <typename Tile>
void with_scale_type(ScaleType t, Tile&& tile) {
  switch (t) {
    case ScaleType::f32:
      return tile(std::integral_constant<ScaleType, ScaleType::f32>{});
    case ScaleType::bf16:
      return tile(std::integral_constant<ScaleType, ScaleType::bf16>{});
    case ScaleType::f16:
      return tile(std::integral_constant<ScaleType, ScaleType::f16>{});
  }
}

// Code k of a row of MLX's affine codes: the row is one little-endian bit stream, code k
// in bits k * bits .. k * bits + bits - 1 (4 bits: a nibble, low first; 6 bits: four codes
// in three bytes; 8 bits: byte k). For the scalar kernels and the embedding lookup.
inline int code_at(const uint8_t* row, int k, int bits) {
  const int bit = k * bits, at = bit / 8, shift = bit % 8;
  int v = row[at] >> shift;
  if (shift + bits > 8) {
    v |= row[at + 1] << (8 - shift);
  }
  return v & ((1 << bits) - 1);
}

// A scale or bias as float, for the scalar kernels (MLX's conversions).
inline float scale_at(const void* p, size_t i, ScaleType t) {
  switch (t) {
    case ScaleType::f32:
      return static_cast<const float*>(p)[i];
    case ScaleType::bf16:
      return static_cast<float>(static_cast<const mlx::core::bfloat16_t*>(p)[i]);
    case ScaleType::f16:
      return static_cast<float>(static_cast<const mlx::core::float16_t*>(p)[i]);
  }
  return 0.0f;
}

// A scale or bias as float, for the AVX2 / AVX-512 kernels: fp16 is widened by one F16C
// vcvtph2ps (MLX's float16_t converts in software, a visible share of a decode row's
// time), bf16 by a shift. Both are exact, so the result is the float32 scales' own.
// The scalar kernels keep MLX's conversion: they are what a CPU without F16C runs.
SPECMLX_F16C inline float scale_f16c(const void* p, size_t i, ScaleType t) {
  if (t == ScaleType::f32) {
    return static_cast<const float*>(p)[i];
  }
  const uint16_t half = static_cast<const uint16_t*>(p)[i];
  if (t == ScaleType::f16) {
    return _cvtsh_ss(half);
  }
  const uint32_t bits = uint32_t(half) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One matmul's operands. x has already been converted to fp32 (and, for 4 bits, packed into
// the ISA's lane order: see pack_index in qmm.cpp); y is fp32, M x N row-major.
struct QmmJob {
  const float* x;      // M rows of K, ldx floats apart
  const uint32_t* w;   // N x K*bits/32: code k of a row is bits b*(k%(32/b)).. of word k/(32/b)
  const void* scales;  // N x K/group_size
  const void* biases;  // N x K/group_size, same type as scales
  ScaleType stype;
  float* y;  // M x N
  int M, N, K, group_size, bits;
  int ldx;  // row stride of x, padded past K (see row_stride in qmm.cpp)
  // int8 activations (x above is then unused), see quantize_row_q8:
  const int8_t* xq = nullptr;  // M rows of ldq codes, in the q8 tiles' chunk order
  const float* xd = nullptr;   // M rows of ldd: the scale of each 32-block
  const float* xs = nullptr;   // M rows of ldg: per weight group, sum of scale * code
  int ldq = 0, ldd = 0, ldg = 0;
  const int16_t* xw = nullptr;  // a tile's rows of xq as int16 (the AVX2 8- and 6-bit tiles; qmm_rows_q8 sets it)
  // the same, laid out for the AMX tiles (prepare_x_amx), when the job runs on them
  const int8_t* xb = nullptr;   // per 16 rows of x and 32-block: the block's x tile
  const float* xdt = nullptr;   // per 16 rows and block: the 16 rows' scales
  const float* xst = nullptr;   // per 16 rows and group (ldg of them): the 16 rows' sums
  // the matrix as pack_quad laid it out, or null: read instead of w, scales and biases by
  // the four-row tiles (4 bits, AVX-512 VNNI or AVX2), which then take four adjacent rows a tile
  const uint8_t* packed = nullptr;
};

// Codes x is quantized in: each 32-block of a row gets scale amax/127 and codes in -127..127.
constexpr int kQ8Block = 32;

// The best ISA this CPU (and OS) supports; the AVX2 and AVX-512 kernels need F16C too.
Isa detect_isa();
const char* isa_name(Isa isa);

// Floats per vector register: packed x is laid out in groups of this many lanes
// (1 means plain row-major order).
int isa_lanes(Isa isa);

// Output rows [n0, n1) for all M rows of x. Safe to call concurrently on disjoint ranges.
void qmm_rows(Isa isa, const QmmJob& job, int n0, int n1);

// The int8-activation path. Its 4-bit tiles consume chunks of q8_chunk(isa) codes (1: k
// order), its 8-bit ones take x in k order; q8 rows are padded to a whole number of
// chunks, and then to the strides below.
int q8_chunk(Isa isa);
const char* q8_kernel_name(Isa isa);  // what q8 tiles run under isa: vnni512(+vbmi), avx2, scalar

// The 6-bit tiles widen codes with AVX-512 VBMI where the CPU has it (and VNNI), unless
// switched off (tests: the other widening gives the same bytes).
bool vbmi_available();
bool vbmi_enabled();
void set_vbmi(bool on);
int q8_row_bytes(int K, Isa isa);     // ldq
int q8_row_scales(int K, Isa isa);    // ldd: one scale per 32-block
int q8_row_groups(int K, int group_size);  // ldg

// One row of float x into q (ldq bytes), d (ldd floats), s (ldg floats), laid out for the
// weights' bits. A row's codes depend on that row alone, so its result never depends on the
// rows quantized with it.
void quantize_row_q8(const float* x, int K, int group_size, int bits, Isa isa, int8_t* q, float* d, float* s);

// A 4-bit matrix (N a multiple of 4) laid out for the four-row tiles: per tile of
// rows 4t..4t+3, each 128-code chunk's codes (64 bytes a row, zero-padded) and then its
// scales (row-major, per_chunk = max(1, 128 / group_size) a row), and after the last chunk
// the biases, 16 per four groups (row r's group g + q at 4q + r), zero past the last group;
// scales and biases in their own type. One tile's bytes, and the whole matrix's layout:
size_t packed_tile_bytes(int K, int group_size, ScaleType t);
void pack_quad(const uint8_t* w, const uint8_t* scales, const uint8_t* biases, int N, int K, int group_size,
               ScaleType t, uint8_t* out);

// Whether 4-bit products on int8 x run on a four-row tile under isa (AVX-512 VNNI or
// AVX2; scalar: no): the tiles that read pack_quad's layout.
bool quad_tiles(Isa isa);

// Output rows [n0, n1) for all M rows of the quantized x; 4, 6 or 8 bits.
void qmm_rows_q8(Isa isa, const QmmJob& job, int n0, int n1);

// A gated MLP's activation: out[i] = act(g[i]) * u[i] for i < n (gate.cpp); out may be g or u.
enum class GateAct { silu, gelu_approx };
void gate(Isa isa, GateAct act, const float* g, const float* u, float* out, int n);

} // namespace specmlx
