// RMSNorm. On the CPU mx.fast.rms_norm runs as its decomposition (square, sum, rsqrt,
// products: ~5 ops a call, 57 calls a 28-layer step); here it is one op. A row's sum of
// squares runs in one fixed order whatever the other rows are, so its result does not
// depend on the rows evaluated with it. AVX2 + FMA under both vector ISAs (so AVX-512 and
// AVX2 machines agree to the bit), a scalar loop where neither runs.
#include "rms_norm.h"

#include <immintrin.h>

#include <cmath>
#include <stdexcept>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "qmm.h"
#include "strided.h"

namespace specmlx {
namespace {

SPECMLX_AVX2 void row_avx2(const float* x, const float* w, float* y, int n, float eps) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const int full = n / 32 * 32;
  for (int i = 0; i < full; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
      acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  float sum = 0.0f;
  for (float v : lanes) {
    sum += v;
  }
  for (int i = full; i < n; ++i) {
    sum += x[i] * x[i];
  }
  const float r = 1.0f / std::sqrt(sum / float(n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  const int full8 = n / 8 * 8;
  for (int i = 0; i < full8; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
  }
  for (int i = full8; i < n; ++i) {
    y[i] = w[i] * (x[i] * r);
  }
}

void row_scalar(const float* x, const float* w, float* y, int n, float eps) {
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    sum += x[i] * x[i];
  }
  const float r = 1.0f / std::sqrt(sum / float(n) + eps);
  for (int i = 0; i < n; ++i) {
    y[i] = w[i] * (x[i] * r);
  }
}

} // namespace

void rms_norm_rows(const float* x, const float* w, float* y, size_t rows, int n, float eps) {
  const bool avx2 = active_isa() != Isa::scalar;
  for (size_t r = 0; r < rows; ++r) {
    (avx2 ? row_avx2 : row_scalar)(x + r * n, w, y + r * n, n, eps);
  }
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) {
    return;
  }
  const int n = x.shape(-1);
  const size_t rows = x.size() / size_t(n);
  float* dst = out.data<float>();
  const float eps = eps_;
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_output_array(out);
  encoder.dispatch([x, w, dst, rows, n, eps] {
    thread_local std::vector<float> x_copy, w_copy;
    const float* src = row_major(x, x_copy);
    const float* weight = row_major(w, w_copy);
    rms_norm_rows(src, weight, dst, rows, n, eps);
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[specmlx] the native RMSNorm has no GPU kernel");
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  const auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[specmlx] rms_norm runs on CPU streams only");
  }
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 ||
      weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("[specmlx] rms_norm takes float32 rows (..., D) and a float32 (D,) weight");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps), {x, weight});
}

} // namespace specmlx
