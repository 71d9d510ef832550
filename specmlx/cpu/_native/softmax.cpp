// Softmax over a vocabulary row. MLX's CPU exp is scalar on x86 (4.4 ms over 152k
// logits): at T > 0 each sampled row (a plain step, a draft pass, each verified position)
// paid that. An AVX-512 exp makes it ~0.1 ms. Scalar std::exp elsewhere.
#include "softmax.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"

namespace specmlx {
namespace {

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

SPECMLX_AVX512 void softmax_avx512(const float* x, float* out, int n) {
  const int full = n / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (n - full)) - 1);
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int i = 0; i < full; i += 16) {
    m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  }
  m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, x + full));
  const __m512 top = _mm512_set1_ps(lanes_max(m));
  // Four partial sums: independent adds keep the FMA pipes busy, and each sums ~V/64
  // terms, so float32 rounding stays small.
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int i = 0;
  for (; i + 64 <= full; i += 64) {
    const __m512 e0 = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), top));
    const __m512 e1 = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), top));
    const __m512 e2 = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 32), top));
    const __m512 e3 = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 48), top));
    _mm512_storeu_ps(out + i, e0);
    _mm512_storeu_ps(out + i + 16, e1);
    _mm512_storeu_ps(out + i + 32, e2);
    _mm512_storeu_ps(out + i + 48, e3);
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
    s2 = _mm512_add_ps(s2, e2);
    s3 = _mm512_add_ps(s3, e3);
  }
  for (; i < full; i += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), top));
    _mm512_storeu_ps(out + i, e);
    s0 = _mm512_add_ps(s0, e);
  }
  if (tail) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + full), top));
    _mm512_mask_storeu_ps(out + full, tail, e);
    s0 = _mm512_mask_add_ps(s0, tail, s0, e);
  }
  const float sum = lanes_sum(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  const __m512 scale = _mm512_set1_ps(1.0f / sum);
  for (i = 0; i < full; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(out + i), scale));
  }
  if (tail) {
    _mm512_mask_storeu_ps(out + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, out + full), scale));
  }
}

void softmax_scalar(const float* x, float* out, int n) {
  const float top = *std::max_element(x, x + n);
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    out[i] = std::exp(x[i] - top);
    sum += out[i];
  }
  const float scale = float(1.0 / sum);
  for (int i = 0; i < n; ++i) {
    out[i] *= scale;
  }
}

// out[i] = exp(x[i] - max x) / sum, on the ISA the kernels run with.
void softmax_row(const float* x, float* out, int n) {
  if (n <= 0) {
    return;
  }
  if (active_isa() == Isa::avx512) {
    softmax_avx512(x, out, n);
  } else {
    softmax_scalar(x, out, n);
  }
}

} // namespace

void Softmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  const int n = x.shape(-1);
  const size_t rows = x.size() / size_t(n);
  const float* src = x.data<float>();
  float* dst = out.data<float>();
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([src, dst, rows, n] {
    for (size_t r = 0; r < rows; ++r) {
      softmax_row(src + r * n, dst + r * n, n);
    }
  });
}

void Softmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[specmlx] the native softmax has no GPU kernel");
}

mx::array softmax(const mx::array& x, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] softmax runs on CPU streams only");
  }
  if (x.dtype() != mx::float32 || x.ndim() < 1) {
    throw std::invalid_argument("[specmlx] softmax takes a float32 array of rows");
  }
  return mx::array(
      x.shape(), mx::float32, std::make_shared<Softmax>(stream), {mx::contiguous(x, false, stream)});
}

} // namespace specmlx
