// Softmax over a vocabulary row. MLX's CPU exp is scalar on x86: at T > 0 each sampled
// row (a plain step, a draft pass, each verified position) paid a scalar exp per logit.
// Here a vector exp runs with AVX-512, or with AVX2 + FMA (for CPUs without AVX-512), and
// scalar std::exp without either. Why and how: README.md, "The softmax".
#include "softmax.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"
#include "vexp.h"

namespace specmlx {
namespace {

SPECMLX_AVX2 void softmax_avx2(const float* x, float* out, int n) {
  const int full = n / 8 * 8;
  const int rest = n - full;
  // Lanes [0, rest) of the tail: maskload reads (and maskstore writes) only those.
  const __m256i tail =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  // The tail's other lanes read as -inf: they cannot raise the max, and their exp is 0, so
  // they add nothing to the sum.
  const __m256 xtail = _mm256_blendv_ps(
      _mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + full, tail), _mm256_castsi256_ps(tail));
  __m256 m = xtail;
  for (int i = 0; i < full; i += 8) {
    m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  }
  const __m256 top = _mm256_set1_ps(lanes_max(m));
  // Eight partial sums of 8 lanes: as many independent adds, and as few terms per lane
  // (~V/64), as the AVX-512 path's four of 16, so float32 rounding stays as small.
  __m256 s[8];
  for (__m256& v : s) {
    v = _mm256_setzero_ps();
  }
  int i = 0;
  for (; i + 64 <= full; i += 64) {
    for (int j = 0; j < 8; ++j) {
      const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * j), top));
      _mm256_storeu_ps(out + i + 8 * j, e);
      s[j] = _mm256_add_ps(s[j], e);
    }
  }
  for (; i < full; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), top));
    _mm256_storeu_ps(out + i, e);
    s[0] = _mm256_add_ps(s[0], e);
  }
  if (rest) {
    const __m256 e = exp_avx2(_mm256_sub_ps(xtail, top));
    _mm256_maskstore_ps(out + full, tail, e);
    s[0] = _mm256_add_ps(s[0], e);
  }
  const __m256 s03 = _mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]));
  const __m256 s47 = _mm256_add_ps(_mm256_add_ps(s[4], s[5]), _mm256_add_ps(s[6], s[7]));
  const __m256 scale = _mm256_set1_ps(1.0f / lanes_sum(_mm256_add_ps(s03, s47)));
  for (i = 0; i < full; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(out + i), scale));
  }
  if (rest) {
    _mm256_maskstore_ps(out + full, tail, _mm256_mul_ps(_mm256_maskload_ps(out + full, tail), scale));
  }
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
  switch (active_isa()) {
    case Isa::avx512:
      softmax_avx512(x, out, n);
      return;
    case Isa::avx2:
      softmax_avx2(x, out, n);
      return;
    case Isa::scalar:
      softmax_scalar(x, out, n);
      return;
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
