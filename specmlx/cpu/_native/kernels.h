// INT4/INT8 x fp32 matrix kernels: y = x @ dequant(W)^T for MLX's affine 4/8-bit layouts.
#pragma once

#include <cstddef>
#include <cstdint>

// Functions built for one ISA (the file stays baseline x86-64; see detect_isa).
#define SPECMLX_AVX2 __attribute__((target("avx2,fma")))
#define SPECMLX_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace specmlx {

enum class ScaleType { f32, bf16, f16 };
enum class Isa { scalar, avx2, avx512 };

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
};

// The best ISA this CPU (and OS) supports.
Isa detect_isa();
const char* isa_name(Isa isa);

// Floats per vector register: packed x is laid out in groups of this many lanes
// (1 means plain row-major order).
int isa_lanes(Isa isa);

// Output rows [n0, n1) for all M rows of x. Safe to call concurrently on disjoint ranges.
void qmm_rows(Isa isa, const QmmJob& job, int n0, int n1);

} // namespace specmlx
