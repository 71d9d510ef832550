// act(g) * u over a row: a gated MLP's activation, applied by the gated matmul (qmm.cpp) to
// its two products. silu(g) = g sigmoid(g) (Llama, Qwen, Mistral...) and gelu_approx(g) =
// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) = g sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))
// (Gemma). MLX's CPU sigmoid and tanh are scalar on x86 (its generated kernels have no
// -march), so silu(g) * u was a visible share of a decode step; here it is a vector exp
// over the row.
//
// sigmoid(z) = 1 / (1 + e) for z >= 0 and e / (1 + e) below, with e = exp(-|z|) <= 1: the
// vector exp's domain (x <= 0), and no overflow for any z. The AVX-512 and AVX2 exps give
// the same bits, and the rest is IEEE arithmetic in one order, so both paths agree to the bit.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "vexp.h"

namespace specmlx {
namespace {

// The sigmoid's argument: g itself for silu; 2 sqrt(2/pi) (g + 0.044715 g^3) for gelu_approx.
constexpr float kGeluA = 1.5957691216057308f, kGeluB = 0.044715f;

template <GateAct ACT>
SPECMLX_AVX512 void gate_avx512(const float* g, const float* u, float* out, int n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(int(0x80000000u));  // or-ing it: -|x| (AVX-512F has no or_ps)
  for (int i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(valid, g + i);
    __m512 z = x;
    if constexpr (ACT == GateAct::gelu_approx) {
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      z = _mm512_mul_ps(_mm512_set1_ps(kGeluA), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kGeluB), cube)));
    }
    const __m512 e = exp_avx512(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(z), sign)));
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(out + i, valid, _mm512_mul_ps(_mm512_mul_ps(x, s), _mm512_maskz_loadu_ps(valid, u + i)));
  }
}

template <GateAct ACT>
SPECMLX_AVX2 void gate_avx2(const float* g, const float* u, float* out, int n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const int full = n / 8 * 8;
  for (int i = 0; i < full; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    __m256 z = x;
    if constexpr (ACT == GateAct::gelu_approx) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      z = _mm256_mul_ps(_mm256_set1_ps(kGeluA), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(kGeluB), cube)));
    }
    const __m256 e = exp_avx2(_mm256_or_ps(z, sign));
    const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 s = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(u + i)));
  }
  if (full < n) {  // the tail through a padded copy, same operations
    alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
    std::copy(g + full, g + n, gt);
    std::copy(u + full, u + n, ut);
    gate_avx2<ACT>(gt, ut, ot, 8);
    std::copy(ot, ot + (n - full), out + full);
  }
}

template <GateAct ACT>
void gate_scalar(const float* g, const float* u, float* out, int n) {
  for (int i = 0; i < n; ++i) {
    const float x = g[i];
    const float z = ACT == GateAct::gelu_approx ? kGeluA * (x + kGeluB * (x * x * x)) : x;
    const float e = std::exp(-std::fabs(z));
    const float s = (z >= 0.0f ? 1.0f : e) / (1.0f + e);
    out[i] = x * s * u[i];
  }
}

template <GateAct ACT>
void gate_rows(Isa isa, const float* g, const float* u, float* out, int n) {
  switch (isa) {
    case Isa::avx512:
      gate_avx512<ACT>(g, u, out, n);
      return;
    case Isa::avx2:
      gate_avx2<ACT>(g, u, out, n);
      return;
    case Isa::scalar:
      gate_scalar<ACT>(g, u, out, n);
      return;
  }
}

} // namespace

void gate(Isa isa, GateAct act, const float* g, const float* u, float* out, int n) {
  if (act == GateAct::gelu_approx) {
    gate_rows<GateAct::gelu_approx>(isa, g, u, out, n);
  } else {
    gate_rows<GateAct::silu>(isa, g, u, out, n);
  }
}

} // namespace specmlx
