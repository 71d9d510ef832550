// Vector exp for x <= 0 (AVX-512, and AVX2 + FMA to the same bits) and horizontal max and
// sum: shared by the row softmax (softmax.cpp) and attention (attention.cpp).
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "kernels.h"

namespace specmlx {

// exp(x) for x <= 0 (logits less their max), Cephes expf's reduction and polynomial
// (max relative error ~2 ulp): x = n ln2 + r, |r| <= ln2/2, exp(x) = 2^n (1 + r + r^2 p(r)).
// Below -104 the result is below half the smallest denormal, so scalef rounds it to
// exactly 0, as for a masked -inf.
SPECMLX_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Horizontal max and sum by a store: gcc 12's _mm512_reduce_* trip -Wuninitialized in
// its own headers, and this runs once per row.
SPECMLX_AVX512 inline float lanes_max(__m512 v) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  return *std::max_element(a, a + 16);
}

SPECMLX_AVX512 inline float lanes_sum(__m512 v) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  double sum = 0.0;
  for (float x : a) {
    sum += x;
  }
  return float(sum);
}

// 2^k for integers k in [-126, 127]: the bits of a float with exponent k and mantissa 0.
SPECMLX_AVX2 inline __m256 pow2_avx2(__m256i k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

// exp_avx512 on 8 lanes, to the bit: AVX2 has no scalef, so 2^n (n in [-150, 0]) is
// applied as two exact powers 2^(n - n/2) and 2^(n/2), each a normal float. y * 2^(n - n/2)
// is exact, so the only rounding is the last multiply's, as in scalef: denormal results
// match, and below -104 the product rounds to exactly 0, as for a masked -inf.
SPECMLX_AVX2 inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-104.0f));
  const __m256 n = _mm256_round_ps(
      _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(y, pow2_avx2(_mm256_sub_epi32(ni, half))), pow2_avx2(half));
}

SPECMLX_AVX2 inline float lanes_max(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  return *std::max_element(a, a + 8);
}

SPECMLX_AVX2 inline float lanes_sum(__m256 v) {
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  double sum = 0.0;
  for (float x : a) {
    sum += x;
  }
  return float(sum);
}

} // namespace specmlx
